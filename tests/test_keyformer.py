"""Keyformer: the Gumbel-noised scores by hand, the noise hash, chunking independence, and zero
temperature as exactly H2O (with noise, the choice differs)."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.noise import hash_uniform, hash_uniform_np

from tests._helpers import BACKENDS, MATCHED, pos, rows, run_pair, stream


def gumbel(seed, key_pos, query_pos):
    return -np.log(-np.log(hash_uniform_np(seed, np.array(key_pos), np.array(query_pos))))


@pytest.mark.parametrize("backend", BACKENDS)
def test_keyformer_by_hand(backend):
    # Zero keys (d=1): every logit is 0, so query t adds softmax(tau * g) over t0..t. Query 0
    # sees t0 alone (weight 1); query 1 adds softmax(g(0, 1), g(1, 1)) at tau = 1.
    z = rows([0.0], [0.0])
    st = velox.keyformer_init(1, 1, 1, budget=4, n_sink=0, recent=0, seed=7, backend=backend)
    st = velox.keyformer_update(st, z, z)
    e = np.exp(gumbel(7, [0, 1], [1, 1]))
    assert np.allclose(np.array(st.scores)[0, 0], [1 + e[0] / e.sum(), e[1] / e.sum()], atol=1e-6)
    # Annealing 0 -> 2 over 4 positions: tau(1) = 0.5.
    st = velox.keyformer_init(1, 1, 1, budget=4, n_sink=0, recent=0, seed=7, tau_init=0.0, tau_end=2.0,
                              anneal_steps=4, backend=backend)
    st = velox.keyformer_update(st, z, z)
    e = np.exp(0.5 * gumbel(7, [0, 1], [1, 1]))
    assert np.allclose(np.array(st.scores)[0, 0], [1 + e[0] / e.sum(), e[1] / e.sum()], atol=1e-6)
    # Zero temperature: plain attention, 1 + 1/2 and 1/2; budget 1 keeps t0.
    st = velox.keyformer_init(1, 1, 1, budget=1, n_sink=0, recent=0, tau_init=0.0, tau_end=0.0, backend=backend)
    st = velox.keyformer_update(st, z, z)
    assert pos(st) == [0] and np.allclose(np.array(st.scores), 1.5)


def test_hash_uniform_twins_and_range():
    a = np.arange(4096, dtype=np.int64)
    got = np.array(hash_uniform(11, mx.array(a.astype(np.int32)), mx.array(a[::-1].astype(np.int32))))
    want = hash_uniform_np(11, a, a[::-1])
    assert np.array_equal(got.astype(np.float64), want)             # the same bits in both
    assert 0 < want.min() and want.max() < 1 and abs(want.mean() - 0.5) < 0.02
    assert not np.array_equal(hash_uniform_np(12, a), hash_uniform_np(11, a))
    assert np.array_equal(hash_uniform_np(11, a), hash_uniform_np(11, a))


def test_keyformer_noise_does_not_depend_on_chunking():
    # Without evictions, one chunk and token by token accumulate the same noisy scores:
    # the noise is a function of (seed, key position, query position) only.
    k, v, q = stream(5, chunks=(24,), groups=2)[0]
    kw = dict(budget=64, n_sink=0, tau_init=1.0, tau_end=2.0, anneal_steps=10, decay=0.9, seed=3)
    whole = velox.keyformer_update(velox.keyformer_init(2, 2, 16, **kw), k, v, queries=q)
    step = velox.keyformer_init(2, 2, 16, **kw)
    for t in range(24):
        step = velox.keyformer_update(step, k[:, :, t:t + 1], v[:, :, t:t + 1], queries=q[:, :, t:t + 1])
    assert np.allclose(np.array(whole.scores), np.array(step.scores), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [0, 2])
def test_keyformer_zero_temperature_is_h2o(backend, groups):
    kf = velox.keyformer_init(2, 2, 16, recent=5, decay=0.9, tau_init=0.0, tau_end=0.0, seed=9,
                              backend=backend, **MATCHED)
    a, b = run_pair(kf, velox.keyformer_update,
                    velox.h2o_init(2, 2, 16, grace=5, decay=0.9, backend=backend, **MATCHED),
                    velox.h2o_update, 3, groups)
    assert np.array_equal(np.array(a.scores), np.array(b.scores))


def test_keyformer_noise_changes_the_choice():
    # The reduction above is not vacuous: with noise the kept sets differ from H2O's.
    kf = velox.keyformer_init(2, 2, 16, recent=5, decay=0.9, tau_init=2.0, tau_end=2.0, **MATCHED)
    h2o = velox.h2o_init(2, 2, 16, grace=5, decay=0.9, **MATCHED)
    for k, v, q in stream(3):
        kf, h2o = velox.keyformer_update(kf, k, v, queries=q), velox.h2o_update(h2o, k, v, queries=q)
    assert not np.array_equal(np.array(kf.positions), np.array(h2o.positions))
