"""H2O with amortized eviction (``slack``): empty slots receive no attention, the backends agree.

With ``slack > 0`` a selection frees ``slack`` slots at once and the next decode tokens fill
them; every stored token keeps accumulating attention at every step. The ``mlx`` backend
masks the empty slots out of the attention it accumulates (and the NumPy reference never
attends a slot at position -1), so what an empty slot holds cannot move a score.
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

from velox.registry import get_method

PARAMS = dict(budget=10, n_sink=2, grace=2, decay=0.9, slack=4)


def _arr(rng, *shape):
    return mx.array(rng.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("queries", [False, True], ids=["proxy", "real queries"])
def test_mlx_and_reference_agree_through_selections_and_empty_slots(queries):
    m = get_method("h2o")
    rng = np.random.default_rng(zlib.crc32(repr(("h2o-slack", queries)).encode()))
    b, h, g, d = 2, 2, 2, 16
    states = {be: m.init(b, h, d, backend=be, **PARAMS) for be in ("mlx", "reference")}
    k, v = _arr(rng, b, h, 13, d), _arr(rng, b, h, 13, d)
    q = _arr(rng, b, h * g, 13, d) if queries else None
    states = {be: m.update(st, k, v, queries=q) for be, st in states.items()}
    empties = set()
    for step in range(24):
        k, v = _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
        q = _arr(rng, b, h * g, 1, d) if queries else None
        states = {be: m.update(st, k, v, queries=q) for be, st in states.items()}
        got, want = states["mlx"], states["reference"]
        assert got.empty == want.empty, step
        empties.add(got.empty)
        np.testing.assert_array_equal(np.array(got.positions), np.array(want.positions), err_msg=str(step))
        filled = np.array(got.positions) >= 0
        np.testing.assert_allclose(np.array(got.scores)[filled], np.array(want.scores)[filled],
                                   rtol=1e-5, atol=1e-6, err_msg=str(step))
        assert filled.sum(axis=-1).max() <= PARAMS["budget"] + PARAMS["slack"]
    assert empties == {0, 1, 2, 3, 4}  # every fill level was stepped through


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_empty_slots_receive_no_attention(backend):
    """Whatever an empty slot's key holds (here a key that would take nearly all attention),
    the filled slots' scores and the new token's are those of a zero key there."""
    m = get_method("h2o")
    rng = np.random.default_rng(7)
    b, h, d = 1, 2, 16
    st = m.init(b, h, d, backend=backend, **PARAMS)
    st = m.update(st, _arr(rng, b, h, 14, d), _arr(rng, b, h, 14, d))
    st = m.update(st, _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d))  # a selection: slots freed
    assert st.empty == PARAMS["slack"]
    empty = np.array(st.positions) < 0
    k, v = _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
    outs = []
    for fill in (0.0, 1.0):
        keys = np.array(st.keys)
        keys[empty] = fill * 50.0 * np.array(k)[:, :, 0][:, :, None].repeat(keys.shape[2], 2)[empty]
        outs.append(m.update(st._replace(keys=mx.array(keys)), k, v))
    zero, loud = outs
    np.testing.assert_array_equal(np.array(zero.positions), np.array(loud.positions))
    filled = np.array(zero.positions) >= 0
    np.testing.assert_allclose(np.array(loud.scores)[filled], np.array(zero.scores)[filled], rtol=1e-6, atol=1e-7)
