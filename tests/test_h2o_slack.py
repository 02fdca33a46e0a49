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


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_a_case_by_hand_zero_keys_attend_uniformly_over_the_filled_slots(backend):
    """Zero keys make every logit 0, so each query attends uniformly to what it sees. Budget
    2, slack 1, no sinks or grace, decay 1, three prefill tokens (key-as-query): token i gets
    sum_{j >= i} 1/(j+1): 11/6, 5/6, 1/3. Token 3 adds 1/4 to each of four candidates; its
    selection keeps tokens 0 and 1 and frees the third slot. Token 4 then sees two stored
    tokens and itself, 1/3 each (1/4 if the empty slot were attended)."""
    m = get_method("h2o")
    st = m.init(1, 1, 4, backend=backend, budget=2, n_sink=0, grace=0, decay=1.0, slack=1)
    z = lambda s: mx.zeros((1, 1, s, 4))  # noqa: E731
    st = m.update(st, z(3), z(3))
    np.testing.assert_allclose(np.array(st.scores)[0, 0], [11 / 6, 5 / 6, 1 / 3], rtol=1e-6)
    st = m.update(st, z(1), z(1))
    assert st.empty == 1
    pos = np.array(st.positions)[0, 0]
    assert sorted(pos.tolist()) == [-1, 0, 1]
    st = m.update(st, z(1), z(1))
    assert st.empty == 0
    pos, scores = np.array(st.positions)[0, 0], np.array(st.scores)[0, 0]
    want = {0: 11 / 6 + 1 / 4 + 1 / 3, 1: 5 / 6 + 1 / 4 + 1 / 3, 4: 1 / 3}
    assert sorted(pos.tolist()) == [0, 1, 4]
    np.testing.assert_allclose([scores[pos.tolist().index(p)] for p in (0, 1, 4)],
                               [want[p] for p in (0, 1, 4)], rtol=1e-6)
