"""Peak memory of a 4k-token prefill on SmolLM2: a budgeted eviction cache against the full cache.

Each configuration runs in a fresh subprocess (so peaks never mix): load the model, evaluate its
weights, ``mx.reset_peak_memory()``, prefill ``--context`` tokens of a shipped text in chunks of
``--chunk`` tokens, then read ``mx.get_peak_memory()``. Prints the peak of each, the part above
the weights (active memory before the prefill), the bytes the cache holds at the end, and the
ratios (target: the eviction cache's peak below the full cache's).

    python benchmarks/bench_prefill_memory.py [--method tova] [--budget 256] [--context 4096]

CPU fp32; preload OpenBLAS on Linux (see README).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(method: str, budget: int, context: int, chunk: int, text: str) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters import harness
    from velox.adapters.mlxlm import make_cache
    from velox.adapters.smollm2 import load_default_model

    model, tokenizer = load_default_model()
    mx.eval(model.parameters())
    tokens = harness.text_tokens(tokenizer, harness.load_text(text), context)
    caches = make_prompt_cache(model) if method == "full" else make_cache(model, method,
                                                                          budget=budget)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    harness.prefill(model, tokens, caches, chunk=chunk)
    mx.synchronize()
    seconds = time.perf_counter() - t0
    return {"method": method, "peak": mx.get_peak_memory(), "base": base,
            "cache_bytes": harness.memory(caches).kv_bytes, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="tova")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per forward)")
    ap.add_argument("--text", default="alice")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.method, args.budget, args.context, args.chunk, args.text)))
        return

    results = {}
    for method in ("full", args.method):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--method", method,
               "--budget", str(args.budget), "--context", str(args.context),
               "--chunk", str(args.chunk), "--text", args.text]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[method] = json.loads(out.strip().splitlines()[-1])

    mib = 2 ** 20
    print(f"SmolLM2-135M fp32, prefill of {args.context} tokens in chunks of {args.chunk} "
          f"(each in a fresh process)")
    for method, r in results.items():
        label = "full KVCache" if method == "full" else f"{method} budget={args.budget}"
        print(f"  {label:<20} peak {r['peak'] / mib:8.1f} MiB   above weights "
              f"{(r['peak'] - r['base']) / mib:7.1f} MiB   cache holds "
              f"{r['cache_bytes'] / mib:6.1f} MiB   ({r['seconds']:.1f} s)")
    full, mine = results["full"], results[args.method]
    print(f"peak ratio {args.method}/full = {mine['peak'] / full['peak']:.3f}x; above the "
          f"weights {(mine['peak'] - mine['base']) / (full['peak'] - full['base']):.3f}x  "
          f"(target < 1: {'met' if mine['peak'] < full['peak'] else 'missed'})")


if __name__ == "__main__":
    main()
