"""A/B in one process of the adapter's compiled decode update (split: the row write left for
the next step) with a piece of ``velox.evict`` as it is (new) and as it was (old), beside
mlx-lm's RotatingKVCache step; SmolLM2's attention (3 kv heads, head_dim 64), budget 512,
float32, 380 timed steps interleaved; checks that both versions end in the same states.

    python docs/results/update-cpu/update_ab.py write_slot    # per-slot values by a select
    python docs/results/update-cpu/update_ab.py decode_slot   # the loser among stored slots

``write_slot``: old writes every array by a gather and a scatter; ``decode_slot``: old puts
the new token among the candidates, with a write mask and the rows gathered around it.
"""
import sys
import statistics
import time

import velox.evict as E  # velox first: OpenBLAS (velox._blas)
import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from velox.adapters.mlxlm import _split_step, _write_row
from velox.registry import get_method


def old_write_slot(a, x, slot, write=None):
    rest = a.shape[3:]
    if not all(rest):
        return a
    idx = slot.reshape(slot.shape + (1,) * len(rest))
    x = x.astype(a.dtype)
    if write is not None:
        x = mx.where(write.reshape(write.shape + (1,) * len(rest)), x, mx.take_along_axis(a, idx, axis=2))
    return mx.put_along_axis(a, idx, x, axis=2)


def old_decode_slot(plan, state, scores, new_pos):
    b, h, n = state.positions.shape
    cand = mx.concatenate([state.positions, new_pos], axis=2)
    if scores is None:
        scores = mx.zeros((b, 1, n + 1), mx.float32)
    total = state.next_pos[:, :, None] + 1
    if plan.shared(state) or scores.shape[1] == 1:
        scores = scores.mean(axis=1, keepdims=True) if scores.shape[1] > 1 else scores
        cand, total = cand[:, :1], total[:, :1]
    assert plan.slack(state) == 0
    loser = mx.broadcast_to(E.slot_losers(scores, cand, total, 1, plan.sinks(state), plan.recent(state)), (b, h, 1))
    write = loser < n
    return E.Move(slot=mx.where(write, loser, 0), write=write), state.positions


PIECES = {"write_slot": (old_write_slot, ("h2o", "tova")), "decode_slot": (old_decode_slot, ("h2o", "knorm"))}


def main(piece: str, b=1, h=3, d=64, n=512) -> None:
    old, keys = PIECES[piece]
    new = getattr(E, "_" + piece if piece == "decode_slot" else piece)
    name = "_decode_slot" if piece == "decode_slot" else "write_slot"
    for key in keys:
        m = get_method(key)
        st0 = m.init(b, h, d, dtype=mx.float32, backend="mlx", budget=n)
        st0 = m.update(st0, mx.random.normal((b, h, n + 1, d)), mx.random.normal((b, h, n + 1, d)))
        mx.eval(st0)
        fns = {}
        for lab, fn in (("old", old), ("new", new)):
            setattr(E, name, fn)
            f = mx.compile(lambda s, k, v, m=m: _split_step(m, s, k, v, None))
            f(st0, mx.zeros((b, h, 1, d)), mx.zeros((b, h, 1, d)))  # traced with this version
            fns[lab] = [f, st0, None]
        setattr(E, name, new)
        ring = RotatingKVCache(max_size=n, keep=4)
        ring.update_and_fetch(mx.random.normal((b, h, n, d)), mx.random.normal((b, h, n, d)))
        mx.eval(ring.keys)
        ts = {"old": [], "new": [], "ring": []}
        for step in range(400):
            k = mx.random.normal((b, h, 1, d))
            v = mx.random.normal((b, h, 1, d))
            mx.eval(k, v)
            for lab in ("old", "new", "ring"):
                t = time.perf_counter()
                if lab == "ring":
                    ring.update_and_fetch(k, v)
                    mx.eval(ring.keys, ring.values)
                else:
                    f, st, row = fns[lab]
                    if row is not None:
                        st = _write_row(st, row)
                    st, row = f(st, k, v)
                    mx.eval(st, row)
                    fns[lab][1:] = [st, row]
                if step >= 20:
                    ts[lab].append(time.perf_counter() - t)
        r = {k2: 1e6 * statistics.median(v2) for k2, v2 in ts.items()}
        a, c = (_write_row(fns[x][1], fns[x][2]) for x in ("old", "new"))
        same = all(bool(mx.array_equal(x, y)) for x, y in zip(a, c) if isinstance(x, mx.array))
        print(key, {k2: round(v2, 1) for k2, v2 in r.items()}, "old/ring", round(r["old"] / r["ring"], 2),
              "new/ring", round(r["new"] / r["ring"], 2), "same states", same)


if __name__ == "__main__":
    main(sys.argv[1])
