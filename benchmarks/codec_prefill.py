"""A codec cache's prefill-chunk attention: scoring the key codes block by block of queries
against decoding the stored keys once and running MLX's fused attention, beside a full cache's
attention over the same number of rows (time and peak memory of one call, and the largest
difference of the two codec paths' outputs).

    python benchmarks/codec_prefill.py [--stored 8192] [--chunk 1024] [--methods turboquant_mse turboquant_prod]

Shapes of Llama-3.2-1B's attention (8 kv heads, 32 query heads, head_dim 64), float32.
"""

from __future__ import annotations

import argparse
import time

import velox  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from velox import codec_cache as cc
from velox.registry import get_method


def timed(fn):
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t = time.perf_counter()
    out = fn()
    mx.eval(out)
    return time.perf_counter() - t, (mx.get_peak_memory() - base) / 2 ** 20, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stored", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--methods", nargs="*", default=["turboquant_mse", "turboquant_prod"])
    args = ap.parse_args()
    b, h, hq, d, n, s = 1, 8, 32, 64, args.stored, args.chunk
    scale = d ** -0.5
    mx.random.seed(0)
    q, k, v = mx.random.normal((b, hq, s, d)), mx.random.normal((b, h, s, d)), mx.random.normal((b, h, s, d))
    big_k = mx.concatenate([mx.random.normal((b, h, n, d)), k], axis=2)
    big_v = mx.concatenate([mx.random.normal((b, h, n, d)), v], axis=2)
    mx.eval(q, k, v, big_k, big_v)
    t_f, p_f, _ = timed(lambda: mx.fast.scaled_dot_product_attention(q, big_k, big_v, scale=scale,
                                                                     mask="causal"))
    print(f"{mx.default_device()}: {n} stored tokens, a {s}-token chunk; full cache's attention "
          f"{t_f:.3f} s, {p_f:.0f} MiB")
    for key in args.methods:
        m = get_method(key)
        st = m.init(b, h, d, dtype=mx.float32, backend="mlx")
        for i in range(0, n, 2048):
            st = m.update(st, mx.random.normal((b, h, min(2048, n - i), d)),
                          mx.random.normal((b, h, min(2048, n - i), d)))
        mx.eval(st)
        count = mx.full((b, h), cc.stored_tokens(st), mx.int32)  # a count array: the code path
        t_c, p_c, o_c = timed(lambda: cc._attend(st, count, q, k, v, scale, "causal"))
        t_d, p_d, o_d = timed(lambda: m.attend(st, q, k, v, scale=scale, mask="causal"))
        print(f"{key}: codes per query block {t_c:.3f} s, {p_c:.0f} MiB | decoded once + fused "
              f"{t_d:.3f} s, {p_d:.0f} MiB ({t_d / t_f:.2f}x the full cache's time, "
              f"{p_d / p_f:.2f}x its peak) | max |diff| {float(mx.abs(o_d - o_c).max()):.1e}")


if __name__ == "__main__":
    main()
