"""KNorm: a hand-computed case on every backend, and one chunk equal to token by token."""

import numpy as np
import pytest

import velox

from tests._helpers import BACKENDS, assert_same_rows, pos, rows, stream


@pytest.mark.parametrize("backend", BACKENDS)
def test_knorm_by_hand(backend):
    # Norms: t0 5 (sink), t1 1, t2 2, t3 1.5, t4 2.83. Budget 3 = the sink + 2.
    k = rows([3, 4], [1, 0], [0, 2], [0, 1.5], [2, 2])
    low = velox.knorm_init(1, 1, 2, budget=3, n_sink=1, recent=0, backend=backend)
    assert pos(velox.knorm_update(low, k, k)) == [0, 1, 3]          # the two lowest: t1, t3
    high = velox.knorm_init(1, 1, 2, budget=3, n_sink=1, recent=0, keep="high", backend=backend)
    assert pos(velox.knorm_update(high, k, k)) == [0, 2, 4]         # the two highest: t4, t2
    recent = velox.knorm_init(1, 1, 2, budget=3, n_sink=1, recent=1, backend=backend)
    assert pos(velox.knorm_update(recent, k, k)) == [0, 1, 4]       # t4 protected, then t1
    # Decode t5 = [0.5, 0] (norm 0.5) onto [t0, t1, t3]: it and t1 (1) beat t3 (1.5).
    st = velox.knorm_update(velox.knorm_update(low, k, k), rows([0.5, 0]), rows([0.5, 0]))
    assert pos(st) == [0, 1, 5]
    assert np.array(velox.knorm_get_kv(st)[1])[0, 0].tolist() == [[3, 4], [1, 0], [0.5, 0]]
    assert velox.knorm_bytes(st) == 3 * 2 * 4 * 2 + 3 * 4 + 4       # keys, values, positions, next_pos


def test_knorm_one_chunk_equals_token_by_token():
    # Scores are fixed at insertion, so with recent=0 the kept set depends on the tokens only.
    k, v, _ = stream(3, chunks=(60,))[0]
    whole = velox.knorm_update(velox.knorm_init(2, 2, 16, budget=20, n_sink=2, recent=0), k, v)
    step = velox.knorm_init(2, 2, 16, budget=20, n_sink=2, recent=0)
    for t in range(60):
        step = velox.knorm_update(step, k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert_same_rows(whole, step)
