"""KVzip: a hand-computed case on every backend (context probes, probe="latest", real
reconstruction queries), and the importance as a max over probes."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.methods import kvzip

from tests._helpers import BACKENDS, pos, rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvzip_by_hand(backend):
    # d = 1, keys 1, 0, -1 as one chunk, budget 2, no sinks. Every key probes every key:
    # probe 1: softmax(1, 0, -1) = .6652, .2447, .0900; probe 0: 1/3 each;
    # probe -1: .0900, .2447, .6652. Max per token: .6652, .3333, .6652 -> keep t0, t2.
    k = rows([1.0], [0.0], [-1.0])
    st = velox.kvzip_init(1, 1, 1, budget=2, n_sink=0, backend=backend)
    assert pos(velox.kvzip_update(st, k, k)) == [0, 2]
    # probe='latest' is TOVA: the newest key (-1) alone: .0900, .2447, .6652 -> keep t1, t2.
    st = velox.kvzip_init(1, 1, 1, budget=2, n_sink=0, probe="latest", backend=backend)
    assert pos(velox.kvzip_update(st, k, k)) == [1, 2]
    # Reconstruction queries 1, 0, -2 probe the chunk; each reads every token (t0's probe
    # sees t2 too): probe 1 .6652, .2447, .0900; probe 0 1/3 each; probe -2:
    # softmax(-2, 0, 2) = .0159, .1173, .8668. Max: .6652, .3333, .8668 -> keep t0, t2.
    st = velox.kvzip_init(1, 1, 1, budget=2, n_sink=0, backend=backend)
    assert pos(velox.kvzip_update(st, k, k, queries=rows([1.0], [0.0], [-2.0]))) == [0, 2]
    # With probes 0, 0, 2 instead: .8668, .3333, .3333: t1 and t2 tie, the newer (t2) stays.
    st = velox.kvzip_init(1, 1, 1, budget=2, n_sink=0, backend=backend)
    assert pos(velox.kvzip_update(st, k, k, queries=rows([0.0], [0.0], [2.0]))) == [0, 2]


def test_kvzip_importance_is_a_max_over_probes():
    rng = np.random.default_rng(4)
    stored = mx.array(rng.standard_normal((1, 2, 9, 8)).astype(np.float32))
    new = mx.array(rng.standard_normal((1, 2, 3, 8)).astype(np.float32))
    probes = mx.array(rng.standard_normal((1, 2, 2, 6, 8)).astype(np.float32))
    full = np.array(kvzip.kvzip_importance(probes, stored, new))
    part = np.array(kvzip.kvzip_importance(probes[:, :, :, :4], stored, new))
    blocked = np.array(kvzip.kvzip_importance(probes, stored, new, block=2))
    assert ((full >= 0) & (full <= 1)).all()
    rest = np.array(kvzip.kvzip_importance(probes[:, :, :, 4:], stored, new))
    # More probes can only raise a token's importance: it is the maximum over the probes. The
    # probes' logits are one float32 matmul of 12 probe rows for all, 8 or 4 for a part, which
    # a BLAS may round differently in the last bit (OpenBLAS does), so both hold to float32
    # rounding of weights in [0, 1].
    assert (full >= part - 1e-6).all()
    assert np.allclose(full, np.maximum(part, rest), rtol=0, atol=1e-6)
    assert np.allclose(full, blocked, atol=1e-7)
