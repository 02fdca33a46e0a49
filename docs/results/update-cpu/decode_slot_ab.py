"""A/B in one process: the adapter's compiled decode update (split: the row write left for the
next step) with ``velox.evict._decode_slot`` as it is (new: where recent tokens are protected,
the loser is chosen among the stored slots and the new row always written) and as it was (old:
the new token among the candidates, a write mask and the rows gathered around it), beside
mlx-lm's RotatingKVCache step; SmolLM2's attention (3 kv heads, head_dim 64), budget 512,
float32, 380 timed steps interleaved. Also checks both give the same states.

    python docs/results/update-cpu/decode_slot_ab.py
"""
import velox
import mlx.core as mx, time, statistics
import velox.evict as E
from velox.adapters.mlxlm import _split_step, _write_row
from velox.registry import get_method
from mlx_lm.models.cache import RotatingKVCache

new_decode_slot = E._decode_slot


def old_decode_slot(plan, state, scores, new_pos):
    b, h, n = state.positions.shape
    cand = mx.concatenate([state.positions, new_pos], axis=2)
    if scores is None:
        scores = mx.zeros((b, 1, n + 1), mx.float32)
    total = state.next_pos[:, :, None] + 1
    if plan.shared(state) or scores.shape[1] == 1:
        scores = scores.mean(axis=1, keepdims=True) if scores.shape[1] > 1 else scores
        cand, total = cand[:, :1], total[:, :1]
    slack, sinks, recent = plan.slack(state), plan.sinks(state), plan.recent(state)
    assert slack == 0
    loser = mx.broadcast_to(E.slot_losers(scores, cand, total, 1, sinks, recent), (b, h, 1))
    write = loser < n
    return E.Move(slot=mx.where(write, loser, 0), write=write), state.positions


b, h, d, n = 1, 3, 64, 512
for key, params in (("h2o", {}), ("knorm", {})):
    m = get_method(key)
    fns = {}
    st0 = m.init(b, h, d, dtype=mx.float32, backend="mlx", budget=n, **params)
    st0 = m.update(st0, mx.random.normal((b, h, n + 1, d)), mx.random.normal((b, h, n + 1, d)))
    mx.eval(st0)
    for lab, fn in (("old", old_decode_slot), ("new", new_decode_slot)):
        E._decode_slot = fn
        f = mx.compile(lambda s, k, v, m=m: _split_step(m, s, k, v, None))
        f(st0, mx.zeros((b, h, 1, d)), mx.zeros((b, h, 1, d)))  # traced with this version
        fns[lab] = [f, st0, None]
    E._decode_slot = new_decode_slot
    ring = RotatingKVCache(max_size=n, keep=4)
    ring.update_and_fetch(mx.random.normal((b, h, n, d)), mx.random.normal((b, h, n, d)))
    mx.eval(ring.keys)
    ts = {"old": [], "new": [], "ring": []}
    for step in range(400):
        k = mx.random.normal((b, h, 1, d)); v = mx.random.normal((b, h, 1, d)); mx.eval(k, v)
        for lab in ("old", "new", "ring"):
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
    a, c = (_write_row(fns[x][1], fns[x][2]) for x in ("old", "new"))
    same = all(bool(mx.array_equal(x, y)) for x, y in zip(a, c) if isinstance(x, mx.array))
    print(key, {k2: round(v2, 1) for k2, v2 in r.items()}, "old/ring", round(r["old"] / r["ring"], 2),
          "new/ring", round(r["new"] / r["ring"], 2), "same states", same)
