"""Decode attention over a KIVI cache: packed codes (``mx.quantized_matmul``) vs dequantize + SDPA.

For each context length, one query token attends to a KIVI state (2 and 4 bits, group 32,
residual 128) plus one new token, two ways: ``kivi.attend`` (scores and outputs on the packed
codes) and ``kivi_get_kv`` (dequantize everything) followed by
``mx.fast.scaled_dot_product_attention``. Prints median times and the ratio.

    python benchmarks/bench_quantized_attention.py [--dtype float32] [--heads 8] [--dim 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import velox  # first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core (velox._blas)
import mlx.core as mx

from velox.methods import kivi


def _median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 16384])
    args = ap.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    h, d = args.heads, args.dim
    print(f"device {mx.default_device()}, {args.dtype}, h={h} d={d}")
    print(f"{'tokens':>7} {'bits':>4} {'packed_us':>10} {'dequant+sdpa_us':>16} {'dequant/packed':>15}")
    for n in args.lengths:
        for bits in (2, 4):
            st = velox.kivi_init(1, h, d, dtype=dtype, bits=bits)
            st = velox.kivi_update(st, *(mx.random.normal((2, 1, h, n, d)).astype(dtype)))
            q = mx.random.normal((1, h, 1, d)).astype(dtype)
            k = mx.random.normal((1, h, 1, d)).astype(dtype)
            mx.eval(st, q, k)
            scale = d ** -0.5

            def packed():
                mx.eval(kivi.attend(st, q, k, k, scale=scale))

            def dense():
                kk, vv = velox.kivi_get_kv(st)
                kk = mx.concatenate([kk, k], axis=2)
                vv = mx.concatenate([vv, k], axis=2)
                mx.eval(mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale))

            a, b = _median_us(packed, args.reps), _median_us(dense, args.reps)
            print(f"{n:>7} {bits:>4} {a:>10.1f} {b:>16.1f} {b / a:>15.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
