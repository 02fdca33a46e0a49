"""Bytes per token of every lossy (quantizing, low-rank, composed) method, from the state.

Each method absorbs ``--tokens`` tokens (a prefill chunk, then single-token decode steps) of
keys/values at ``head_dim`` 128 in float16, at its default parameters and at each preset of
its spec, then the same in a float32 cache (bytes only: side data and exact rows are float16
by default whatever the cache dtype). Bytes per token and head = ``<key>_bytes(state) /
(tokens * heads)``, beside the 512 bytes fp16 needs (keys + values, 128 channels, 2 bytes).
Writes a markdown table and JSON.

    python benchmarks/bytes_table.py [--tokens 4096] [--data gaussian|smollm2] [--out docs/results/bytes]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import velox  # first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core (velox._blas)
import mlx.core as mx
import numpy as np

from velox.registry import get_method, method_keys


def lossy_methods() -> list[str]:
    """Methods that keep every token in a compressed form (compositions with eviction excluded:
    their bytes per *seen* token depend on the budget)."""
    return [k for k in method_keys()
            if get_method(k).spec.family not in ("eviction", "merging", "composed")
            and not get_method(k).spec.contract.get("exact_rows", False)]


def _data(kind: str, tokens: int, heads: int, dim: int):
    if kind == "gaussian":
        rng = np.random.default_rng(0)
        k = rng.standard_normal((1, heads, tokens, dim)).astype(np.float32)
        v = rng.standard_normal((1, heads, tokens, dim)).astype(np.float32)
        k[..., 3] *= 12.0  # an outlier channel, as real keys have
        return mx.array(k).astype(mx.float16), mx.array(v).astype(mx.float16)
    raise ValueError(f"unknown data {kind!r}")


def measure(key: str, params: dict, k: mx.array, v: mx.array, decode: int) -> dict:
    m = get_method(key)
    b, h, n, d = k.shape
    st = m.init(b, h, d, dtype=k.dtype, **params)
    t0 = time.perf_counter()
    st = m.update(st, k[:, :, : n - decode], v[:, :, : n - decode])
    for t in range(n - decode, n):
        st = m.update(st, k[:, :, t:t + 1], v[:, :, t:t + 1])
    mx.eval(st)
    secs = time.perf_counter() - t0
    kh, vh = m.get_kv(st)
    pos = velox.positions(st)
    want_k = mx.take_along_axis(k, pos[..., None], axis=2).astype(mx.float32)
    want_v = mx.take_along_axis(v, pos[..., None], axis=2).astype(mx.float32)

    def rel(x, y):
        x, y = np.array(x, np.float64), np.array(y.astype(mx.float32), np.float64)
        return float(np.linalg.norm(x - y) / np.linalg.norm(x))

    nbytes = velox.nbytes(st)
    per_token = nbytes / (n * b * h)
    return {"method": key, "params": params, "bytes": nbytes, "bytes_per_token_head": per_token,
            "fp16_per_token_head": 2 * 2 * d, "ratio_vs_fp16": 2 * 2 * d / per_token,
            "key_rel_err": rel(want_k, kh), "value_rel_err": rel(want_v, vh), "seconds": secs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=32, help="tokens absorbed one at a time at the end")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--data", default="gaussian")
    ap.add_argument("--methods", nargs="*", default=None)
    ap.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    args = ap.parse_args(argv)
    k, v = _data(args.data, args.tokens, args.heads, args.dim)
    rows = []
    for key in args.methods or lossy_methods():
        spec = get_method(key).spec
        for name, params in [("default", {})] + sorted(spec.presets.items()):
            r = measure(key, dict(params), k, v, args.decode)
            r32 = measure(key, dict(params), k.astype(mx.float32), v.astype(mx.float32), args.decode)
            r["setting"] = name
            r["fp32_cache_bytes_per_token_head"] = r32["bytes_per_token_head"]
            rows.append(r)
            print(f"{key:>14} {name:>10} {r['bytes_per_token_head']:8.1f} B/token/head "
                  f"x{r['ratio_vs_fp16']:5.2f} vs fp16 ({r32['bytes_per_token_head']:.1f} in a "
                  f"float32 cache)  key err {r['key_rel_err']:.4f} "
                  f"value err {r['value_rel_err']:.4f}  ({r['seconds']:.1f} s)", flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        head = (f"Bytes per token and kv head measured from each state after {args.tokens} "
                f"tokens ({args.tokens - args.decode} as a prefill chunk, {args.decode} decode "
                f"steps), head_dim {args.dim}, float16 cache, {args.data} keys/values (one "
                "outlier channel x12). fp16 needs "
                f"{4 * args.dim} bytes. Relative error = ||x - x_hat|| / ||x||. The float32 "
                "column: the same tokens in a float32 cache (scales, zeros and exact rows stay "
                "float16 by default).\n\n"
                f"Command: `python benchmarks/bytes_table.py --tokens {args.tokens} --out {args.out}`\n\n")
        lines = ["| method | setting | parameters | bytes/token/head | vs fp16 | float32 cache "
                 "bytes/token/head | key rel. error | value rel. error |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "defaults"
            lines.append(f"| `{r['method']}` | {r['setting']} | {params} | {r['bytes_per_token_head']:.1f} "
                         f"| {r['ratio_vs_fp16']:.2f}x | {r['fp32_cache_bytes_per_token_head']:.1f} "
                         f"| {r['key_rel_err']:.4f} | {r['value_rel_err']:.4f} |")
        out.with_suffix(".md").write_text(head + "\n".join(lines) + "\n")
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
