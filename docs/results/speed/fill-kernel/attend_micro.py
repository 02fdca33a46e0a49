"""The fill step's attention on the GPU: velox's attend kernel (one pass, in place over the
filled prefix of a buffer) against mlx.fast.scaled_dot_product_attention over a prefix view
(what the fill step ran) and against attend_weights (the fused step's two kernels, weights
included). 32 query / 8 kv heads, head_dim 64, bfloat16, 2112-row buffers, 2048 filled rows +
the new one. Two timings per variant: one op evaluated and synchronized alone ("sync"), and
REPS ops in one evaluation ("graph", the per-op GPU time without the host's round trip);
rounds interleaved, medians.

    python docs/results/speed/fill-kernel/attend_micro.py
"""
import statistics
import sys
import time

import velox  # noqa: F401  (before mlx.core)
import mlx.core as mx
from velox.kernels import evict as ev

REPS = 50


def sync_time(f, n=30):
    mx.eval(f())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    mx.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def graph_time(f):
    mx.eval([f() for _ in range(3)])
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval([f() for _ in range(REPS)])
    mx.synchronize()
    return 1e6 * (time.perf_counter() - t0) / REPS


def main(batches=(1, 8, 32)):
    h, g, d, N, rows = 8, 4, 64, 2112, 2048
    dt = mx.bfloat16
    for b in batches:
        mx.random.seed(0)
        q = mx.random.normal((b, h * g, 1, d)).astype(dt)
        k = mx.random.normal((b, h, N, d)).astype(dt)
        v = mx.random.normal((b, h, N, d)).astype(dt)
        kn = mx.random.normal((b, h, 1, d)).astype(dt)
        vn = mx.random.normal((b, h, 1, d)).astype(dt)
        kc, vc = mx.contiguous(k[:, :, :rows]), mx.contiguous(v[:, :, :rows])
        mx.eval(q, k, v, kn, vn, kc, vc)
        want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([kc, kn], 2), mx.concatenate([vc, vn], 2),
                                                    scale=d ** -0.5)

        def flash(blocks, min_chunk, unroll):
            def f():
                ev.FLASH_BLOCKS, ev.FLASH_MIN_CHUNK, ev.FLASH_UNROLL = blocks, min_chunk, unroll
                return ev.attend(q, k, v, kn, vn, rows=rows)
            return f

        variants = {
            "sdpa prefix view": lambda: mx.fast.scaled_dot_product_attention(
                q, k[:, :, :rows + 1], v[:, :, :rows + 1], scale=d ** -0.5),
            "attend_weights (fused step's, + weights)": lambda: ev.attend_weights(q, kc, vc, kn, vn)[0],
        }
        for blocks, min_chunk, unroll in ((64, 128, 1), (128, 128, 1), (256, 128, 1), (512, 128, 1),
                                          (256, 128, 2), (4096, 64, 1), (4096, 256, 1), (4096, 512, 1),
                                          (1, 4096, 1), (1, 4096, 2)):
            variants[f"attend blocks={blocks} min_chunk={min_chunk} unroll={unroll}"] = flash(blocks, min_chunk, unroll)
        for name, f in variants.items():  # correctness first
            err = mx.abs(f().astype(mx.float32) - want.astype(mx.float32)).max().item()
            if err > 0.05:
                print(f"b{b} {name}: max error {err}", flush=True)
        res = {name: ([], []) for name in variants}
        for _ in range(3):
            for name, f in variants.items():
                res[name][0].append(sync_time(f))
                res[name][1].append(graph_time(f))
        base = statistics.median(res["sdpa prefix view"][1])
        print(f"batch {b}: {rows} rows + new of a {N}-row buffer (us per op; median of 3 rounds)")
        for name, (s, gr) in res.items():
            med = statistics.median(gr)
            print(f"  {name:50s} sync {statistics.median(s):7.1f}  graph {med:7.1f}  x{base / med:5.2f} vs sdpa",
                  flush=True)
    ev.FLASH_BLOCKS, ev.FLASH_MIN_CHUNK, ev.FLASH_UNROLL = 256, 128, 1


if __name__ == "__main__":
    main(tuple(int(x) for x in sys.argv[1:]) or (1, 8, 32))
