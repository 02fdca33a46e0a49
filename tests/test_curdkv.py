"""CurDKV: a hand-computed case on every backend, leverage as energy shares, and decode steps
that reuse the chunk's subspaces."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.methods import curdkv

from tests._helpers import BACKENDS, pos, rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_curdkv_by_hand(backend):
    # Keys [3, 0], [0, 1], [0, 1] (energies 9, 1, 1 of 11); values [1, 0], [2, 0], [0, 1]
    # (1, 4, 1 of 6). At full rank (rank_cap = d = 2) the leverage is the energy share:
    # keys 9/11, 1/11, 1/11; values 1/6, 4/6, 1/6; products .136, .061, .015.
    # Budget 2: t0 and t1; t1 and t2 have the same key, t1's value carries more.
    k = rows([3.0, 0.0], [0.0, 1.0], [0.0, 1.0])
    v = rows([1.0, 0.0], [2.0, 0.0], [0.0, 1.0])
    st = velox.curdkv_init(1, 1, 2, budget=2, n_sink=0, rank_cap=2, backend=backend)
    assert pos(velox.curdkv_update(st, k, v)) == [0, 1]
    lev_k = np.array(curdkv.curdkv_leverage(k, 2))[0, 0]
    assert np.allclose(lev_k, [9 / 11, 1 / 11, 1 / 11], atol=1e-6)
    # Rank 1 keeps the top direction [1, 0] only: key leverage 9/11, 0, 0, retained energy 9/11.
    lev_1 = np.array(curdkv.curdkv_leverage(k, 1))[0, 0]
    assert np.allclose(lev_1, [9 / 11, 0, 0], atol=1e-6)


@pytest.mark.parametrize("rank_cap", [1, 3, 8, 40])
def test_curdkv_leverage_energy_shares(rank_cap):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 20, 8)).astype(np.float32) * np.array([5, 3, 2, 1, 1, 1, .5, .1])
    lev = np.array(curdkv.curdkv_leverage(mx.array(x), rank_cap))
    r = min(rank_cap, 8)
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    retained = (s[..., :r] ** 2).sum(-1) / (s ** 2).sum(-1)
    assert (lev >= 0).all()
    assert np.allclose(lev.sum(-1), retained, atol=1e-5)  # 1 at full rank
    x12 = x[1, 2].astype(np.float64)
    want = curdkv._energy_reference(x12, curdkv._fit_reference(x12, r)) / (x12 ** 2).sum()
    assert np.allclose(lev[1, 2], want, atol=1e-6)
    zero = np.array(curdkv.curdkv_leverage(mx.zeros((1, 1, 5, 8)), rank_cap))
    assert np.isfinite(zero).all() and (zero == 0).all()


def test_curdkv_decode_steps_reuse_the_chunk_subspace():
    """A chunk fits the subspaces; a decode step scores with them (no refit), and a cache fed
    token by token scores by full-rank energy share until its first chunk."""
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((1, 2, 40, 16)).astype(np.float32))
    st = velox.curdkv_init(1, 2, 16, budget=20, n_sink=0, rank_cap=3)
    st = velox.curdkv_update(st, x[:, :, :30], x[:, :, :30])
    basis = np.array(st.key_basis)
    assert basis.shape == (1, 2, 16, 3) and np.abs(basis).sum() > 0
    st2 = velox.curdkv_update(st, x[:, :, 30:31], x[:, :, 30:31])
    assert np.array_equal(np.array(st2.key_basis), basis)
    cand = mx.concatenate([st.keys, x[:, :, 30:31]], axis=2)
    lev = np.array(curdkv._leverage(cand, st.key_basis))
    proj = np.array(cand) @ basis
    want = (proj ** 2).sum(-1) / (np.array(cand) ** 2).sum(axis=(2, 3))[..., None]
    assert np.allclose(lev, want, atol=1e-6)
    # the state carries each kept row's score in the stored subspaces: ||k V||^2 * ||v W||^2
    pk = np.array(st2.keys) @ basis
    pv = np.array(st2.values) @ np.array(st2.value_basis)
    np.testing.assert_allclose(np.array(st2.scores), (pk ** 2).sum(-1) * (pv ** 2).sum(-1), rtol=1e-5)
    fresh = velox.curdkv_init(1, 2, 16, budget=4, n_sink=0, rank_cap=3)
    for t in range(5):
        fresh = velox.curdkv_update(fresh, x[:, :, t:t + 1], x[:, :, t:t + 1])
    assert np.abs(np.array(fresh.key_basis)).sum() == 0  # never fitted
    e = (np.array(x[:, :, :5]) ** 2).sum(-1)
    score = e * e  # keys == values: key share x value share, same normaliser
    want_pos = np.sort(np.argsort(score, axis=-1, kind="stable")[..., 1:], axis=-1)
    assert np.array_equal(np.array(velox.positions(fresh)), want_pos)
