"""Per layer, the host's build and the evaluation of a decode step's pieces at batch 1 and 32
(16 layers per evaluation, 2048 stored rows, Llama-3.2-1B's attention, bfloat16): mlx-lm's
full-cache step, TOVA's compiled fused step, its two kernels alone, the row write's two
scatters, trivial ops; and the op graph of one fused step (README, "the host").

    python docs/results/speed/host/step_cost.py
"""
import statistics, sys, time, os
import mlx.core as mx
from velox.adapters import mlxlm
from velox.kernels import evict as ev
from velox.registry import get_method
from velox import evict as E

LAYERS, H, G, D, N = 16, 8, 4, 64, 2048

def timeit(layer, reps=30):
    for _ in range(3):
        mx.eval([layer(i) for i in range(LAYERS)])
    mx.synchronize()
    bs, es = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [layer(i) for i in range(LAYERS)]
        t1 = time.perf_counter()
        mx.eval(outs); mx.synchronize()
        t2 = time.perf_counter()
        bs.append(t1 - t0); es.append(t2 - t1)
    return 1e6 * statistics.median(bs) / LAYERS, 1e6 * statistics.median(es) / LAYERS

def run(b):
    dt = mx.bfloat16
    rnd = lambda *s: mx.random.normal(s).astype(dt)
    q, k, v = rnd(b, H * G, 1, D), rnd(b, H, 1, D), rnd(b, H, 1, D)
    Ks = [rnd(b, H, N + 256, D) for _ in range(LAYERS)]
    Vs = [rnd(b, H, N + 256, D) for _ in range(LAYERS)]
    mx.eval(q, k, v, Ks, Vs)
    res = {}
    def full(i):
        Ks[i][..., N:N + 1, :] = k
        Vs[i][..., N:N + 1, :] = v
        return mx.fast.scaled_dot_product_attention(q, Ks[i][..., :N + 1, :], Vs[i][..., :N + 1, :], scale=D ** -0.5)
    res["full"] = timeit(full)
    m = get_method("tova")
    states = []
    for _ in range(LAYERS):
        st = m.init(b, H, D, dtype=dt, backend="cuda", budget=N)
        states.append(m.update(st, rnd(b, H, N + 3, D), rnd(b, H, N + 3, D), queries=rnd(b, H * G, N + 3, D)))
    mx.eval(states)
    fused = mlxlm._compiled(m, "fused+row", "cuda")
    fused0 = mlxlm._compiled(m, "fused", "cuda")
    rows = [None] * LAYERS
    def step(i):
        if rows[i] is None:
            o, states[i], rows[i] = fused0(states[i], q, k, v, D ** -0.5)
        else:
            o, states[i], rows[i] = fused(states[i], rows[i], q, k, v, D ** -0.5)
        return mlxlm._with_state(o, mlxlm._arrays(states[i]) + mlxlm._arrays(rows[i]))
    res["tova fused+row (compiled)"] = timeit(step)
    st0 = states[0]
    # graph of one step
    o, s2, r2 = mlxlm._fused_step_with_row(m)(states[1], rows[1], q, k, v, D ** -0.5)
    mx.export_to_dot(f"/tmp/g{b}.dot", o, *mlxlm._arrays(s2), *mlxlm._arrays(r2))
    lines = [l for l in open(f"/tmp/g{b}.dot") if "label" in l and "shape=box" not in l]
    print(f"b={b} graph nodes:", len(open(f'/tmp/g{b}.dot').read().split('\n')))
    labs = [l.strip() for l in open(f"/tmp/g{b}.dot") if "label" in l]
    print("\n".join(l for l in labs if "rectangle" not in l and "box" not in l)[:4000])
    def kernels(i):
        st = states[i]
        return list(ev.attend_select(q, st.keys, st.values, k, v, st.positions, st.next_pos,
                                     n_sink=4, recent=0, shared=False)[:6])
    try:
        res["attend_select kernels, eager"] = timeit(kernels)
    except Exception as e:
        print("kernels failed", e)
    slot = mx.zeros((b, H, 1), mx.int32)
    wr = mx.compile(lambda K, V, s, kk, vv: (E.write_slot(K, kk, s), E.write_slot(V, vv, s)))
    KK = [rnd(b, H, N, D) for _ in range(LAYERS)]; VV = [rnd(b, H, N, D) for _ in range(LAYERS)]
    mx.eval(KK, VV)
    def scat(i):
        KK[i], VV[i] = wr(KK[i], VV[i], slot, k, v)
        return [KK[i], VV[i]]
    res["2 scatters (compiled)"] = timeit(scat)
    x = mx.zeros((4,), dt); mx.eval(x)
    res["trivial add"] = timeit(lambda i: x + 1)
    idf = mx.compile(lambda a: a + 1)
    res["compiled trivial add"] = timeit(lambda i: idf(x))
    big = mx.compile(lambda s, a: (s._replace(next_pos=s.next_pos + 1), a + 1))
    res["compiled state passthrough"] = timeit(lambda i: big(states[i], x)[1])
    for key, (bb, ee) in res.items():
        print(f"b={b:2d} {key:32s} build {bb:7.2f} us/layer  eval {ee:7.2f} us/layer  total {bb+ee:7.2f}")

for b in (1, 32):
    run(b)
