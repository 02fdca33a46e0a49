"""The two-launch decode step (attend_part + attend_select) on the H200, against the three
launches it replaced (attend_part, attend_combine, select) and mlx-lm's caches:

    python docs/results/speed/select/decode_select.py     (SKIP_PARTS=1: the model runs only)

B: one layer's pieces, us per layer (16 launches per evaluation, 2048 stored rows, Llama-3.2-1B's
attention, bfloat16): SDPA over a concatenated cache, attend_weights at ATTEND_UNROLL 1/2/4,
and per method the step's kernels both ways. A: whole-model decode steps of the
Llama-3.2-1B-shaped random model at a 32k prompt (budget 2048; streaming_llm window 2044 + 4
sinks), caches interleaved over 5 rounds (the first a warm-up) of 16 steps: ``sync`` evaluates
each step before the next (the token feeds the next step), ``pipelined`` as mlx-lm's
generate_step does (the next step's graph built and queued while the current one runs); the
brackets hold each round's ratio to the full cache's round. ``tova-3launch`` is TOVA with
attend_select switched off (the previous step's kernels, same process). RotatingKVCache runs
at batch 1 only (its prefill of 32 x 32k runs out of device memory).
"""
import sys, time, statistics, gc, os
sys.path.insert(0, "benchmarks")
import velox
import decode_speed as ds
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, RotatingKVCache
from velox.adapters import mlxlm as A
from velox.kernels import evict as ev

def P(*a): print(*a, flush=True)

def per_layer(fn, reps=20):
    for _ in range(3): mx.eval([fn(i) for i in range(16)])
    r = []
    for _ in range(5):
        mx.synchronize(); t = time.perf_counter()
        for _ in range(reps): mx.eval([fn(i) for i in range(16)])
        mx.synchronize(); r.append((time.perf_counter() - t) / reps / 16 * 1e6)
    return statistics.median(r)

# B: kernels, 2048 stored rows, Llama-1B attention
H, G, D, N = 8, 4, 64, 2048
for b in (() if os.environ.get("SKIP_PARTS") else (1, 32)):
    dt = mx.bfloat16
    rnd = lambda *s: mx.random.normal(s).astype(dt)
    q, kn, vn = rnd(b, H * G, 1, D), rnd(b, H, 1, D), rnd(b, H, 1, D)
    Ks = [rnd(b, H, N, D) for _ in range(16)]; Vs = [rnd(b, H, N, D) for _ in range(16)]
    pos = mx.broadcast_to(mx.arange(N, dtype=mx.int32), (b, H, N)); nxt = mx.full((b, H), N, mx.int32)
    old = mx.random.uniform(shape=(b, H, N))
    mx.eval(Ks, Vs, pos, nxt, old)
    sdpa = per_layer(lambda i: mx.fast.scaled_dot_product_attention(q, mx.concatenate([Ks[i], kn], 2), mx.concatenate([Vs[i], vn], 2), scale=D ** -0.5))
    line = [f"B batch {b}: sdpa(cat) {sdpa:.1f}"]
    for u in (1, 2, 4):
        ev.ATTEND_UNROLL = u
        t = per_layer(lambda i: ev.attend_weights(q, Ks[i], Vs[i], kn, vn)[0])
        line.append(f"attend_weights unroll {u}: {t:.1f}")
    ev.ATTEND_UNROLL = 2
    for shared in (True, False):
        t3 = per_layer(lambda i: ev.select(ev.attend_weights(q, Ks[i], Vs[i], kn, vn)[1], pos, nxt, Ks[i], Vs[i], kn, vn, n_sink=4, recent=0, shared=shared)[0])
        t2 = per_layer(lambda i: ev.attend_select(q, Ks[i], Vs[i], kn, vn, pos, nxt, n_sink=4, recent=0, shared=shared)[1])
        line.append(f"tova shared={shared}: 3 launches {t3:.1f} / attend_select {t2:.1f}")
    t3 = per_layer(lambda i: ev.select(ev.attend_weights(q, Ks[i], Vs[i], kn, vn, old=old, accumulate="decay", decay=0.98)[2], pos, nxt, Ks[i], Vs[i], kn, vn, n_sink=4, recent=16, shared=False, carried=ev.attend_weights(q, Ks[i], Vs[i], kn, vn, old=old, accumulate="decay", decay=0.98)[2])[0])
    t2 = per_layer(lambda i: ev.attend_select(q, Ks[i], Vs[i], kn, vn, pos, nxt, n_sink=4, recent=16, shared=False, by="carried", old=old, accumulate="decay", decay=0.98, carry=True)[1])
    line.append(f"h2o: 3 launches {t3:.1f} / attend_select {t2:.1f}")
    P("\n  ".join(line))
    del Ks, Vs; gc.collect(); mx.clear_cache()

# A: model-level
real_supports, real_note = ev.attend_select_supports, A.VeloxCache._note_fast
def mode(old3):
    ev.attend_select_supports = (lambda *a: False) if old3 else real_supports
    A._COMPILED.clear()

model, _ = ds.build_model("llama-1b-random", None, 0)
ctx = int(os.environ.get("CTX", 32768))
for b in [int(x) for x in os.environ.get("BATCHES", "1 32").split()]:
    names = os.environ.get("NAMES", "full rotating tova tova-3launch h2o streaming_llm").split()
    if b > 8:
        names = [x for x in names if x != "rotating"]
    prompt = mx.random.randint(0, 128256, (b, ctx))
    caches = {}
    for name in names:
        meth = name.split("-")[0]
        c = (make_prompt_cache(model) if name == "full" else [RotatingKVCache(max_size=2048, keep=4) for _ in range(16)] if name == "rotating" else
             A.make_cache(model, meth, window_size=2044) if meth == "streaming_llm" else A.make_cache(model, meth, budget=2048))
        for i in range(0, ctx, 2048):
            model(prompt[:, i:i + 2048], cache=c); mx.eval([x.state for x in c])
        caches[name] = c; mx.clear_cache()
    res = {n: {"sync": [], "host": [], "pipe": []} for n in caches}
    y0 = prompt[:, -1:]
    for rnd in range(5):
        for name, c in caches.items():
            mode("3launch" in name)
            y = mx.argmax(model(y0, cache=c)[:, -1:], axis=-1); mx.eval(y)
            mx.synchronize(); t = time.perf_counter(); hb = []
            for _ in range(16):
                tb = time.perf_counter(); out = model(y, cache=c); hb.append(time.perf_counter() - tb)
                y = mx.argmax(out[:, -1:], axis=-1); mx.eval(y)
            mx.synchronize(); sync = (time.perf_counter() - t) / 16
            t = time.perf_counter()
            y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.async_eval(y)
            for _ in range(16):
                ny = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.async_eval(ny)
                mx.eval(y); y = ny
            mx.eval(y); pipe = (time.perf_counter() - t) / 17
            if rnd:
                res[name]["sync"].append(sync); res[name]["host"].append(statistics.median(hb)); res[name]["pipe"].append(pipe)
    mode(False)
    f = res["full"]
    for name, r in res.items():
        s, h, p = (statistics.median(r[k]) for k in ("sync", "host", "pipe"))
        rs = " ".join(f"{a/x:.2f}" for a, x in zip(f["sync"], r["sync"])); rp = " ".join(f"{a/x:.2f}" for a, x in zip(f["pipe"], r["pipe"]))
        last = getattr(caches[name][0], "last_step", "-")
        P(f"A ctx {ctx} batch {b} {name:14s} sync {1e3*s:6.2f} ms [{rs}]  host {1e3*h:5.2f} ms  pipelined {1e3*p:6.2f} ms [{rp}]  last={last}")
    del caches; gc.collect(); mx.clear_cache()
