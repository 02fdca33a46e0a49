"""The ``velox`` command: generate with a compressed cache, compare methods, list methods.

    velox generate --method tova --budget 256 "Why is the sky blue?"
    velox compare                       # the core five at two budgets plus the full cache
    velox methods

Bad arguments print one line on stderr and exit with status 2. Run as a command on Linux, the
process re-executes itself with OpenBLAS in ``LD_PRELOAD`` when it is installed and not yet
preloaded (``VELOX_NO_OPENBLAS=1`` opts out).
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
import sys
import time
from pathlib import Path
from typing import Any

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
CORE_METHODS = ("streaming_llm", "h2o", "tova", "snapkv", "kivi")
DEFAULT_BUDGETS = (64, 256)
FULL = "full"

__all__ = ["main", "method_configs", "budget_params", "parse_param"]


# --- arguments -----------------------------------------------------------------------

def parse_param(text: str) -> tuple[str, Any]:
    """``key=value`` -> ``(key, value)``; the value is an int, float, bool or string."""
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
    g.add_argument("prompt")
    g.add_argument("--method", default="tova", help="method key, or 'full' for no compression")
    g.add_argument("--budget", type=_positive_int, help="tokens kept (methods with a budget or window)")
    g.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a method parameter (repeatable)")
    g.add_argument("--model", help="an mlx-lm model folder (default: the embedded SmolLM2)")
    g.add_argument("--max-tokens", type=_positive_int, default=128)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)

    c = sub.add_parser("compare", help="perplexity, passkey, agreement, memory and speed of methods")
    c.add_argument("--methods", default=",".join(CORE_METHODS),
                   help="comma-separated method keys, or 'all' (default: the core five)")
    c.add_argument("--budgets", type=lambda s: _csv_list(_positive_int, s),
                   default=list(DEFAULT_BUDGETS),
                   help="budgets for methods with a budget or window (default: 64,256)")
    c.add_argument("--param", action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                   help="a parameter for every method that has it, or for one method")
    c.add_argument("--text", default="pride",
                   help="a shipped text (alice, holmes, pride) or a .txt file; passkey filler "
                        "is the shipped text, or pride for a file")
    c.add_argument("--context", type=_positive_int, default=512,
                   help="tokens streamed for perplexity (default 512)")
    c.add_argument("--prefix", type=_positive_int, help="tokens before the first scored one "
                   "(default: half the context)")
    c.add_argument("--chunk", type=_positive_int, default=64, help="tokens per scored chunk")
    c.add_argument("--prefill-chunk", type=_positive_int, default=512,
                   help="tokens per prefill forward (default 512)")
    c.add_argument("--new-tokens", type=_positive_int, default=16,
                   help="greedy tokens compared with the full cache (default 16)")
    c.add_argument("--passkey-lengths", type=lambda s: _csv_list(int, s), default=[384],
                   help="passkey prompt lengths in tokens (empty to skip)")
    c.add_argument("--passkey-depths", type=lambda s: _csv_list(float, s), default=[0.25, 0.75])
    c.add_argument("--passkey-trials", type=_positive_int, default=1)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--model", help="an mlx-lm model folder (default: the embedded SmolLM2)")
    c.add_argument("--out", help="folder for compare.json, .csv, .md and .png")
    c.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)

    sub.add_parser("methods", help="the table of registered methods")
    return p


# --- method configurations -----------------------------------------------------------

def _capacity_names(spec) -> list[str]:
    expr = spec.contract.get("capacity")
    if expr is None:
        return []
    return [n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)]


def budget_params(key: str, budget: int, given: dict[str, Any]) -> dict[str, Any] | None:
    """Parameters that make ``key`` keep ``budget`` tokens, or ``None`` if it has no budget.

    A ``budget`` parameter takes it directly; otherwise the one free integer parameter of the
    spec's capacity expression (e.g. StreamingLLM's ``window_size`` in ``n_sink +
    window_size``) is solved for so that the capacity equals ``budget``.
    """
    from velox.registry import get_method
    from velox.spec import evaluate

    spec = get_method(key).spec
    if "budget" in spec.params:
        return {"budget": budget}
    sink = spec.contract.get("sinks")
    free = [n for n in dict.fromkeys(_capacity_names(spec))
            if n in spec.params and spec.params[n].type == "int" and n != sink and n not in given]
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
        if "budget" in given:
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


def _label(method: str, params: dict[str, Any]) -> str:
    return method if not params else method + " " + ", ".join(f"{k}={v}" for k, v in params.items())


# --- OpenBLAS ------------------------------------------------------------------------

def _reexec_with_openblas(verbose: bool) -> None:
    """Re-execute this command with OpenBLAS preloaded (Linux, when it is installed)."""
    if not sys.platform.startswith("linux") or os.environ.get("VELOX_NO_OPENBLAS", "0") not in ("", "0"):
        return
    if os.environ.get("_VELOX_REEXEC") or not os.path.exists(OPENBLAS):
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if OPENBLAS in preload.replace(":", " ").split():
        return
    env = dict(os.environ, LD_PRELOAD=f"{OPENBLAS} {preload}".strip(), _VELOX_REEXEC="1")
    if verbose:
        print(f"velox: re-executing with LD_PRELOAD={OPENBLAS}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    script = sys.argv[0] if sys.argv and os.path.isfile(sys.argv[0]) else None
    head = [script] if script else ["-m", "velox.adapters.cli"]
    os.execve(sys.executable, [sys.executable, *head, *sys.argv[1:]], env)


# --- commands ------------------------------------------------------------------------

def _load(path: str | None, verbose: bool):
    from velox.adapters.smollm2 import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(path)
    if verbose:
        print(f"velox: model loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return model, tokenizer


def _factory(model, method: str, params: dict[str, Any]):
    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters.mlxlm import make_cache

    if method == FULL:
        return lambda: make_prompt_cache(model)
    return lambda: make_cache(model, method, **params)


def _fmt_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def cmd_methods(args) -> int:
    from velox.spec import method_table

    sys.stdout.write(method_table())
    return 0


def cmd_generate(args) -> int:
    from velox.spec import validate_params
    from velox.registry import get_method

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

    model, tokenizer = _load(args.model, args.verbose)
    caches = _factory(model, args.method, params)()
    prompt: Any = args.prompt
    if not args.no_chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                               add_generation_prompt=True)
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                prompt_cache=caches):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    mem = memory(caches)
    print()
    label = _label(args.method, params)
    if last is not None:
        print(f"[{label}] KV cache {_fmt_bytes(mem.kv_bytes)} for {mem.tokens} tokens "
              f"({mem.ratio:.2f}x vs fp16 {_fmt_bytes(mem.fp16_bytes)}); "
              f"prompt {last.prompt_tokens} tokens at {last.prompt_tps:.1f} tok/s, "
              f"decode {last.generation_tokens} tokens at {last.generation_tps:.1f} tok/s")
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
    return {
        "method": method,
        "params": ", ".join(f"{k}={v}" for k, v in params.items()),
        "capacity": _capacity(method, params),
        "kv_bytes": ev.agreement.memory.kv_bytes,
        "fp16_bytes": ev.agreement.memory.fp16_bytes,
        "tokens_seen": ev.agreement.memory.tokens,
        "ratio": ev.agreement.memory.ratio,
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


def _markdown(rows: list[dict], new_tokens: int) -> str:
    head = ["method", "parameters", "KV bytes", "ratio vs fp16", "perplexity", "Δ ppl vs full",
            "passkey", f"agreement ({new_tokens} tok)", "first diverge", "KL", "decode tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        pk = "-" if r["passkey"] is None else f"{r['passkey']:.2f}"
        lines.append("| " + " | ".join([
            f"`{r['method']}`", r["params"] or "-", _fmt_bytes(r["kv_bytes"]), f"{r['ratio']:.2f}x",
            f"{r['ppl']:.3f}", f"{r['ppl_delta_pct']:+.1f}%", pk, f"{r['agreement']:.2f}",
            str(r["first_divergence"]), f"{r['kl']:.4f}", f"{r['decode_tok_s']:.1f}",
        ]) + " |")
    return "\n".join(lines) + "\n"


def _point_label(row: dict) -> str:
    if row["method"] == FULL:
        return ""
    if row["capacity"] is not None:
        return f"{row['capacity']} tok"
    return row["params"] or "defaults"


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    palette = plt.cm.tab10 if len(methods) <= 10 else plt.cm.tab20
    colors = {m: palette(i % palette.N) for i, m in enumerate(methods)}
    shapes = "os^vDPXph<>"
    markers = {m: shapes[(i // 10) % len(shapes)] for i, m in enumerate(methods)}
    for ax, key, label in ((axes[0], "ppl", "perplexity (lower is better)"),
                           (axes[1], "passkey", "passkey accuracy")):
        for m in methods:
            pts = sorted((r["kv_bytes"] / 2**20, r[key], _point_label(r)) for r in rows
                         if r["method"] == m and r[key] is not None)
            if not pts:
                continue
            xs, ys, names = zip(*pts)
            if m == FULL:
                ax.axhline(ys[0], color=colors[m], linestyle=":", linewidth=1)
            ax.plot(xs, ys, marker="*" if m == FULL else markers[m], markersize=12 if m == FULL else 7,
                    color=colors[m], label=m, linestyle="-" if len(xs) > 1 else "none")
            for x, y, n in zip(xs, ys, names):
                if n:
                    ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("KV cache bytes held (MiB, log scale)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[1].set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_compare(args) -> int:
    from velox.registry import method_keys

    methods = list(method_keys()) if args.methods == "all" else \
        [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    configs = [(FULL, {})] + method_configs([m for m in methods if m != FULL], args.budgets,
                                            args.param)
    prefix = args.prefix or args.context // 2
    if not 1 <= prefix < args.context:
        raise ValueError(f"--prefix must be in [1, {args.context - 1}], got {prefix}")
    for d in args.passkey_depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"--passkey-depths must be in [0, 1], got {d}")
    text = _read_text(args.text)
    out = Path(args.out).expanduser() if args.out else None

    from tqdm import tqdm

    from velox.adapters import harness

    wall = time.perf_counter()
    cpu = time.process_time()
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
            ev = harness.evaluate(
                model, tokenizer, tokens, _factory(model, method, params), prefix=prefix,
                chunk=args.chunk, prefill_chunk=args.prefill_chunk, new_tokens=args.new_tokens,
                reference=reference, passkey_lengths=args.passkey_lengths,
                passkey_depths=args.passkey_depths, passkey_trials=args.passkey_trials,
                passkey_text=pk_text, seed=args.seed, progress=bar.update)
            bar.update(max(0, per_config - (bar.n - done)))
            if reference is None:
                reference, full_ppl = ev.reference, ev.perplexity.ppl
            rows.append(_row(method, params, ev, full_ppl))
            if args.verbose:
                r = rows[-1]
                tqdm.write(f"{_label(method, params)}: ppl {r['ppl']:.3f}, passkey {r['passkey']}, "
                           f"agreement {r['agreement']:.2f}, {r['seconds']:.1f} s", file=sys.stderr)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    table = _markdown(rows, args.new_tokens)
    sys.stdout.write(table)
    print(f"{len(configs)} configurations in {wall:.1f} s ({cpu:.1f} s of CPU time)")
    if out is not None:
        _write(out, rows, table, args, wall, cpu, prefix)
        print(f"wrote {out / 'compare.json'}, .csv, .md and .png")
    return 0


def _settings(args, wall: float, cpu: float, prefix: int) -> dict[str, Any]:
    import mlx.core as mx

    import velox

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
                    "openblas_preloaded": OPENBLAS in os.environ.get("LD_PRELOAD", ""),
                    "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "versions": {"velox": velox.__version__, "mlx": mx.__version__, "mlx_lm": mlx_lm_version,
                     "python": platform.python_version()},
    }


def _write(out: Path, rows: list[dict], table: str, args, wall: float, cpu: float,
           prefix: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(args, wall, cpu, prefix)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
              for k, v in r.items()} for r in rows]
    (out / "compare.json").write_text(json.dumps({"settings": settings, "rows": clean}, indent=2))
    buf = io.StringIO()
    fields = [k for k in clean[0] if k not in ("passkey_cells", "phase_seconds")]
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(clean)
    (out / "compare.csv").write_text(buf.getvalue())
    (out / "compare.md").write_text(table)
    title = (f"{settings['model']}: {args.context}-token '{args.text}' stream "
             f"(prefix {prefix}, chunk {args.chunk}); passkey {args.passkey_lengths} tokens")
    _plot(rows, out / "compare.png", title)


# --- entry point ---------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Run the ``velox`` command; returns the exit status.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``; only then may the
            process re-execute itself with OpenBLAS preloaded).
    Returns:
        0 on success, 2 on bad arguments (one line on stderr).
    """
    args = _parser().parse_args(argv)
    if argv is None and args.command in ("generate", "compare"):
        _reexec_with_openblas(args.verbose)
    handler = {"generate": cmd_generate, "compare": cmd_compare, "methods": cmd_methods}
    try:
        return handler[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        msg = " ".join(str(exc).split())
        print(f"velox: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
