"""A/B in one process: the adapter's compiled decode update (split: the row write left for the
next step) with per-slot values written by a gather and a scatter (orig) or by one select
(where, velox.evict.write_slot now), beside mlx-lm's RotatingKVCache step; SmolLM2's
attention (3 kv heads, head_dim 64), budget 512, float32, 380 timed steps interleaved.

    python docs/results/update-cpu/write_slot_ab.py
"""
import velox
import mlx.core as mx, time, statistics, math
import velox.evict as E
from velox.adapters.mlxlm import _split_step, _write_row
from velox.registry import get_method
from mlx_lm.models.cache import RotatingKVCache
ws_where = E.write_slot  # a per-slot value by one select


def orig(a, x, slot, write=None):  # every array by a gather and a scatter, as before
    rest = a.shape[3:]
    if math.prod(rest) == 0:
        return a
    idx = slot.reshape(slot.shape + (1,) * len(rest))
    x = x.astype(a.dtype)
    if write is not None:
        x = mx.where(write.reshape(write.shape + (1,) * len(rest)), x, mx.take_along_axis(a, idx, axis=2))
    return mx.put_along_axis(a, idx, x, axis=2)
b, h, d, n = 1, 3, 64, 512
res = {}
for key in ("h2o", "tova"):
    m = get_method(key)
    fns = {}
    for lab, ws in (("orig", orig), ("where", ws_where)):
        E.write_slot = ws
        fns[lab] = mx.compile(lambda s, k, v, m=m: _split_step(m, s, k, v, None))
        st = m.init(b, h, d, dtype=mx.float32, backend="mlx", budget=n)
        st = m.update(st, mx.random.normal((b, h, n + 1, d)), mx.random.normal((b, h, n + 1, d)))
        mx.eval(st)
        fns[lab] = [fns[lab], st, None]
        E.write_slot = ws_where
    ring = RotatingKVCache(max_size=n, keep=4)
    ring.update_and_fetch(mx.random.normal((b, h, n, d)), mx.random.normal((b, h, n, d)))
    mx.eval(ring.keys)
    ts = {"orig": [], "where": [], "ring": []}
    for step in range(400):
        k = mx.random.normal((b, h, 1, d)); v = mx.random.normal((b, h, 1, d)); mx.eval(k, v)
        for lab in ("orig", "where", "ring"):
            t = time.perf_counter()
            if lab == "ring":
                ring.update_and_fetch(k, v); mx.eval(ring.keys, ring.values)
            else:
                f, st, row = fns[lab]
                if row is not None:
                    st = _write_row(st, row)
                st, row = f(st, k, v); mx.eval(st, row)
                fns[lab][1:] = [st, row]
            if step >= 20:
                ts[lab].append(time.perf_counter() - t)
    r = {k2: 1e6 * statistics.median(v2) for k2, v2 in ts.items()}
    print(key, {k2: round(v2, 1) for k2, v2 in r.items()}, "orig/ring", round(r["orig"]/r["ring"], 2), "where/ring", round(r["where"]/r["ring"], 2))
