"""Long-decode quality of the quantizing caches on SmolLM2: the decode-style protocol.

SmolLM2-135M-Instruct (float32, CPU) reads one shipped text (``--text``, default ``pride``, the
text ``velox compare`` and ``velox eval`` stream for their language-model scores). For every
cache row, in one process and on the same tokens:

* the first ``--prefill`` tokens (1,536) go into a fresh cache in forwards of ``--chunk`` tokens
  (512), as mlx-lm's ``generate`` prefills a prompt;
* then the next ``--score`` tokens (512) are fed one token a step, ``model(tokens[None],
  cache=caches)`` as mlx-lm's ``generate_step`` calls it, so the cache runs its own update path
  (compressing) at every step; step ``i`` feeds token ``prefill + i`` and scores the model's
  prediction of token ``prefill + i + 1`` (``prefill + score + 1`` tokens are read).

Per row: KV MiB (``nbytes`` of the caches after the run, checked against the bytes of the
arrays their ``state`` holds), perplexity over the scored tokens with a 95% block-bootstrap
interval over token positions (blocks of ``--block`` tokens), its change against the full
cache (a paired bootstrap of the per-token NLL difference, same blocks), top-1 agreement with
the full cache's argmax (Wilson interval over positions) and the mean KL(full || cache) of the
next-token distributions (block bootstrap). The full cache (mlx-lm's ``KVCache``) is the
reference and always runs first.

Rows are ``name[:key=value,key=value]``: ``full`` (mlx-lm ``KVCache``), ``mlxlm-q`` (mlx-lm's
``QuantizedKVCache``; its keyword defaults, ``group_size=64, bits=8``, read from its
signature) or any velox method key, whose parameters go to ``make_cache`` as given::

    python benchmarks/long_decode_quality.py \\
        --json docs/results/codecs/long-decode-smollm2.json \\
        --md docs/results/codecs/long-decode-smollm2.md \\
        --plot docs/results/codecs/long-decode-smollm2.png
    python benchmarks/long_decode_quality.py --rows full "kivi:bits=3" "mlxlm-q:bits=4" \\
        "turboquant_mse:bits=3,value_codec=mse,value_bits=3"
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import velox  # noqa: F401  first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core
import mlx.core as mx
import numpy as np

FULL = "full"
MLXLM_Q = "mlxlm-q"
DEFAULT_ROWS = (
    "full", "mlxlm-q:bits=8", "mlxlm-q:bits=4",
    "kivi:bits=2", "kivi:bits=3", "kivi:bits=4",
    "turboquant_mse:bits=2", "turboquant_mse:bits=3", "turboquant_mse:bits=4",
    "turboquant_prod:bits=3", "turboquant_prod:bits=4",
    "turboquant_rvq:bits=2", "polar", "spectral:bits=3", "qjl",
    "tova+turboquant_prod:budget=256,bits=3", "tova+turboquant_mse:budget=256,bits=3",
)
MIB = 1 << 20


# --- pure helpers --------------------------------------------------------------------

def parse_row(text: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,key=value"`` -> ``(name, {key: value})``; values as ``--param`` reads
    them (int, float, bool or string; an item without ``=`` continues the value before it, so
    a comma-separated value such as ``bit_schedule=8,4,2,1,1,0,0,0`` stays one string)."""
    from velox.adapters.cli import parse_param

    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"a row needs a name before ':', got {text!r}")
    items: list[str] = []
    for item in rest.split(","):
        if not item.strip():
            continue
        if "=" not in item and items:  # a comma inside a value: bit_schedule=8,4,2,1,1,0,0,0
            items[-1] += "," + item.strip()
        else:
            items.append(item)
    params: dict[str, Any] = {}
    for item in items:
        key, value = parse_param(item)
        if key in params:
            raise ValueError(f"row {text!r} gives {key} twice")
        params[key] = value
    return name, params


def row_label(name: str, params: dict[str, Any]) -> str:
    """The table's name of a row: ``kivi bits=2``, ``mlx-lm QuantizedKVCache bits=4, ...``."""
    base = {FULL: "mlx-lm KVCache (full)", MLXLM_Q: "mlx-lm QuantizedKVCache"}.get(name, name)
    return base + ("" if not params else " " + ", ".join(f"{k}={v}" for k, v in params.items()))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities along the last axis (float64)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def step_scores(logprobs: np.ndarray, target: int,
                reference: np.ndarray | None) -> tuple[float, int, float]:
    """One position's (NLL of ``target``, argmax, KL(reference || logprobs)); KL is 0 without a
    reference. Both are log-probabilities over the vocabulary."""
    nll = -float(logprobs[target])
    top = int(np.argmax(logprobs))
    if reference is None:
        return nll, top, 0.0
    ref = np.asarray(reference, dtype=np.float64)
    kl = float(np.sum(np.exp(ref) * (ref - logprobs)))
    return nll, top, max(kl, 0.0)


def figures(nll: np.ndarray, argmax: np.ndarray, kl: np.ndarray, *, ref_nll: np.ndarray,
            ref_argmax: np.ndarray, block: int = 32, reps: int = 1000, seed: int = 0,
            confidence: float = 0.95) -> dict[str, Any]:
    """Perplexity, its change against the reference, top-1 agreement and mean KL of one row,
    each with its interval (see the module docstring)."""
    from velox.adapters.suite import block_bootstrap, wilson

    nll = np.asarray(nll, dtype=np.float64)
    ref_nll = np.asarray(ref_nll, dtype=np.float64)
    kl = np.asarray(kl, dtype=np.float64)
    if not nll.size == ref_nll.size == len(argmax) == len(ref_argmax) == kl.size:
        raise ValueError("a row's per-token arrays and the reference's must have one length")
    kw = dict(block=block, reps=reps, confidence=confidence, seed=seed)
    lo, hi = block_bootstrap(nll, **kw)
    diff = nll - ref_nll
    dlo, dhi = block_bootstrap(diff, **kw)
    agree = int(np.sum(np.asarray(argmax) == np.asarray(ref_argmax)))
    tlo, thi = wilson(agree, nll.size, confidence)
    klo, khi = block_bootstrap(kl, **kw)
    return {
        "tokens": int(nll.size), "block": block, "bootstrap": reps, "confidence": confidence,
        "nll": float(nll.mean()), "nll_lo": lo, "nll_hi": hi,
        "ppl": math.exp(nll.mean()), "ppl_lo": math.exp(lo), "ppl_hi": math.exp(hi),
        "ppl_change_pct": 100 * math.expm1(diff.mean()),
        "ppl_change_pct_lo": 100 * math.expm1(dlo), "ppl_change_pct_hi": 100 * math.expm1(dhi),
        "top1_agree": agree, "top1": agree / nll.size, "top1_lo": tlo, "top1_hi": thi,
        "kl": float(kl.mean()), "kl_lo": klo, "kl_hi": khi,
    }


def table_header() -> str:
    return ("| cache | KV MiB | ppl [95%] | Δ ppl vs full [95%] | top-1 = full [95%] "
            "| KL(full ‖ cache) [95%] | s |\n|---|---|---|---|---|---|---|")


def table_row(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"| {row['label']} | - | failed: {row['error']} | | | | {row['seconds']:.0f} |"
    f = row["figures"]
    return (f"| {row['label']} | {row['kv_bytes'] / MIB:.2f} "
            f"| {f['ppl']:.2f} [{f['ppl_lo']:.2f}, {f['ppl_hi']:.2f}] "
            f"| {f['ppl_change_pct']:+.1f}% [{f['ppl_change_pct_lo']:+.1f}, "
            f"{f['ppl_change_pct_hi']:+.1f}] "
            f"| {f['top1']:.3f} [{f['top1_lo']:.3f}, {f['top1_hi']:.3f}] "
            f"| {f['kl']:.4f} [{f['kl_lo']:.4f}, {f['kl_hi']:.4f}] | {row['seconds']:.0f} |")


# --- caches --------------------------------------------------------------------------

def quantized_defaults() -> dict[str, Any]:
    """mlx-lm's ``QuantizedKVCache`` keyword defaults (``group_size``, ``bits``)."""
    import inspect

    from mlx_lm.models.cache import QuantizedKVCache

    sig = inspect.signature(QuantizedKVCache.__init__)
    return {k: p.default for k, p in sig.parameters.items()
            if k != "self" and p.default is not inspect.Parameter.empty}


def make_caches(model, name: str, params: dict[str, Any]) -> list:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    if name == FULL:
        if params:
            raise ValueError(f"the full cache takes no parameters, got {params}")
        return make_prompt_cache(model)
    if name == MLXLM_Q:
        kw = {**quantized_defaults(), **params}
        return [QuantizedKVCache(**kw) if type(c) is KVCache else c
                for c in make_prompt_cache(model)]
    from velox.adapters.mlxlm import make_cache

    return make_cache(model, name, **params)


def array_bytes(caches: list) -> int:
    """Bytes of the distinct arrays the caches' ``state`` hold: an array several layers hold
    (a cross-layer method's layer holding another layer's, the same ``mx.array``) once."""
    from velox.decode import arrays

    seen = {}
    for c in caches:
        seen.update({id(a): a for a in arrays(c.state)})
    return sum(a.nbytes for a in seen.values())


# --- the run -------------------------------------------------------------------------

def run_row(model, tokens: list[int], caches: list, *, prefill: int, score: int, chunk: int,
            reference: np.ndarray | None, keep: bool) -> dict[str, Any]:
    """Prefill, then ``score`` single-token steps; per-token NLL, argmax and KL (and the
    log-probabilities when ``keep``)."""
    t0 = time.perf_counter()
    last = None
    for i in range(0, prefill, chunk):
        out = model(mx.array(tokens[i:min(i + chunk, prefill)])[None], cache=caches)
        if i + chunk >= prefill:
            last = out[0, -1].astype(mx.float32)
            mx.eval(last, [c.state for c in caches])
        else:
            mx.eval([c.state for c in caches])
    t1 = time.perf_counter()
    nll = np.zeros(score)
    top = np.zeros(score, dtype=np.int64)
    kl = np.zeros(score)
    kept = np.zeros((score, 0), dtype=np.float32)
    for s in range(score):
        logits = model(mx.array([[tokens[prefill + s]]]), cache=caches)[0, -1].astype(mx.float32)
        mx.eval(logits, [c.state for c in caches])
        lp = log_softmax(np.array(logits))
        if keep:
            if kept.shape[1] == 0:
                kept = np.zeros((score, lp.size), dtype=np.float32)
            kept[s] = lp
        ref = None if reference is None else reference[s]
        nll[s], top[s], kl[s] = step_scores(lp, tokens[prefill + s + 1], ref)
    t2 = time.perf_counter()
    first = -float(log_softmax(np.array(last))[tokens[prefill]])
    return {"nll": nll, "argmax": top, "kl": kl, "logprobs": kept if keep else None,
            "prefill_last_nll": first, "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1}


def _versions() -> dict[str, str]:
    import mlx_lm

    from velox import _blas

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "velox": velox.__version__,
            "numpy": np.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "machine": platform.machine(),
            "openblas": bool(getattr(_blas, "loaded", False))}


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5.5))
    for r in ok:
        f, x = r["figures"], r["kv_bytes"] / MIB
        a.errorbar(x, f["ppl_change_pct"], yerr=[[f["ppl_change_pct"] - f["ppl_change_pct_lo"]],
                                                  [f["ppl_change_pct_hi"] - f["ppl_change_pct"]]],
                   fmt="o", capsize=3)
        a.annotate(r["short"], (x, f["ppl_change_pct"]), fontsize=7, xytext=(4, 3),
                   textcoords="offset points")
        if r["method"] == FULL:
            continue  # KL 0: off a log axis
        b.errorbar(x, max(f["kl"], 1e-6), yerr=[[f["kl"] - f["kl_lo"]], [f["kl_hi"] - f["kl"]]],
                   fmt="o", capsize=3)
        b.annotate(r["short"], (x, max(f["kl"], 1e-6)), fontsize=7, xytext=(4, 3),
                   textcoords="offset points")
    a.axhline(0, color="grey", lw=0.8)
    a.set_xscale("log")
    a.set_yscale("symlog", linthresh=10)
    a.set_xlabel("KV MiB after the run (log)")
    a.set_ylabel("perplexity change vs full cache, % (symlog)")
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("KV MiB after the run (log)")
    b.set_ylabel("mean KL(full || cache), nats (log)")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _short(name: str, params: dict[str, Any]) -> str:
    base = {FULL: "full", MLXLM_Q: "mlx-lm q"}.get(name, name)
    return base + "".join(f" {v}-bit" if k == "bits" else f" {k}={v}" for k, v in params.items())


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    p = meta["protocol"]
    lines = [
        f"# Long-decode quality on {meta['model']}",
        "",
        f"`{meta['command']}`",
        "",
        f"Text `{p['text']}` ({p['text_tokens']} tokens): tokens 0-{p['prefill'] - 1} prefilled "
        f"in forwards of {p['chunk']}, then {p['score']} single-token steps "
        f"(`model(tokens[None], cache=caches)`, the caches compressing at every step), each "
        f"scoring the next token ({p['prefill'] + 1}-{p['prefill'] + p['score']}). "
        f"Intervals 95%: perplexity and KL by block bootstrap over positions (blocks of "
        f"{p['block']}, {p['bootstrap']} resamples), Δ ppl by the same bootstrap of the per-token "
        f"NLL difference to the full cache (paired), top-1 by Wilson over positions. KV MiB: "
        f"`nbytes` of the caches after the run. Float32, CPU; MLX {meta['versions']['mlx']}, "
        f"mlx-lm {meta['versions']['mlx_lm']}; s: the row's wall seconds.",
        "",
        table_header(),
    ]
    lines += [table_row(r) for r in rows]
    odd = [r for r in rows if not r.get("error") and r["kv_bytes"] != r["array_bytes"]]
    if odd:
        lines += ["", "`nbytes` differs from the bytes of the state's arrays: " + "; ".join(
            f"{r['label']}: {r['kv_bytes']} against {r['array_bytes']}" for r in odd)]
    else:
        lines += ["", "Every row's `nbytes` equals the bytes of the arrays its caches' `state` "
                  "holds."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS),
                    help="name[:key=value,...]: full, mlxlm-q or a velox method key")
    ap.add_argument("--text", default="pride", help="a shipped text (default pride)")
    ap.add_argument("--prefill", type=int, default=1536)
    ap.add_argument("--score", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=512, help="tokens per prefill forward")
    ap.add_argument("--block", type=int, default=32, help="bootstrap block of positions")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    ap.add_argument("--model", help="an mlx-lm model folder (default: the embedded SmolLM2)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)

    specs = [parse_row(r) for r in args.rows]
    if (FULL, {}) in specs:
        specs.remove((FULL, {}))
    specs.insert(0, (FULL, {}))  # the reference, first
    from velox.registry import get_method

    for name, _ in specs:
        if name not in (FULL, MLXLM_Q):
            try:
                get_method(name)
            except (ValueError, KeyError) as exc:
                raise SystemExit(f"--rows: {' '.join(str(exc).split())}") from None
    for n, v in (("prefill", args.prefill), ("score", args.score), ("chunk", args.chunk),
                 ("block", args.block), ("bootstrap", args.bootstrap)):
        if v < 1:
            raise SystemExit(f"--{n} must be >= 1, got {v}")

    from velox.adapters.harness import _encode, load_text
    from velox.adapters.smollm2 import load_model

    model, tokenizer = load_model(args.model)
    tokens = _encode(tokenizer, load_text(args.text))
    need = args.prefill + args.score + 1
    if len(tokens) < need:
        raise SystemExit(f"the text {args.text!r} has {len(tokens)} tokens; {need} are needed")
    dtypes = sorted({str(p.dtype) for _, p in
                     __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(
                         model.parameters())})
    meta = {
        "command": " ".join(["python", "benchmarks/long_decode_quality.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "model": "SmolLM2-135M-Instruct (embedded)" if args.model is None else args.model,
        "model_dtypes": dtypes,
        "versions": _versions(),
        "protocol": {"text": args.text, "text_tokens": len(tokens), "prefill": args.prefill,
                     "score": args.score, "chunk": args.chunk, "block": args.block,
                     "bootstrap": args.bootstrap, "seed": args.seed, "confidence": 0.95,
                     "tokens_read": need},
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    print(f"{meta['model']} {dtypes}, text {args.text} ({len(tokens)} tokens), prefill "
          f"{args.prefill} in {args.chunk}s, {args.score} single-token steps", flush=True)
    print(table_header(), flush=True)

    rows: list[dict[str, Any]] = []
    ref = None
    t_all = time.perf_counter()
    for name, params in specs:
        label = row_label(name, params)
        row: dict[str, Any] = {"row": name if not params else name + ":" + ",".join(
            f"{k}={v}" for k, v in params.items()), "method": name, "params": params,
            "label": label, "short": _short(name, params), "error": None}
        if name == MLXLM_Q:
            row["params"] = {**quantized_defaults(), **params}
        t = time.perf_counter()
        try:
            caches = make_caches(model, name, params)
            res = run_row(model, tokens, caches, prefill=args.prefill, score=args.score,
                          chunk=args.chunk, reference=None if ref is None else ref["logprobs"],
                          keep=ref is None)
            row["kv_bytes"] = int(sum(c.nbytes for c in caches))
            row["array_bytes"] = array_bytes(caches)
            row["cache_types"] = sorted({type(c).__name__ for c in caches})
            if ref is None:
                ref = res
            row["figures"] = figures(res["nll"], res["argmax"], res["kl"], ref_nll=ref["nll"],
                                     ref_argmax=ref["argmax"], block=args.block,
                                     reps=args.bootstrap, seed=args.seed)
            shifted = np.concatenate([[res["prefill_last_nll"]], res["nll"][:-1]])
            row["ppl_shifted"] = math.exp(shifted.mean())
            row["prefill_seconds"] = res["prefill_seconds"]
            row["decode_seconds"] = res["decode_seconds"]
            row["decode_tokens_per_s"] = args.score / res["decode_seconds"]
            del caches, res
        except (ValueError, RuntimeError, TypeError) as exc:
            if ref is None:
                raise
            row["error"] = " ".join(str(exc).split())
        row["seconds"] = time.perf_counter() - t
        rows.append(row)
        print(table_row(row), flush=True)
        if not row["error"] and row["kv_bytes"] != row["array_bytes"]:
            print(f"  note: nbytes {row['kv_bytes']} != state arrays {row['array_bytes']}",
                  flush=True)
        meta["wall_seconds"] = time.perf_counter() - t_all
        _write(args, meta, rows)
    if args.plot:
        note = _plot(rows, Path(args.plot), f"{meta['model']}, {args.text}: {args.prefill} "
                     f"prefilled, {args.score} decoded one token a step")
        if note:
            print(f"note: {note}", flush=True)
    full = rows[0]
    print(f"full cache: ppl {full['figures']['ppl']:.3f} over tokens {args.prefill + 1}-"
          f"{args.prefill + args.score} ({full['ppl_shifted']:.3f} over {args.prefill}-"
          f"{args.prefill + args.score - 1}); {meta['wall_seconds']:.0f} s in all", flush=True)
    return 0


def _write(args, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(_markdown(meta, rows))


if __name__ == "__main__":
    raise SystemExit(main())
