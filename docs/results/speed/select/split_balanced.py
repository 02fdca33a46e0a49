"""attend_weights with its chunks evened out against the previous kernel and split, then the
whole-model decode run with the fastest setting (the record of h200-split-balanced.txt):

    python docs/results/speed/select/split_balanced.py

The previous module (commit 3258312: 512-row chunks, the fifth of one row for 2049
candidates) is read with ``git show``, its first kernel renamed so MLX builds both. Four
settings of (SPLIT_BLOCKS, MIN_CHUNK) with CHUNK_MAX 1024, us per layer at batch 1 and 32
(2048 stored rows, Llama-3.2-1B's attention, bfloat16), two rounds; the setting with the
lowest mean ratio to the previous kernel then runs decode_select.py's model part.
"""
import sys, time, statistics, os, importlib.util, gc, subprocess
import velox
import mlx.core as mx
from velox.kernels import evict as ev
src = (open(os.environ["VELOX_OLD_EVICT"]).read() if os.environ.get("VELOX_OLD_EVICT")  # a saved copy
       else subprocess.check_output(["git", "show", "3258312:kernels/evict.py"], text=True))
src = src.replace('"velox_attend_part"', '"velox_attend_part_old"')
spec = importlib.util.spec_from_loader("velox.kernels.evict_old", loader=None)
old = importlib.util.module_from_spec(spec); old.__package__ = "velox.kernels"
exec(compile(src, "evict_old.py", "exec"), old.__dict__)
def per_layer(fn, reps=20):
    for _ in range(3): mx.eval([fn(i) for i in range(16)])
    r = []
    for _ in range(5):
        mx.synchronize(); t = time.perf_counter()
        for _ in range(reps): mx.eval([fn(i) for i in range(16)])
        mx.synchronize(); r.append((time.perf_counter() - t) / reps / 16 * 1e6)
    return statistics.median(r)
H, G, D, N = 8, 4, 64, 2048
CONFIGS = [(1024, 512), (768, 512), (256, 1024), (1024, 256)]
score = {c: 0.0 for c in CONFIGS}
for b in (1, 32):
    dt = mx.bfloat16
    rnd = lambda *s: mx.random.normal(s).astype(dt)
    q, kn, vn = rnd(b, H * G, 1, D), rnd(b, H, 1, D), rnd(b, H, 1, D)
    Ks = [rnd(b, H, N, D) for _ in range(16)]; Vs = [rnd(b, H, N, D) for _ in range(16)]
    pos = mx.broadcast_to(mx.arange(N, dtype=mx.int32), (b, H, N)); nxt = mx.full((b, H), N, mx.int32)
    mx.eval(Ks, Vs, pos, nxt)
    ref = old.attend_weights(q, Ks[0], Vs[0], kn, vn)
    line = [f"batch {b}:"]
    for rnd_ in range(2):
        t_old = per_layer(lambda i: old.attend_weights(q, Ks[i], Vs[i], kn, vn)[0])
        parts = [f"round {rnd_}: old (512-row chunks, last 1 row) {t_old:.1f}"]
        for c in CONFIGS:
            ev.SPLIT_BLOCKS, ev.MIN_CHUNK = c
            a = ev.attend_weights(q, Ks[0], Vs[0], kn, vn)
            d = float(mx.abs(a[0].astype(mx.float32) - ref[0].astype(mx.float32)).max()); wd = float(mx.abs(a[1] - ref[1]).max())
            t = per_layer(lambda i: ev.attend_weights(q, Ks[i], Vs[i], kn, vn)[0])
            score[c] += t / t_old / 4
            parts.append(f"{c} chunk {ev.split_chunk(N + 1, b * H)}: {t:.1f} (diff {d:.2g}/{wd:.2g})")
        line.append("; ".join(parts))
    print("\n  ".join(line), flush=True)
    del Ks, Vs; gc.collect(); mx.clear_cache()
best = min(CONFIGS, key=lambda c: score[c])
print("mean ratio to old per config:", {str(c): round(v, 3) for c, v in score.items()}, "best", best, flush=True)
ev.SPLIT_BLOCKS, ev.MIN_CHUNK = best
sys.argv = ["decode_select.py"]
os.environ["SKIP_PARTS"] = "1"; os.environ["NAMES"] = "full tova h2o streaming_llm"
exec(compile(open("docs/results/speed/select/decode_select.py").read(), "decode_select.py", "exec"), {"__name__": "__main__"})
