"""NestedKV: a hand-computed case on every backend, and a finite, bounded score."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.methods import nestedkv

from tests._helpers import BACKENDS, pos, rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_nestedkv_by_hand(backend):
    # Unit keys [1,0], [1,0], [1,0], [0,1]; window 1, beta 0, kappa 0 (gate 1/2).
    # Stable anchor [.75, .25] (norm .7906): cos .9487 (t0-t2), .3162 (t3); anomalies
    # .0513, .0513, .0513, .6838 -> min-max 0, 0, 0, 1. One block (N < 128): episodic = stable.
    # Window 1: the anchor is the key itself, anomaly 0 everywhere -> 0.
    # beta 0: weights = prior (.4, .4, .2): blend 0, 0, 0, .8. Surprise = std(1, 1, 0) = .4714
    # at t3, 0 elsewhere -> min-max 0, 0, 0, 1. Score = (blend + max) / 2 = 0, 0, 0, .9.
    k = rows([1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0])
    score = nestedkv.nestedkv_score(k, window=1, beta=0.0, tau=0.6, kappa=0.0)
    assert np.allclose(np.array(score)[0, 0], [0, 0, 0, 0.9], atol=1e-6)
    # Budget 3 with the sink t0: t3 (.9), then t1 and t2 tie at 0 and the newer (t2) stays.
    st = velox.nestedkv_init(1, 1, 2, budget=3, n_sink=1, window=1, beta=0.0, kappa=0.0, backend=backend)
    st = velox.nestedkv_update(st, k, k)
    assert pos(st) == [0, 2, 3]
    st = velox.nestedkv_update(st, rows([5.0, 5.0]), rows([5.0, 5.0]))  # decode: appended
    assert pos(st) == [0, 2, 3, 4]


def test_nestedkv_score_is_finite_and_bounded():
    rng = np.random.default_rng(6)
    k = mx.array(rng.standard_normal((1, 2, 300, 16)).astype(np.float32))  # 300 // 32 -> block 128
    for x in (k, mx.zeros((1, 1, 7, 16)), mx.ones((1, 1, 7, 16))):
        score = np.array(nestedkv.nestedkv_score(x, window=5))
        assert np.isfinite(score).all() and (score >= 0).all() and (score <= 1).all()
    # The mlx score agrees with the reference's, anchor by anchor.
    st = velox.nestedkv_init(1, 2, 16, window=5)
    want = nestedkv._score_reference(np.array(k)[0, 1].astype(np.float64), st)
    assert np.allclose(np.array(nestedkv.nestedkv_score(k, window=5))[0, 1], want, atol=1e-5)
    assert nestedkv.block_size(300) == 128 and nestedkv.block_size(10_000) == 256
