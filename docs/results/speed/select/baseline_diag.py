"""Where a velox decode step's time went on the H200 before the two-launch step (the record
of h200-baseline.txt; run at the commit before attend_select):

    python docs/results/speed/select/baseline_diag.py 32768    (SKIPB=1 BATCHES=32 for the rerun)

C: the cost of one trivial MLX primitive (whole, and the host's async_eval call alone). B:
16 layers' TOVA states of 2048 slots: the deferred row write into a donated buffer and into
one something else still holds (a copy), and the compiled fused step against the same
function called directly (host time to build the graph, and in all). A: whole-model decode
steps at a 32k prompt, synchronous and pipelined as mlx-lm's generate_step.
"""
import sys, time, statistics, gc
sys.path.insert(0, "benchmarks")
import velox
import decode_speed as ds
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from velox.adapters import mlxlm as A
from velox.registry import get_method

def P(*a): print(*a, flush=True)

import os
# C: per-primitive cost
if os.environ.get('SKIPB'): pass
x = mx.zeros((4,), mx.bfloat16); mx.eval(x)
for nops in (16, 160):
    ts, enc = [], []
    for r in range(20):
        mx.synchronize(); t = time.perf_counter()
        ys = [x + i for i in range(nops)]
        t1 = time.perf_counter(); mx.async_eval(ys); t2 = time.perf_counter(); mx.eval(ys); t3 = time.perf_counter()
        ts.append(t3 - t); enc.append(t2 - t1)
    P(f"C: {nops} adds: total {1e6*statistics.median(ts)/nops:.1f} us/op, async_eval call {1e6*statistics.median(enc)/nops:.1f} us/op")

# B: per-layer pieces
def pieces(b):
    dt = mx.bfloat16; H, G, D, N = 8, 4, 64, 2048
    m = get_method("tova")
    states = []
    for _ in range(16):
        st = m.init(b, H, D, dtype=dt, backend="auto", budget=N)
        k = mx.random.normal((b, H, N + 1, D)).astype(dt)
        st = m.update(st, k, k, queries=None); states.append(st)
    mx.eval([s.keys for s in states])
    P(f"B batch {b}: backend {states[0].backend} slots {states[0].keys.shape}")
    q = mx.random.normal((b, H * G, 1, D)).astype(dt); kn = mx.random.normal((b, H, 1, D)).astype(dt)
    slot = mx.zeros((b, H, 1), mx.int32); row = mx.ones((b, H, 1, D), dt)
    from velox import evict
    # write_slot donated
    for mode in ("donated", "held"):
        ks = [mx.array(s.keys) + 0 for s in states]; mx.eval(ks)
        tt = []
        for r in range(12):
            held = list(ks) if mode == "held" else None
            mx.synchronize(); t = time.perf_counter()
            ks = [evict.write_slot(a, row, slot) for a in ks]; mx.eval(ks); mx.synchronize()
            tt.append(time.perf_counter() - t); del held
        P(f"  write_slot ({mode}): {1e6*statistics.median(tt[2:])/16:.1f} us/layer")
    for kind in ("compiled", "direct"):
        f = A._compiled(m, "fused", states[0].backend) if kind == "compiled" else A._fused_step(m)
        sts = list(states)
        hb, tt = [], []
        for r in range(12):
            mx.synchronize(); t = time.perf_counter()
            outs = []
            for i in range(16):
                o, sts[i], rw = f(sts[i], q, kn, kn, D ** -0.5)
                outs.append(o)
            t1 = time.perf_counter(); mx.eval(outs, [s.positions for s in sts]); mx.synchronize()
            hb.append(t1 - t); tt.append(time.perf_counter() - t)
        P(f"  fused step {kind}: host {1e6*statistics.median(hb[2:])/16:.1f} us/layer, total {1e6*statistics.median(tt[2:])/16:.1f} us/layer")
    del states; gc.collect(); mx.clear_cache()

import os
if not os.environ.get('SKIPB'):
    for b in (1, 32):
        pieces(b)

# A: model-level, sync vs pipelined
model, _ = ds.build_model("llama-1b-random", None, 0)
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
for b in [int(x) for x in os.environ.get('BATCHES','1 32').split()]:
    prompt = mx.random.randint(0, 128256, (b, ctx))
    caches = {}
    for name in ("full", "tova", "streaming_llm"):
        c = (make_prompt_cache(model) if name == "full" else
             A.make_cache(model, name, window_size=2044) if name == "streaming_llm" else A.make_cache(model, name, budget=2048))
        for i in range(0, ctx, 2048):
            model(prompt[:, i:i + 2048], cache=c); mx.eval([x.state for x in c])
        caches[name] = c; mx.clear_cache()
    res = {n: {"sync": [], "host": [], "pipe": []} for n in caches}
    y0 = prompt[:, -1:]
    for rnd in range(4):
        for name, c in caches.items():
            y = mx.argmax(model(y0, cache=c)[:, -1:], axis=-1); mx.eval(y)
            mx.synchronize(); t = time.perf_counter(); hb = []
            for _ in range(16):
                tb = time.perf_counter(); out = model(y, cache=c); hb.append(time.perf_counter() - tb)
                y = mx.argmax(out[:, -1:], axis=-1); mx.eval(y)
            mx.synchronize(); sync = (time.perf_counter() - t) / 16
            # pipelined as mlx-lm's generate_step
            t = time.perf_counter()
            y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.async_eval(y)
            for _ in range(16):
                ny = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.async_eval(ny)
                mx.eval(y); y = ny
            mx.eval(y); pipe = (time.perf_counter() - t) / 17
            if rnd:
                res[name]["sync"].append(sync); res[name]["host"].append(statistics.median(hb)); res[name]["pipe"].append(pipe)
    f = {k: statistics.median(v) for k, v in res["full"].items()}
    for name, r in res.items():
        s, h, p = (statistics.median(r[k]) for k in ("sync", "host", "pipe"))
        P(f"A ctx {ctx} batch {b} {name:14s} sync {1e3*s:6.2f} ms ({f['sync']/s:.2f}x)  host {1e3*h:5.2f} ms  pipelined {1e3*p:6.2f} ms ({f['pipe']/p:.2f}x)")
    del caches; gc.collect(); mx.clear_cache()
