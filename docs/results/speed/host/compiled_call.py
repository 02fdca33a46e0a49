"""The host time of the compiled fused decode step's call (``_compiled(m, "fused+row")``) with
the real kernels and with kernels replaced by views of an input, and the traces it takes
(README, "the host"). Batch 1, 2048 rows, bfloat16.

    python docs/results/speed/host/compiled_call.py
"""
import mlx.core as mx, time, statistics, sys
from velox.adapters import mlxlm
from velox.registry import get_method
import velox.kernels.evict as kev
traces = [0]
orig = mlxlm._fused_step
def counted(m):
    f = orig(m)
    def g(*a):
        traces[0] += 1
        return f(*a)
    return g
mlxlm._fused_step = counted
mlxlm._STEP_KINDS["fused"] = counted
b, H, G, D, N = 1, 8, 4, 64, 2048
dt = mx.bfloat16
rnd = lambda *s: mx.random.normal(s).astype(dt)
q, k, v = rnd(b, H * G, 1, D), rnd(b, H, 1, D), rnd(b, H, 1, D)
for key in ("tova", "streaming_llm"):
  for stubbed in (False, True):
    if stubbed:
        real = kev._run_kernel
        kev._run_kernel = lambda variant, inputs, grid, tg, shapes, dtypes, template: [mx.broadcast_to(inputs[0].reshape(-1)[:1].astype(d), sh) for sh, d in zip(shapes, dtypes)]
    mlxlm._COMPILED.clear()
    m = get_method(key)
    p = dict(window_size=N - 4) if key == "streaming_llm" else dict(budget=N)
    st = m.init(b, H, D, dtype=dt, backend="cuda", **p)
    st = m.update(st, rnd(b, H, N + 3, D), rnd(b, H, N + 3, D), queries=rnd(b, H * G, N + 3, D))
    mx.eval(st)
    f0 = mlxlm._compiled(m, "fused", "cuda")
    o, s2, r2 = f0(st, q, k, v, D ** -0.5); mx.eval(o, s2, r2)
    f1 = mlxlm._compiled(m, "fused+row", "cuda")
    traces[0] = 0
    ts, es = [], []
    for i in range(300):
        t = time.perf_counter()
        o, s2, r2 = f1(s2, r2, q, k, v, D ** -0.5)
        t1 = time.perf_counter()
        mx.eval(o, s2, r2)
        es.append(time.perf_counter() - t1)
        ts.append(t1 - t)
    print(key, "stubbed" if stubbed else "real", f"compiled call {1e6*statistics.median(ts):.1f} us, eval {1e6*statistics.median(es):.1f} us, traces {traces[0]}")
    if stubbed:
        kev._run_kernel = real
