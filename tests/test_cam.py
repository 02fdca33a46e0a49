"""CaM: hand-computed merges and the merge gate, merge="drop" as exactly H2O, convex merges,
the dense merge against the reference, and the carried key norms."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import velox
import velox.testing as vt
from velox.noise import hash_uniform_np

from tests._helpers import BACKENDS, MATCHED, pos, rows, run_pair, stream


# CaM: 4 tokens in one chunk with zero queries, so every query attends uniformly to what it
# sees: query i gives 1/(i+1) to t0..ti. Accumulated (decay 1): t0 25/12, t1 13/12, t2 7/12,
# t3 3/12. Budget 3, sink t0, grace protects t3: t2 is evicted.
CAM_V = rows([0, 0], [1, -1], [2, -2], [3, -3])
CAM_Q = mx.zeros((1, 1, 4, 2))


def cam_run(keys, backend, **kw):
    st = velox.cam_init(1, 1, 2, budget=3, n_sink=1, grace=1, decay=1.0, backend=backend, **kw)
    return velox.cam_update(st, keys, CAM_V, queries=CAM_Q)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cam_by_hand(backend):
    # Keys t0 [1,0], t1 [1,0], t2 [0,1], t3 [0,2]: t2's cosine is 0 with t1 and 1 with t3, so
    # t3 is its target. Gate: min(1, (7/12) / (3/12)) = 1, it always merges.
    k = rows([1, 0], [1, 0], [0, 1], [0, 2])
    for merge in ("mean", "sim_weighted"):  # w = 1 for both: t3 becomes the mean of v3 and v2
        st = cam_run(k, backend, merge=merge)
        assert pos(st) == [0, 1, 3]
        assert np.array(st.values)[0, 0].tolist() == [[0, 0], [1, -1], [2.5, -2.5]]
        assert np.allclose(np.array(st.scores)[0, 0], [25 / 12, 13 / 12, 3 / 12 + 7 / 12], atol=1e-6)
        assert np.array(st.keys)[0, 0].tolist() == [[1, 0], [1, 0], [0, 2]]   # keys not merged
    st = cam_run(k, backend, merge="mean", merge_keys=True)
    assert np.array(st.keys)[0, 0].tolist() == [[1, 0], [1, 0], [0, 1.5]]
    # The paper's window rule: v2 / 1 is added to the one kept token after t2 (t3).
    st = cam_run(k, backend, merge="window", merge_window=1)
    assert np.array(st.values)[0, 0, 2].tolist() == [5, -5]
    # drop: h2o, values untouched.
    st = cam_run(k, backend, merge="drop")
    assert np.array(st.values)[0, 0].tolist() == [[0, 0], [1, -1], [3, -3]]
    # A partly similar target: t2 = [1, 2] has cos 1/sqrt(5) with t1 and w = 2/sqrt(5) with t3:
    # v3' = (v3 + w v2) / (1 + w) with sim_weighted.
    st = cam_run(rows([1, 0], [1, 0], [1, 2], [0, 2]), backend, merge="sim_weighted")
    w = 2 / 5 ** 0.5
    want = (3 + 2 * w) / (1 + w)
    assert np.allclose(np.array(st.values)[0, 0, 2], [want, -want], atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cam_gate_by_hand(backend):
    # Now t2 = [1, 0] is most similar to t1 (cos 1, t3 gives 0): the gate probability is
    # (7/12) / (13/12) = 7/13, and the draw for position 2 is hash_uniform(seed, 2).
    k = rows([1, 0], [1, 0], [1, 0], [0, 2])
    draws = {seed: hash_uniform_np(seed, np.array([2]))[0] for seed in range(40)}
    merged = next(s for s, u in draws.items() if u < 7 / 13 - 0.01)
    dropped = next(s for s, u in draws.items() if u > 7 / 13 + 0.01)
    st = cam_run(k, backend, merge="mean", seed=merged)
    assert np.array(st.values)[0, 0, 1].tolist() == [1.5, -1.5]     # (v1 + v2) / 2
    assert np.allclose(np.array(st.scores)[0, 0, 1], 20 / 12, atol=1e-6)
    st = cam_run(k, backend, merge="mean", seed=dropped)
    assert np.array(st.values)[0, 0, 1].tolist() == [1, -1]
    assert np.allclose(np.array(st.scores)[0, 0, 1], 13 / 12, atol=1e-6)
    st = cam_run(k, backend, merge="mean", seed=dropped, merge_gate=False)
    assert np.array(st.values)[0, 0, 1].tolist() == [1.5, -1.5]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [0, 2])
def test_cam_drop_is_h2o(backend, groups):
    kw = dict(MATCHED, grace=5, decay=0.9, backend=backend)
    run_pair(velox.cam_init(2, 2, 16, merge="drop", **kw), velox.cam_update,
             velox.h2o_init(2, 2, 16, **kw), velox.h2o_update, 2, groups)


def test_cam_merges_are_convex_and_keys_stay_exact():
    k, v, q = stream(11, chunks=(50,), groups=2)[0]
    for merge in ("sim_weighted", "mean"):
        st = velox.cam_update(velox.cam_init(2, 2, 16, budget=20, n_sink=2, grace=3, merge=merge,
                                             merge_gate=False), k, v, queries=q)
        p = np.array(st.positions)
        # keys are the input rows (merge_keys=False); values moved toward other rows but stay
        # inside the per-channel range of the inputs (a convex combination).
        assert np.array_equal(np.array(st.keys), np.take_along_axis(np.array(k), p[..., None], axis=2))
        lo, hi = np.array(v).min(axis=2, keepdims=True), np.array(v).max(axis=2, keepdims=True)
        vals = np.array(st.values)
        assert (vals >= lo - 1e-6).all() and (vals <= hi + 1e-6).all()
        assert not np.array_equal(vals, np.take_along_axis(np.array(v), p[..., None], axis=2))
        # sinks are never merge targets
        assert np.array_equal(vals[:, :, :2], np.array(v)[:, :, :2])
    # Deterministic given the seed; another seed gates differently.
    a, b, c = (velox.cam_update(velox.cam_init(2, 2, 16, budget=20, n_sink=2, grace=3, seed=seed),
                                k, v, queries=q) for seed in (1, 1, 2))
    assert mx.array_equal(a.values, b.values).item()
    assert not mx.array_equal(a.values, c.values).item()


@settings(max_examples=max(3, settings.default.max_examples))
@given(data=st.data())
def test_cam_dense_merge_matches_reference(data):
    """CaM's dense merge (the form GPUs run) agrees with the reference like the row-wise one."""
    from velox.methods import cam

    case = data.draw(vt.cases("cam", contents=vt.CONTINUOUS), label="case")
    atol, rtol = vt.tolerance(case)
    steps = vt.make_inputs(case)
    want = vt.run(case, "reference", steps=steps)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cam, "_rowwise", lambda: False)
        got = vt.run(case, "mlx", steps=steps)
    for t, (a, b) in enumerate(zip(got, want)):
        vt.assert_states_close(case, a, b, atol=atol, rtol=rtol, what=f"dense mlx vs reference after update {t}")


@pytest.mark.parametrize("backend,rowwise", [("reference", True), ("mlx", True), ("mlx", False)])
@pytest.mark.parametrize("merge", ["sim_weighted", "window", "drop"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_cam_key_norms_are_the_stored_keys_norms(dtype, merge, backend, rowwise):
    """The carried key norms stay the norms of the keys the state holds, merged ones too."""
    from velox.methods import cam

    rng = np.random.default_rng(5)
    st = velox.cam_init(1, 2, 16, dtype=dtype, budget=12, n_sink=2, grace=2, merge=merge,
                        merge_keys=True, merge_gate=False, backend=backend)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cam, "_rowwise", lambda: rowwise)
        seen = []
        for s in (20, 1, 1, 3, 1, 1):
            k, v = (mx.array(rng.standard_normal((1, 2, s, 16)).astype(np.float32)).astype(dtype)
                    for _ in range(2))
            seen.append(np.array(k.astype(mx.float32)))
            st = velox.cam_update(st, k, v)
            keys = np.array(st.keys.astype(mx.float32)).astype(np.float64)
            assert st.key_norms.dtype == mx.float32 and st.key_norms.shape == st.positions.shape
            assert np.allclose(np.array(st.key_norms), np.linalg.norm(keys, axis=-1), rtol=1e-6, atol=1e-6)
    inputs = np.take_along_axis(np.concatenate(seen, axis=2), np.array(st.positions)[..., None], axis=2)
    merged = ~(np.array(st.keys.astype(mx.float32)) == inputs).all(axis=-1)
    assert merged.any() == (merge != "drop")  # the norms of merged keys were checked too
