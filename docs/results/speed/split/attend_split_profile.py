"""attend_weights split against the one-block kernel it replaced, on a GPU: us per layer (16
launches per evaluation) of SDPA over a concatenated copy, the old kernel, and the split
kernel at four (SPLIT_BLOCKS, MIN_CHUNK) settings with its two launches timed apart.

    git show d0a993e:kernels/evict.py > old_evict.py   # the one-block kernel
    python docs/results/speed/split/attend_split_profile.py

(The first run's extra columns, part-no-values / part-no-lg / part-no-logits, came from
variants of this script that cut those phases out of the first kernel's source.)
"""
import importlib.util, statistics, sys, time
import mlx.core as mx
from velox.kernels import evict as ev

spec = importlib.util.spec_from_file_location("old_evict", "old_evict.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
H, G, D, N = 8, 4, 64, 2048
L = 16

def timeit(fn, reps=30):
    for _ in range(3):
        mx.eval([fn() for _ in range(L)])
    r = []
    for _ in range(5):
        mx.synchronize(); t = time.perf_counter()
        for _ in range(reps):
            mx.eval([fn() for _ in range(L)])
        mx.synchronize(); r.append((time.perf_counter() - t) / reps / L * 1e6)
    return statistics.median(r)

ORIG = ev._ATTEND_PART
def variant(src):
    ev._ATTEND_PART = src
    ev._attend_part_kernel.cache_clear()

for b in (1, 32):
    dt = mx.bfloat16
    rnd = lambda *s: mx.random.normal(s).astype(dt)
    q, k, v, K, V = rnd(b, H * G, 1, D), rnd(b, H, 1, D), rnd(b, H, 1, D), rnd(b, H, N, D), rnd(b, H, N, D)
    mx.eval(q, k, v, K, V)
    Ns = N + 1
    print(f"batch {b}")
    print(f"  sdpa (cat)            {timeit(lambda: mx.fast.scaled_dot_product_attention(q, mx.concatenate([K,k],2), mx.concatenate([V,v],2), scale=D**-0.5)):8.1f}")
    print(f"  old attend_weights    {timeit(lambda: old.attend_weights(q, K, V, k, v)[0]):8.1f}")
    print(f"  old weights           {timeit(lambda: old.weights(q, K, k)[0]):8.1f}")
    for setting in ((1024, 32), (1024, 128), (256, 512), (4096, 16)):
        ev.SPLIT_BLOCKS, ev.MIN_CHUNK = setting
        ch = ev.split_chunk(Ns, b * H); s = -(-Ns // ch)
        cfg, params = ev._cfg(ch), ev._params(D ** -0.5, 1.0)
        def part():
            return ev._run_kernel(("attend_part",), [q[:, :, -1], K, k, V, v, params, cfg],
                (b * H * s * ev.ATTEND_THREADS, 1, 1), (ev.ATTEND_THREADS, 1, 1),
                [(b, H, G, Ns), (b, H, s, G), (b, H, s, G), (b, H, s, G, D)], [mx.float32] * 4,
                [("HEAD_DIM", D), ("GROUPS", G)])
        variant(ORIG)
        outs = part(); mx.eval(outs)
        full = timeit(lambda: ev.attend_weights(q, K, V, k, v)[0])
        tp = timeit(lambda: part()[3])
        def comb():
            return ev._run_kernel(("attend_combine", "mean", None), list(outs) + [cfg],
                (b * H * s * ev.ATTEND_THREADS, 1, 1), (ev.ATTEND_THREADS, 1, 1),
                [(b, H, Ns), (b, H * G, 1, D)], [mx.float32, dt], [("HEAD_DIM", D)])[1]
        tc = timeit(comb)
        print(f"  split {setting} chunk {ch} x{s}: attend {full:7.1f}  part {tp:7.1f}  combine {tc:7.1f}")
    ev.SPLIT_BLOCKS, ev.MIN_CHUNK = 1024, 32
