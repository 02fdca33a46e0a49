"""Q-Filters: a hand-computed case on every backend, filters from queries, calibrated filters
independent of the chunking, and the online fallback frozen after calibration."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.methods import qfilters

from tests._helpers import BACKENDS, pos, rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_qfilters_by_hand(backend):
    # Filter [1, 0]; keys [3, 0], [-1, 5], [2, 2], [0, 1] project 3, -1, 2, 0.
    k = rows([3.0, 0.0], [-1.0, 5.0], [2.0, 2.0], [0.0, 1.0])
    f = np.array([[1.0, 0.0]], np.float32)
    st = qfilters.qfilters_init_calibrated(f, 1, 1, 2, budget=2, n_sink=0, recent=0, backend=backend)
    assert pos(velox.qfilters_update(st, k, k)) == [0, 2]
    # sign = -1 keeps the least aligned: -3, 1, -2, 0 -> t1, t3.
    st = qfilters.qfilters_init_calibrated(f, 1, 1, 2, budget=2, n_sink=0, recent=0, sign=-1, backend=backend)
    assert pos(velox.qfilters_update(st, k, k)) == [1, 3]
    # recent = 1 protects t3; the best other is t0.
    st = qfilters.qfilters_init_calibrated(f, 1, 1, 2, budget=2, n_sink=0, recent=1, backend=backend)
    assert pos(velox.qfilters_update(st, k, k)) == [0, 3]
    # No filters, calib_tokens = 2: the queries of t0 and t1, [0, 1] each, set the direction
    # [0, 2]; t2's and t3's queries ([5, 0]) come after the calibration and do not count.
    # Projections 0, 10, 4, 2 -> t1, t2.
    q = rows([0.0, 1.0], [0.0, 1.0], [5.0, 0.0], [5.0, 0.0])
    st = velox.qfilters_init(1, 1, 2, budget=2, n_sink=0, calib_tokens=2, recent=0, backend=backend)
    st = velox.qfilters_update(st, k[:, :, :1], k[:, :, :1], queries=q[:, :, :1])
    st = velox.qfilters_update(st, k[:, :, 1:], k[:, :, 1:], queries=q[:, :, 1:])
    assert np.array(st.filters).ravel().tolist() == [0.0, 2.0]
    assert pos(st) == [1, 2]
    # Bytes: 2 rows x (key, value) x 2 x 4 B + positions 8 + next_pos 4 + filter 2 x 4 B.
    assert velox.qfilters_bytes(st) == 32 + 8 + 4 + 8


def test_qfilters_from_queries_planted_direction():
    # Queries of 2 kv heads x 2 query heads: a planted mean direction plus noise. The filter is
    # the top singular direction, signed so the queries project positively on it.
    rng = np.random.default_rng(0)
    u = np.stack([np.eye(8)[2], -np.eye(8)[5]])  # kv head 0: +e2, kv head 1: -e5
    q = rng.standard_normal((200, 4, 8)) * 0.3 + 3.0 * np.repeat(u, 2, axis=0)[None]
    f = qfilters.qfilters_from_queries(q, 2)
    assert f.shape == (2, 8) and f.dtype == np.float32
    assert np.allclose(np.linalg.norm(f, axis=1), 1, atol=1e-6)
    assert f[0, 2] > 0.99 and f[1, 5] < -0.99
    assert (q[:, :2] @ f[0]).sum() > 0 and (q[:, 2:] @ f[1]).sum() > 0
    with pytest.raises(ValueError, match="multiple"):
        qfilters.qfilters_from_queries(q[:, :3], 2)
    with pytest.raises(ValueError, match="filters shape"):
        qfilters.qfilters_init_calibrated(f, 1, 3, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qfilters_calibrated_is_path_independent(backend):
    # Context-agnostic scores: the kept set depends on the tokens seen, not on the chunking.
    rng = np.random.default_rng(1)
    k = mx.array(rng.standard_normal((1, 2, 40, 8)).astype(np.float32))
    f = rng.standard_normal((2, 8)).astype(np.float32)
    one = qfilters.qfilters_init_calibrated(f, 1, 2, 8, budget=10, n_sink=2, recent=0, backend=backend)
    one = velox.qfilters_update(one, k, k)
    step = qfilters.qfilters_init_calibrated(f, 1, 2, 8, budget=10, n_sink=2, recent=0, backend=backend)
    for t in range(40):
        step = velox.qfilters_update(step, k[:, :, t:t + 1], k[:, :, t:t + 1])
    assert np.array_equal(np.array(velox.positions(one)), np.array(velox.positions(step)))
    assert np.array_equal(np.array(one.filters), np.array(step.filters))  # never changes


@pytest.mark.parametrize("backend", BACKENDS)
def test_qfilters_fallback_freezes_after_calibration(backend):
    rng = np.random.default_rng(2)
    k = mx.array(rng.standard_normal((1, 1, 30, 4)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 2, 30, 4)).astype(np.float32))
    st = velox.qfilters_init(1, 1, 4, budget=8, n_sink=1, calib_tokens=12, recent=0, backend=backend)
    st = velox.qfilters_update(st, k[:, :, :10], k[:, :, :10], queries=q[:, :, :10])
    st = velox.qfilters_update(st, k[:, :, 10:20], k[:, :, 10:20], queries=q[:, :, 10:20])
    want = np.array(q[0, :, :12]).sum(axis=(0, 1))  # both query heads, the first 12 tokens
    assert np.allclose(np.array(st.filters)[0, 0], want, atol=1e-5)
    frozen = np.array(st.filters)
    st = velox.qfilters_update(st, k[:, :, 20:], k[:, :, 20:], queries=q[:, :, 20:])
    assert np.array_equal(np.array(st.filters), frozen)
