"""The ``velox`` command: generate with a compressed cache, compare methods, list methods.

    velox generate --method tova --budget 256 "Why is the sky blue?"
    velox compare                       # the core five at two budgets plus the full cache
    velox methods
    velox serve --method tova --budget 2048 --port 8080   # mlx-lm's server, velox caches
    velox selftest --backend metal      # the Metal kernels against the mlx ops, on this Mac

Bad arguments print one line on stderr and exit with status 2, before any model is loaded.
OpenBLAS, when installed, is loaded in-process by ``import velox`` (``velox._blas``).
"""

from __future__ import annotations

import argparse
import ast
import csv
import datetime
import io
import json
import math
import os
import platform
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from velox._blas import OPENBLAS  # noqa: F401  (its path; velox._blas.loaded: whether in use)

CORE_METHODS = ("streaming_llm", "h2o", "tova", "snapkv", "kivi")
DEFAULT_BUDGETS = (64, 256)
FULL = "full"

__all__ = ["main", "method_configs", "budget_params", "parse_param"]


# --- arguments -----------------------------------------------------------------------

def parse_param(text: str) -> tuple[str, Any]:
    """``key=value`` -> ``(key, value)``; the value is an int, float, bool or string
    (comma-separated numbers stay the string they are: ``bit_schedule=8,4,2,1,1,0,0,0``)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--param expects key=value, got {text!r}")
    raw = raw.strip()
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key, raw
    if isinstance(value, tuple) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return key, raw  # comma-separated numbers: the string a list parameter takes
    if not isinstance(value, (int, float, str)):
        raise ValueError(f"--param {key}: {raw!r} is not a number, bool or string")
    return key, value


def _csv_list(kind, text: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="velox", description="KV-cache compression for mlx-lm.")
    p.add_argument("-v", "--verbose", action="store_true", help="say more on stderr")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream an answer through a compressed cache")
    g.add_argument("prompt", help="the question or text to continue")
    g.add_argument("--method", default="tova",
                   help="method key, or 'full' for no compression (default tova)")
    g.add_argument("--budget", type=_positive_int, help="tokens kept (methods with a budget or window)")
    g.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a method parameter (repeatable)")
    g.add_argument("--model", help="an mlx-lm model folder (default: the embedded SmolLM2)")
    g.add_argument("--max-tokens", type=_positive_int, default=128,
                   help="most tokens to generate (default 128)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)

    c = sub.add_parser("compare", help="perplexity, passkey, agreement, memory and speed of methods")
    c.add_argument("--methods", default=",".join(CORE_METHODS),
                   help="comma-separated method keys, or 'all' (default: the core five, "
                        f"{','.join(CORE_METHODS)})")
    c.add_argument("--budgets", type=lambda s: _csv_list(_positive_int, s), default=None,
                   help="budgets for methods with a budget or window (default: 64,256)")
    c.add_argument("--artifacts", action="append", default=[], metavar="METHOD=FILE",
                   help="a calibration artifact for a method (velox calibrate), e.g. "
                        "spectral=smollm2-spectral.safetensors")
    c.add_argument("--param", action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                   help="a parameter for every method that has it, or for one method")
    c.add_argument("--text", default="pride",
                   help="a shipped text (alice, holmes, pride) or a .txt file; passkey filler "
                        "is the shipped text, or pride for a file")
    c.add_argument("--context", type=_positive_int, default=512,
                   help="tokens streamed for perplexity (default 512)")
    c.add_argument("--prefix", type=_positive_int, help="tokens before the first scored one "
                   "(default: half the context)")
    c.add_argument("--chunk", type=_positive_int, default=64,
                   help="tokens per scored chunk (default 64; 1 is token-by-token decoding)")
    c.add_argument("--prefill-chunk", type=_positive_int, default=512,
                   help="tokens per prefill forward (default 512)")
    c.add_argument("--new-tokens", type=_positive_int, default=16,
                   help="greedy tokens compared with the full cache (default 16)")
    c.add_argument("--passkey-lengths", type=lambda s: _csv_list(int, s), default=[384],
                   help="passkey prompt lengths in tokens (default 384; empty to skip)")
    c.add_argument("--passkey-depths", type=lambda s: _csv_list(float, s), default=[0.25, 0.75],
                   help="where the key sits in the filler, 0 (start) to 1 (end) "
                        "(default 0.25,0.75)")
    c.add_argument("--passkey-trials", type=_positive_int, default=1,
                   help="prompts per length and depth, each with its own key and filler "
                        "(default 1)")
    c.add_argument("--seed", type=int, default=0,
                   help="draws the passkeys and their filler windows (default 0)")
    c.add_argument("--model", help="an mlx-lm model folder (default: the embedded SmolLM2)")
    c.add_argument("--out", help="folder for compare.json, .csv, .md and .png (checked, and "
                                 "created, before the run)")
    c.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)

    m = sub.add_parser("methods", help="the table of registered methods")
    m.add_argument("--markdown", action="store_true",
                   help="print the README's markdown table instead of the terminal one")

    cal = sub.add_parser("calibrate", help="fit a method's calibration artifact on a model")
    cal.add_argument("--method", required=True, help="a calibrated method (spectral, kvtc, palu, ...)")
    cal.add_argument("--out", required=True, help="the artifact to write (.safetensors)")
    cal.add_argument("--model", help="an mlx-lm model folder (default: the embedded SmolLM2)")
    cal.add_argument("--text", help="a UTF-8 text file to calibrate on (default: the built-in "
                                    "public-domain text)")
    cal.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                     help="a fitting parameter (repeatable), e.g. n_head_groups=2 for palu")
    cal.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)

    sub.add_parser("serve", add_help=False,
                   help="mlx-lm's OpenAI-compatible server with velox caches "
                        "(velox serve --help: velox's options, then mlx_lm.server's)"
                   ).add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    st = sub.add_parser("selftest", help="check a GPU backend's kernels against the mlx ops on "
                                         "this machine, and print a report to send back")
    st.add_argument("--backend", required=True, choices=["metal"],
                    help="the backend whose kernels to check (metal: an Apple GPU)")
    st.add_argument("--json", action="store_true", help="print the report as JSON")

    from velox.adapters import suite
    suite.add_parser(sub)
    return p


def cmd_calibrate(args) -> int:
    """``velox calibrate``: fit, check and write an artifact; print where it went."""
    from velox.adapters.artifacts import FITTERS, calibrate, save_artifact
    from velox.adapters.calibration import CALIBRATION_TEXT

    if args.method not in FITTERS:
        raise ValueError(f"{args.method} has no calibration (calibrated methods: "
                         f"{', '.join(sorted(FITTERS))})")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: folder {out.parent} does not exist")
    if args.text:
        text, source = Path(args.text).read_text(encoding="utf-8"), str(args.text)
    else:
        text, source = CALIBRATION_TEXT, "built-in: A Tale of Two Cities (opening) + Gettysburg Address"
    model, tokenizer = _load(args.model, getattr(args, "verbose", False))
    name = args.model or "SmolLM2-135M-Instruct (embedded GGUF, fp32)"
    t0 = time.perf_counter()
    params = dict(parse_param(p) for p in args.param)
    arrays, info = calibrate(args.method, model, tokenizer, text, model_name=name, source=source,
                             params=params)
    save_artifact(out, arrays, info)
    print(f"wrote {out}: {args.method} artifact for {name} ({info['layers']} layers, "
          f"{info['kv_heads']} kv heads, head_dim {info['head_dim']}) from {info['tokens']} tokens "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


# --- method configurations -----------------------------------------------------------

def _capacity_names(spec) -> list[str]:
    expr = spec.contract.get("capacity")
    if expr is None:
        return []
    return [n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)]


def _budget_names(spec) -> list[str]:
    """The parameters a budget may set: ``budget``, or else the integer parameters of the
    spec's capacity expression other than its sinks."""
    if "budget" in spec.params:
        return ["budget"]
    sink = spec.contract.get("sinks")
    return [n for n in dict.fromkeys(_capacity_names(spec))
            if n in spec.params and spec.params[n].type == "int" and n != sink]


def _budget_given(spec, given: dict[str, Any]) -> str | None:
    """The parameter in ``given`` that already sets what a budget would (every parameter a
    budget may set is given; the first of them), or ``None``."""
    names = _budget_names(spec)
    if names and all(n in given for n in names):
        return names[0]
    return None


def budget_params(key: str, budget: int, given: dict[str, Any]) -> dict[str, Any] | None:
    """Parameters that make ``key`` keep ``budget`` tokens, or ``None`` if it has no budget.

    A ``budget`` parameter takes it directly; otherwise the one free integer parameter of the
    spec's capacity expression (e.g. StreamingLLM's ``window_size`` in ``n_sink +
    window_size``) is solved for so that the capacity equals ``budget``. Raises
    ``ValueError`` when ``given`` sets that parameter already (``--budget 128 --param
    budget=64``: the budget given twice), whatever the two values.
    """
    from velox.registry import get_method
    from velox.spec import evaluate

    spec = get_method(key).spec
    taken = _budget_given(spec, given)
    if taken is not None:
        raise ValueError(f"{key}: the budget is given twice, as a budget of {budget} tokens and as "
                         f"{taken}={given[taken]!r}; give one of them (--budget or --param {taken}=...)")
    if "budget" in spec.params:
        return {"budget": budget}
    free = [n for n in _budget_names(spec) if n not in given]
    if len(free) != 1:
        return None
    name = free[0]
    env = {**spec.defaults, **given}
    c0 = evaluate(spec.contract["capacity"], {**env, name: 0})
    slope = evaluate(spec.contract["capacity"], {**env, name: 1}) - c0
    if slope <= 0 or (budget - c0) % slope:
        return None
    value = (budget - c0) // slope
    lowest = spec.params[name].min
    if lowest is not None and value < lowest:
        others = ", ".join(f"{k}={env[k]}" for k in dict.fromkeys(_capacity_names(spec))
                           if k != name and k in env)
        raise ValueError(f"budget {budget} leaves no room for {key}'s {name} "
                         f"(capacity {spec.contract['capacity']}, {others})")
    return {name: value}


def _bit_settings(key: str, given: dict[str, Any]) -> list[dict[str, Any]]:
    """The default setting and the spec's ``aggressive`` preset (its most aggressive one).

    Without such a preset, every ``*bit*`` parameter at its minimum stands in. Parameters the
    user gave win over the preset; one entry when nothing is left to change or when the
    setting violates the spec's constraints.
    """
    from velox.registry import get_method
    from velox.spec import validate_params

    spec = get_method(key).spec
    if "aggressive" in spec.presets:
        aggressive = {k: v for k, v in spec.presets["aggressive"].items() if k not in given}
    else:
        aggressive = {}
        for name, p in spec.params.items():
            if "bit" not in name or name in given or p.type not in ("int", "float", "choice"):
                continue
            low = min(p.choices) if p.type == "choice" else p.min
            if low is not None and low != p.default and not (p.min_exclusive and low == p.min):
                aggressive[name] = low
    if not aggressive:
        return [{}]
    try:
        validate_params(spec, {**given, **aggressive})
    except ValueError:
        return [{}]
    return [{}, aggressive]


def _split_params(params: list[str], methods: list[str]) -> tuple[dict, dict]:
    """``--param`` values: global ones and ``method.key`` ones, per method."""
    common: dict[str, Any] = {}
    scoped: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for text in params:
        key, value = parse_param(text)
        if "." in key:
            method, _, name = key.partition(".")
            if method not in scoped:
                raise ValueError(f"--param {text!r} names {method!r}, which is not compared")
            scoped[method][name] = value
        else:
            common[key] = value
    return common, scoped


def method_configs(methods: list[str], budgets: list[int], params: list[str]) -> list[tuple[str, dict]]:
    """The (method, parameters) pairs ``velox compare`` runs, validated against the specs.

    Budgets apply to methods with a budget (or a window that sets the capacity); methods
    without one run at their default and at their spec's ``aggressive`` preset (or, without
    a preset, every bit-width parameter at its minimum).
    ``--param key=value`` applies to every method that has ``key`` (an error if none has it),
    ``--param method.key=value`` to one method.
    """
    from velox.registry import get_method
    from velox.spec import validate_params

    for m in methods:
        get_method(m)  # unknown keys raise here
    common, scoped = _split_params(params, methods)
    used = set()
    out = []
    for m in methods:
        spec = get_method(m).spec
        given = {k: v for k, v in common.items() if k in spec.params}
        used |= set(given)
        given.update(scoped[m])
        if _budget_given(spec, given) is not None:  # the method's own budget wins over budgets
            variants = [{}]
        else:
            per_budget = [budget_params(m, b, given) for b in budgets]
            variants = per_budget if per_budget and None not in per_budget else _bit_settings(m, given)
        for v in variants:
            p = {**given, **v}
            validate_params(spec, p)
            out.append((m, p))
    unused = sorted(set(common) - used)
    if unused:
        raise ValueError(f"--param {', '.join(unused)}: no compared method has such a parameter")
    return out


def _budgets_once(methods: list[str], budgets: list[int], params: list[str]) -> None:
    """Refuse ``--budgets`` given together with a ``--param`` that sets a compared method's
    budget (``budget=64``, ``tova.budget=64``, or StreamingLLM's ``window_size``): the budget
    given twice. Without ``--budgets`` such a parameter sets that method's budget and the
    default budgets apply to the others."""
    from velox.registry import get_method

    common, scoped = _split_params(params, methods)
    twice = []
    for m in methods:
        spec = get_method(m).spec
        given = {**{k: v for k, v in common.items() if k in spec.params}, **scoped[m]}
        taken = _budget_given(spec, given)
        if taken is not None:
            twice.append(f"{m}'s {taken}={given[taken]!r}")
    if twice:
        raise ValueError(f"the budget is given twice: --budgets {','.join(map(str, budgets))} and "
                         f"--param {', '.join(twice)}; give one of them")


def _label(method: str, params: dict[str, Any]) -> str:
    return method if not params else method + " " + ", ".join(f"{k}={v}" for k, v in params.items())


# --- commands ------------------------------------------------------------------------

def _load(path: str | None, verbose: bool, group: Any = None):
    from velox.adapters.smollm2 import load_model

    t0 = time.perf_counter()
    if group is not None:  # started by mlx.launch: each process holds a shard of the heads
        from velox.adapters.sharding import load_sharded

        model, tokenizer = load_sharded(path, group)
    else:
        model, tokenizer = load_model(path)
    if verbose:
        print(f"velox: model loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return model, tokenizer


def _factory(model, method: str, params: dict[str, Any], artifacts: str | None = None):
    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters.mlxlm import make_cache

    if method == FULL:
        return lambda: make_prompt_cache(model)
    if artifacts is not None:
        return lambda: make_cache(model, method, artifacts=artifacts, **params)
    return lambda: make_cache(model, method, **params)


def _artifacts(items: list[str], methods: list[str]) -> dict[str, str]:
    """``--artifacts METHOD=FILE`` options as ``{method: file}``, each for a compared method."""
    out = {}
    for item in items:
        method, sep, path = item.partition("=")
        if not sep or not method or not path:
            raise ValueError(f"--artifacts takes METHOD=FILE, got {item!r}")
        if method not in methods:
            raise ValueError(f"--artifacts {item}: {method} is not among --methods")
        if not Path(path).is_file():
            raise ValueError(f"--artifacts {item}: no file {path}")
        out[method] = path
    return out


def _fmt_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def methods_text(width: int) -> str:
    """The registered methods as a table for a terminal ``width`` columns wide.

    One line per method (key, name, family, phases, queries, kernels), then its paper and
    parameter defaults wrapped under it.
    """
    from velox.spec import load_spec, spec_keys

    specs = [load_spec(k) for k in spec_keys()]
    head = ("key", "method", "family", "phases", "queries", "kernels")
    cells = [(s.key, s.name, s.family, s.phases, s.queries,
              ",".join(b for b in s.backends if b not in ("reference", "mlx")) or "-") for s in specs]
    widths = [max(len(r[i]) for r in [head, *cells]) for i in range(len(head))]
    width = max(width, 40)
    narrow = sum(widths) + 2 * (len(widths) - 1) > width  # kernels go under the row instead
    if narrow:
        head, widths = head[:-1], widths[:-1]
    wrap = textwrap.TextWrapper(width=width, initial_indent="    ", subsequent_indent="    ",
                                break_on_hyphens=False)

    def line(row) -> str:
        text = "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
        return text if len(text) <= width else textwrap.fill(text, width, subsequent_indent="  ")

    out = [line(head), line(["-" * w for w in widths])]
    for s, row in zip(specs, cells):
        paper = f"arXiv {s.arxiv}" if s.arxiv else s.venue
        params = ", ".join(f"{p.name}={p.default!r}" for p in s.params.values()) or "no parameters"
        kernels = f"; kernels: {row[-1]}" if narrow and row[-1] != "-" else ""
        out += [line(row[:len(head)]), wrap.fill(f"{paper}{kernels}; {params}")]
    from velox.registry import method_keys

    composed = [k for k in method_keys() if k not in {s.key for s in specs}]
    if composed:  # evictor+codec compositions: --method takes them like any method
        out += ["", textwrap.fill("compositions (an evictor's selection, its rows stored by "
                                  "a codec; --method takes these keys too):", width),
                wrap.fill(", ".join(composed))]
    return "\n".join(out) + "\n"


def cmd_methods(args) -> int:
    from velox.spec import method_table

    if args.markdown:
        sys.stdout.write(method_table())
    else:
        sys.stdout.write(methods_text(shutil.get_terminal_size((100, 24)).columns))
    return 0


def cmd_selftest(args) -> int:
    """``velox selftest --backend metal``: the backend's parity self-check (every kernel on a
    few decode steps against the ``mlx`` ops on this device, ``velox.selfcheck``), its report
    printed (MLX version, device, each check and kernel with its max error) and its verdict
    recorded for ``backend="auto"``. Exit 0 when every check passed, 1 otherwise (a check
    failed, or no Metal device)."""
    from velox import selfcheck

    report = selfcheck.run_checks()
    if report.available:
        selfcheck.record(report)
    sys.stdout.write(json.dumps(report.to_json(), indent=1) + "\n" if args.json else report.text())
    return 0 if report.passed else 1


def cmd_generate(args) -> int:
    from velox.spec import validate_params
    from velox.registry import get_method

    if args.no_chat and not args.prompt.strip():
        raise ValueError("the prompt is empty (with --no-chat the model needs at least one token)")
    params = dict(parse_param(p) for p in args.param)
    if args.method == FULL:
        if params or args.budget:
            raise ValueError("the full cache takes no --budget or --param")
    else:
        spec = get_method(args.method).spec
        if args.budget is not None:
            bp = budget_params(args.method, args.budget, params)
            if bp is None:
                raise ValueError(f"{args.method} has no budget or window parameter; use --param")
            params.update(bp)
        validate_params(spec, params)

    from mlx_lm.generate import stream_generate

    from velox.adapters.harness import memory
    from velox.adapters.sharding import launched_group

    group = launched_group()  # under mlx.launch: the model tensor-parallel over the processes
    rank = 0 if group is None else group.rank()
    out = sys.stdout if rank == 0 else io.StringIO()  # process 0 prints, the others follow
    model, tokenizer = _load(args.model, args.verbose and rank == 0, group)
    caches = _factory(model, args.method, params)()
    prompt: Any = args.prompt
    if not args.no_chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                               add_generation_prompt=True)
    elif not args.prompt.strip():
        raise ValueError("the prompt is empty and the model has no chat template")
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                prompt_cache=caches):
        out.write(last.text)
        out.flush()
    mem = memory(caches)
    print(file=out)
    label = _label(args.method, params)
    where = "" if group is None else f" in process 0 of {group.size()} (its shard of the kv heads)"
    if last is not None:
        print(f"[{label}] KV cache {_fmt_bytes(mem.kv_bytes)}{where} holding {mem.stored} of the "
              f"{mem.tokens} tokens seen; a full {mem.dtype} cache of them "
              f"{_fmt_bytes(mem.full_bytes)} ({mem.full_ratio:.2f}x the bytes held), as fp16 "
              f"{_fmt_bytes(mem.fp16_bytes)} ({mem.ratio:.2f}x); "
              f"prompt {last.prompt_tokens} tokens at {last.prompt_tps:.1f} tok/s, "
              f"decode {last.generation_tokens} tokens at {last.generation_tps:.1f} tok/s",
              file=out)
    return 0


def _read_text(name: str) -> str:
    """A shipped text by name, else a UTF-8 text file."""
    from velox.adapters.harness import load_text, text_names

    if name in text_names():
        return load_text(name)
    path = Path(name).expanduser()
    if name.endswith(".txt") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"text file {name!r} does not exist")
        return path.read_text(encoding="utf-8")
    return load_text(name)


def _capacity(method: str, params: dict) -> int | None:
    """Stored-token bound of a configuration (``None``: unbounded, or the full cache)."""
    from velox.registry import get_method

    if method == FULL:
        return None
    spec = get_method(method).spec
    return spec.capacity({**spec.defaults, **params})


def _row(method: str, params: dict, ev, full_ppl: float | None) -> dict[str, Any]:
    pk = ev.passkey
    ppl = ev.perplexity.ppl
    mem = ev.agreement.memory
    return {
        "method": method,
        "params": ", ".join(f"{k}={v}" for k, v in params.items()),
        "capacity": _capacity(method, params),
        "kv_bytes": mem.kv_bytes,
        "ratio_vs_full": None,  # filled in once the full cache's row is known
        "ratio_vs_fp16": mem.ratio,
        "fp16_bytes": mem.fp16_bytes,
        "dense_bytes": mem.full_bytes,
        "dtype": mem.dtype,
        "tokens_seen": mem.tokens,
        "tokens_stored": mem.stored,
        "ppl": ppl,
        "nll": ev.perplexity.nll,
        "ppl_delta_pct": 0.0 if full_ppl is None else 100.0 * (ppl / full_ppl - 1.0),
        "passkey": None if pk is None else pk.accuracy,
        "passkey_cells": None if pk is None else {f"{l}@{d}": a for (l, d), a in pk.by_cell.items()},
        "agreement": ev.agreement.match_rate,
        "first_divergence": ev.agreement.first_divergence,
        "kl": ev.agreement.kl,
        "top1": ev.agreement.top1,
        "decode_tok_s": ev.agreement.decode_tok_s,
        "seconds": ev.seconds,
        "phase_seconds": ev.phase_seconds,
    }


def _markdown(rows: list[dict], new_tokens: int, notes: list[str] = ()) -> str:
    """The compare table, then ``notes`` (what the ratios and the speed are measured against)."""
    head = ["method", "parameters", "KV bytes", "ratio vs full", "ratio vs fp16", "perplexity",
            "Δ ppl vs full", "passkey", f"agreement ({new_tokens} tok)", "first diverge", "KL",
            "decode tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        pk = "-" if r["passkey"] is None else f"{r['passkey']:.2f}"
        lines.append("| " + " | ".join([
            f"`{r['method']}`", r["params"] or "-", _fmt_bytes(r["kv_bytes"]),
            f"{r['ratio_vs_full']:.2f}x", f"{r['ratio_vs_fp16']:.2f}x",
            f"{r['ppl']:.3f}", f"{r['ppl_delta_pct']:+.1f}%", pk, f"{r['agreement']:.2f}",
            str(r["first_divergence"]), f"{r['kl']:.4f}", f"{r['decode_tok_s']:.1f}",
        ]) + " |")
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


def _notes(rows: list[dict], load: dict[str, Any], new_tokens: int) -> list[str]:
    """Lines under the table: what the ratios divide, and the machine's load during timing."""
    full = rows[0]
    tokens = full["tokens_seen"]
    slots = round(full["kv_bytes"] * tokens / full["dense_bytes"]) if full["dense_bytes"] else 0
    notes = [
        f"Ratios are bytes over the bytes held (higher is smaller). *vs full*: the full cache of "
        f"this run, {_fmt_bytes(full['kv_bytes'])} (mlx-lm's KVCache, {full['dtype']}, "
        f"{slots} slots allocated for the {tokens} tokens seen). *vs fp16*: "
        f"the {tokens} tokens seen as fp16 keys and values with no spare slots, "
        f"{_fmt_bytes(full['fp16_bytes'])}."]
    if any("qjl" in r["method"].split("+") for r in rows):
        notes.append(
            "qjl stores each key as the signs of a random projection (1 bit a coordinate) and "
            "its norm: the attention logits are unbiased but noisy estimates, and at a "
            "head_dim of 64 (this model's) the noise swamps the logits' differences, so its "
            "perplexity is far above the others'. Its paper evaluates larger heads; the figure "
            "is what the method gives here, not a fault of the run.")
    cpus = os.cpu_count() or 1
    if load["before"] is not None:
        lo = min(r["load_before"] for r in rows)
        hi = max(r["load_after"] for r in rows)
        notes.append(
            f"decode tok/s: {new_tokens - 1} whole-model decode steps per configuration, timed "
            f"while the 1-minute load average of this {cpus}-CPU machine was {lo:.2f} to "
            f"{hi:.2f} ({load['before']:.2f} before the run, {load['after']:.2f} after; the run "
            f"used {load['cpu_per_wall']:.2f} CPU-seconds per second). A load above {cpus}, the "
            f"CPU count, means other processes competed for the CPUs and the figures say more "
            f"about the machine than about the cache; time speed apart with "
            f"benchmarks/bench_decode.py.")
    else:
        notes.append(f"decode tok/s: {new_tokens - 1} whole-model decode steps per "
                     f"configuration (this run used {load['cpu_per_wall']:.2f} CPU-seconds per "
                     f"second); time speed apart with benchmarks/bench_decode.py.")
    return notes


def _loadavg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _point_label(row: dict) -> str:
    """A short name for one configuration: ``full``, ``tova 64`` or ``kivi bits=2, ...``."""
    if row["method"] == FULL:
        return "full"
    if row["capacity"] is not None:
        return f"{row['method']} {row['capacity']}"
    return f"{row['method']} {row['params'] or 'defaults'}"


def pareto(points: list[tuple[float, float]], *, lower_is_better: bool) -> list[int]:
    """Indices of the points no other point beats: at most as many bytes and a better score.

    ``points`` are ``(bytes, score)``; the result is in increasing bytes.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1] if lower_is_better
                                                      else -points[i][1]))
    best, out = None, []
    for i in order:
        y = points[i][1]
        if y is None or (isinstance(y, float) and not math.isfinite(y)):
            continue
        if best is None or (y < best if lower_is_better else y > best):
            out.append(i)
            best = y
    return out


def _nice_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 (or 1-2-3-5) ticks covering ``[lo, hi]`` (at least three)."""
    for steps in ((1, 2, 5), (1, 2, 3, 5)):
        ticks = []
        for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
            ticks += [m * 10.0 ** e for m in steps]
        inside = [t for t in ticks if lo <= t <= hi]
        if len(inside) >= 4:
            return inside
    if len(inside) < 3:  # a narrow range: add the neighbours
        below = [t for t in ticks if t < lo][-1:]
        above = [t for t in ticks if t > hi][:1]
        inside = below + inside + above
    return inside


def _place_labels(ax, items: list[tuple[float, float, str, Any]], renderer, avoid=()) -> None:
    """Annotate ``(x, y, text, color)`` points, moving each label until it overlaps no other
    label and none of the ``avoid`` artists."""
    offsets = [(6, 5, "left", "bottom"), (6, -5, "left", "top"), (-6, 5, "right", "bottom"),
               (-6, -5, "right", "top"), (6, 17, "left", "bottom"), (6, -17, "left", "top"),
               (-6, 17, "right", "bottom"), (-6, -17, "right", "top"), (6, 29, "left", "bottom"),
               (6, -29, "left", "top")]
    placed = [a.get_window_extent(renderer) for a in avoid]
    frame = ax.get_window_extent(renderer)
    for x, y, text, color in sorted(items, key=lambda t: (t[0], t[1])):
        for dx, dy, ha, va in offsets:
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha,
                              va=va, fontsize=7.5, color=color, zorder=6,
                              bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
            box = ann.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(b) for b in placed):
                placed.append(box)
                break
            ann.remove()
        else:  # no free spot: the first one, on top
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=offsets[0][:2],
                              fontsize=7.5, color=color, zorder=6)
            placed.append(ann.get_window_extent(renderer))


def _plot(rows: list[dict], path: Path, title: str) -> None:
    """Perplexity and passkey accuracy against the bytes held, with each panel's frontier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.8))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    palette = plt.cm.tab10 if len(methods) <= 10 else plt.cm.tab20
    colors = {m: palette(i % palette.N) for i, m in enumerate(methods)}
    shapes = "osD^vPXph<>"
    markers = {m: "*" if m == FULL else shapes[i % len(shapes)] for i, m in enumerate(methods)}
    mib = [r["kv_bytes"] / 2**20 for r in rows]
    lo, hi = min(mib) / 1.3, max(mib) * 1.3
    ticks = _nice_ticks(lo, hi)
    lo, hi = min(lo, ticks[0]), max(hi, ticks[-1])
    renderer = fig.canvas.get_renderer()
    panels = ((axes[0], "ppl", "perplexity (lower is better)", True),
              (axes[1], "passkey", "passkey accuracy (higher is better)", False))
    for ax, key, label, lower in panels:
        pts = [(x, r[key], r) for x, r in zip(mib, rows)
               if r[key] is not None and math.isfinite(r[key])]
        fixed = []  # texts the point labels keep clear of
        for m in methods:
            mine = sorted((x, y) for x, y, r in pts if r["method"] == m)
            if not mine:
                continue
            xs, ys = zip(*mine)
            if m == FULL:
                ax.axhline(ys[0], color="0.5", linestyle=":", linewidth=1, zorder=1)
                fixed.append(ax.annotate("full cache", (1.0, ys[0]), xycoords=("axes fraction", "data"),
                            xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom",
                            fontsize=7.5, color="0.4"))
            ax.plot(xs, ys, marker=markers[m], markersize=14 if m == FULL else 7, color=colors[m],
                    markerfacecolor=colors[m] if m == FULL else "none", markeredgewidth=1.6,
                    linestyle="-" if len(xs) > 1 else "none", linewidth=1, alpha=0.9, zorder=3,
                    label=m)
        front = [pts[i] for i in pareto([(x, y) for x, y, _ in pts], lower_is_better=lower)]
        if front:
            fx = [x for x, _, _ in front] + [hi]
            fy = [y for _, y, _ in front] + [front[-1][1]]
            ax.step(fx, fy, where="post", color="0.2", linewidth=5, alpha=0.15, zorder=2,
                    solid_capstyle="butt")
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("KV cache bytes held (MiB, log scale)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if key == "passkey":
            ax.set_ylim(-0.08, 1.25)
            ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        else:  # perplexity on a log axis: one outlier (QJL at head_dim 64) flattens no one
            ys = [y for _, y, _ in pts]
            ax.set_yscale("log")
            ratio = max(ys) / min(ys) if min(ys) > 0 else 1.0
            ax.set_ylim(min(ys) / ratio ** 0.06 / 1.02, max(ys) * ratio ** 0.25 * 1.05)
            ax.set_ylabel(label + ", log scale")
        # each budget once, over its points, with the method that scores best there
        caps: dict[int, list[tuple[float, float, str]]] = {}
        for x, y, r in pts:
            if r["capacity"] is not None:
                caps.setdefault(r["capacity"], []).append((x, y, r["method"]))
        for cap, group in caps.items():
            gx = math.exp(sum(math.log(x) for x, _, _ in group) / len(group))
            top = (min if lower else max)(y for _, y, _ in group)
            best = list(dict.fromkeys(m for _, y, m in group if y == top))
            names = ", ".join(best) if len(best) <= 2 else f"{len(best)} tied"
            fixed.append(ax.annotate(f"budget {cap}\nbest: {names}", (gx, 1.0),
                        xycoords=("data", "axes fraction"), xytext=(0, -4),
                        textcoords="offset points", ha="center", va="top", fontsize=8,
                        color="0.25", zorder=7,
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.8", alpha=0.9)))
        fig.canvas.draw()
        _place_labels(ax, [(x, y, _point_label(r), colors[r["method"]]) for x, y, r in front
                           if r["method"] != FULL and (lower or y > 0)], renderer, fixed)
    handles, names = axes[0].get_legend_handles_labels()
    frontier = plt.Line2D([], [], color="0.2", linewidth=5, alpha=0.15)
    fig.legend([*handles, frontier], [*names, "frontier (best at or below each size; labelled)"],
               loc="lower center", ncol=min(len(names) + 1, 7), fontsize=8.5, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07 + 0.035 * ((len(names) + 1) // 7), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


OUT_FILES = ("compare.json", "compare.csv", "compare.md", "compare.png")


def _prepare_out(out: Path) -> None:
    """Create the ``--out`` folder now, so a bad path fails before the run, not after it."""
    for name in OUT_FILES:
        if (out / name).is_dir():
            raise ValueError(f"--out {out}: {out / name} is a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: the folder is not writable")


def cmd_compare(args) -> int:
    from velox.registry import method_keys

    methods = list(method_keys()) if args.methods == "all" else \
        [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    if args.budgets is None:
        args.budgets = list(DEFAULT_BUDGETS)
    else:
        _budgets_once([m for m in methods if m != FULL], args.budgets, args.param)
    configs = [(FULL, {})] + method_configs([m for m in methods if m != FULL], args.budgets,
                                            args.param)
    artifacts = _artifacts(args.artifacts, methods)
    if args.context < 2:
        raise ValueError(f"--context must be at least 2 (one context token and one scored), "
                         f"got {args.context}")
    prefix = args.prefix or args.context // 2
    if not 1 <= prefix < args.context:
        raise ValueError(f"--prefix must be in [1, {args.context - 1}], got {prefix}")
    for d in args.passkey_depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"--passkey-depths must be in [0, 1], got {d}")
    text = _read_text(args.text)
    out = Path(args.out).expanduser() if args.out else None
    if out is not None:
        _prepare_out(out)

    from tqdm import tqdm

    from velox.adapters import harness

    wall = time.perf_counter()
    cpu = time.process_time()
    load_before = _loadavg()
    model, tokenizer = _load(args.model, args.verbose)
    tokens = harness.text_tokens(tokenizer, text, args.context)
    pk_text = args.text if args.text in harness.text_names() else "pride"
    prompts = len(args.passkey_lengths) * len(args.passkey_depths) * args.passkey_trials
    per_config = (args.context + 2 * args.new_tokens
                  + (sum(args.passkey_lengths) // max(1, len(args.passkey_lengths)) + 8) * prompts)
    # warm-up: a few decode steps, so the first configuration's timing has no first-call costs
    harness.speed(model, tokens[:16], _factory(model, FULL, {}), steps=4)
    rows = []
    reference = None
    full_ppl = None
    with tqdm(total=per_config * len(configs), unit="tok", desc="compare", file=sys.stderr,
              disable=None, dynamic_ncols=True) as bar:
        for method, params in configs:
            bar.set_description(_label(method, params))
            done = bar.n
            before, t_wall, t_cpu = _loadavg(), time.perf_counter(), time.process_time()
            ev = harness.evaluate(
                model, tokenizer, tokens, _factory(model, method, params, artifacts.get(method)),
                prefix=prefix,
                chunk=args.chunk, prefill_chunk=args.prefill_chunk, new_tokens=args.new_tokens,
                reference=reference, passkey_lengths=args.passkey_lengths,
                passkey_depths=args.passkey_depths, passkey_trials=args.passkey_trials,
                passkey_text=pk_text, seed=args.seed, progress=bar.update)
            bar.update(max(0, per_config - (bar.n - done)))
            if reference is None:
                reference, full_ppl = ev.reference, ev.perplexity.ppl
            row = _row(method, params, ev, full_ppl)
            t_wall = time.perf_counter() - t_wall
            row.update(load_before=before, load_after=_loadavg(),
                       cpu_per_wall=(time.process_time() - t_cpu) / t_wall if t_wall else None)
            rows.append(row)
            if args.verbose:
                r = rows[-1]
                tqdm.write(f"{_label(method, params)}: ppl {r['ppl']:.3f}, passkey {r['passkey']}, "
                           f"agreement {r['agreement']:.2f}, {r['seconds']:.1f} s", file=sys.stderr)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    for r in rows:
        r["ratio_vs_full"] = rows[0]["kv_bytes"] / r["kv_bytes"] if r["kv_bytes"] else math.inf
    load = {"before": load_before, "after": _loadavg(), "cpu_per_wall": cpu / wall}
    table = _markdown(rows, args.new_tokens, _notes(rows, load, args.new_tokens))
    sys.stdout.write(table)
    print(f"{len(configs)} configurations in {wall:.1f} s ({cpu:.1f} s of CPU time)")
    if out is not None:
        failed = _write(out, rows, table, args, wall, cpu, prefix, load)
        written = [n for n in OUT_FILES if n not in failed]
        if written:
            print(f"wrote {', '.join(str(out / n) for n in written)}")
        for name, why in failed.items():
            print(f"velox: error: could not write {out / name}: {why}", file=sys.stderr)
        if failed:
            return 1
    return 0


def _settings(args, wall: float, cpu: float, prefix: int, load: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    import velox
    from velox import _blas

    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover
        mlx_lm_version = "?"
    return {
        "command": "velox " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0] else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF, fp32)",
        "text": args.text, "context": args.context, "prefix": prefix, "chunk": args.chunk,
        "prefill_chunk": args.prefill_chunk, "new_tokens": args.new_tokens,
        "budgets": args.budgets, "params": args.param,
        "passkey": {"lengths": args.passkey_lengths, "depths": args.passkey_depths,
                    "trials": args.passkey_trials, "seed": args.seed},
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "cpus": os.cpu_count(), "device": str(mx.default_device()),
                    "openblas": _blas.loaded is not None, "openblas_status": _blas.reason,
                    "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
                    "load_average_before": load["before"], "cpu_per_wall": round(load["cpu_per_wall"], 2)},
        "versions": {"velox": velox.__version__, "mlx": mx.__version__, "mlx_lm": mlx_lm_version,
                     "python": platform.python_version()},
    }


def _write(out: Path, rows: list[dict], table: str, args, wall: float, cpu: float,
           prefix: int, load: dict[str, Any]) -> dict[str, str]:
    """Write every file it can; returns ``{file name: why not}`` for those it could not."""
    failed: dict[str, str] = {}

    def attempt(name: str, write) -> None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            write(out / name)
        except Exception as exc:  # a finished run must not be lost to one file
            failed[name] = " ".join(str(exc).split()) or type(exc).__name__

    settings = _settings(args, wall, cpu, prefix, load)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
              for k, v in r.items()} for r in rows]
    attempt("compare.json", lambda p: p.write_text(
        json.dumps({"settings": settings, "rows": clean}, indent=2)))
    buf = io.StringIO()
    fields = [k for k in clean[0] if k not in ("passkey_cells", "phase_seconds")]
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(clean)
    attempt("compare.csv", lambda p: p.write_text(buf.getvalue()))
    attempt("compare.md", lambda p: p.write_text(table))
    lengths = ", ".join(str(n) for n in args.passkey_lengths) or "none"
    title = (f"{settings['model']}: {args.context}-token '{args.text}' stream (prefix {prefix}, "
             f"chunk {args.chunk}); passkey prompts of {lengths} tokens")
    attempt("compare.png", lambda p: _plot(rows, p, title))
    return failed


# --- entry point ---------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Run the ``velox`` command; returns the exit status.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).
    Returns:
        0 on success, 2 on bad arguments (one line on stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    lead = 0
    while lead < len(argv) and argv[lead] in ("-v", "--verbose"):
        lead += 1
    if argv[lead:lead + 1] == ["serve"]:  # its flags are velox's and mlx_lm.server's
        from velox.adapters import serve

        return serve.main(argv[lead + 1:])
    args = _parser().parse_args(argv)
    from velox.adapters import suite

    handler = {"generate": cmd_generate, "compare": cmd_compare, "methods": cmd_methods,
               "calibrate": cmd_calibrate, "eval": suite.run, "selftest": cmd_selftest}
    try:
        return handler[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        msg = " ".join(str(exc).split())
        print(f"velox: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
