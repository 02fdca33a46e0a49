"""ChunkKV: hand-computed cases (per head and per layer), chunk_size 1 as exactly H2O, layers
reusing their leader's positions, whole-chunk survivors and the chunk means."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.testing import by_position
from velox.registry import get_method

from tests._helpers import BACKENDS, MATCHED, assert_same_rows, pos, rows, run_pair, stream


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunkkv_by_hand(backend):
    # key_norm scores (d=1): 1, 1, 5, 0, 2, 2; chunks of 2: (t0 t1) 1, (t2 t3) 2.5, (t4 t5) 2.
    # Budget 4 keeps the two best chunks whole: t3 (norm 0) survives with its chunk.
    k = rows([1.0], [1.0], [5.0], [0.0], [2.0], [2.0])
    kw = dict(chunk_size=2, n_sink=0, grace=0, score="key_norm", backend=backend)
    assert pos(velox.chunkkv_update(velox.chunkkv_init(1, 1, 1, budget=4, **kw), k, k)) == [2, 3, 4, 5]
    # Budget 3: (t2 t3) whole, then the tie inside (t4 t5) keeps the newer, t5.
    st = velox.chunkkv_update(velox.chunkkv_init(1, 1, 1, budget=3, **kw), k, k)
    assert pos(st) == [2, 3, 5]
    assert np.array(st.scores)[0, 0].tolist() == [5, 0, 2]          # per-token norms are kept
    # Token by token (every decode step selects) ends the same here.
    st = velox.chunkkv_init(1, 1, 1, budget=3, **kw)
    for t in range(6):
        st = velox.chunkkv_update(st, k[:, :, t:t + 1], k[:, :, t:t + 1])
    assert pos(st) == [2, 3, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunkkv_layer_level_selection_by_hand(backend):
    # Head 0 norms 1, 1, 5, 0 -> chunks 1, 2.5; head 1 norms 0, 4, 0, 0 -> chunks 2, 0.
    # Per head: head 0 keeps (t2 t3), head 1 keeps (t0 t1). One selection per layer (the
    # paper) averages token scores first: .5, 2.5, 2.5, 0 -> chunks 1.5, 1.25: both keep (t0 t1).
    k = mx.array(np.array([[[1], [1], [5], [0]], [[0], [4], [0], [0]]], np.float32)[None])
    kw = dict(budget=2, chunk_size=2, n_sink=0, grace=0, score="key_norm", backend=backend)
    st = velox.chunkkv_update(velox.chunkkv_init(1, 2, 1, **kw), k, k)
    assert (pos(st, j=0), pos(st, j=1)) == ([2, 3], [0, 1])
    st = velox.chunkkv_update(velox.chunkkv_init(1, 2, 1, per_head=False, **kw), k, k)
    assert (pos(st, j=0), pos(st, j=1)) == ([0, 1], [0, 1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [0, 2])
def test_chunk_size_one_is_h2o(backend, groups):
    kw = dict(MATCHED, grace=5, decay=0.9, backend=backend)
    a, b = run_pair(velox.chunkkv_init(2, 2, 16, chunk_size=1, **kw), velox.chunkkv_update,
                    velox.h2o_init(2, 2, 16, **kw), velox.h2o_update, 1, groups)
    # ChunkKV keeps its rows sorted (contract.slots = "sorted"), H2O in slots: the same
    # tokens, and the same scores up to the order of the softmax's sums
    assert np.array_equal(np.array(velox.positions(a)), np.array(velox.positions(b)))
    np.testing.assert_allclose(np.array(a.scores), np.array(by_position(b, "scores")),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_head", [True, False])
def test_chunkkv_followers_keep_their_leaders_positions(backend, per_head):
    m = get_method("chunkkv")
    params = dict(budget=20, chunk_size=4, n_sink=2, grace=3, decay=0.9, reuse_layers=2,
                  per_head=per_head)
    n_layers = 5  # leaders 0, 2, 4; followers 1, 3
    record = m.model_init([params] * n_layers)
    states = [velox.chunkkv_init(2, 2, 16, backend=backend, **params) for _ in range(n_layers)]
    alone = [velox.chunkkv_init(2, 2, 16, backend=backend, **params) for _ in range(n_layers)]
    for step, (k, v, q) in enumerate(stream(9, chunks=(33, 9, 1, 1, 14, 1), groups=2)):
        for layer in range(n_layers):
            lk = k + 0.3 * layer * mx.sin(k * (layer + 1))      # different scores per layer
            record, states[layer] = m.layer_update(record, layer, states[layer], lk, v, queries=q)
            alone[layer] = velox.chunkkv_update(alone[layer], lk, v, queries=q)
        for layer in range(n_layers):
            leader = layer - layer % 2
            assert pos(states[layer]) == pos(states[leader]) and \
                np.array_equal(np.array(states[layer].positions), np.array(states[leader].positions))
            if layer % 2 == 0:  # a leader's own rows are what it would keep alone
                assert_same_rows(states[layer], alone[layer])
    assert not np.array_equal(np.array(states[0].positions), np.array(states[2].positions))
    with pytest.raises(ValueError, match="same tokens"):
        m.layer_update(record, 1, states[1], mx.concatenate([k, k], axis=2),
                       mx.concatenate([v, v], axis=2))


def test_chunkkv_survivors_are_whole_chunks():
    # One prefill selection: apart from the sinks and the grace window, every chunk is kept
    # whole or not at all, except one cut chunk that keeps its newest members.
    k, v, _ = stream(10, chunks=(90,))[0]
    st = velox.chunkkv_init(2, 2, 16, budget=40, chunk_size=6, n_sink=3, grace=4)
    st = velox.chunkkv_update(st, k, v)
    for row in np.array(st.positions).reshape(-1, 40):
        free = [p for p in row.tolist() if 3 <= p < 86]
        counts = {}
        for p in free:
            counts.setdefault(p // 6, []).append(p)
        members = {c: [p for p in range(6 * c, 6 * c + 6) if 3 <= p < 86] for c in counts}
        partial = [c for c, ps in counts.items() if len(ps) < len(members[c])]
        assert len(partial) <= 1
        for c in partial:
            assert counts[c] == members[c][len(members[c]) - len(counts[c]):]     # the newest


@pytest.mark.parametrize("size", [1, 3, 8])
def test_chunkkv_chunk_means_match_numpy(size):
    """Chunk means of position-sorted candidates (runs of equal ``position // size``), with
    gaps in the positions and runs cut at the row ends, equal NumPy's float64 means."""
    from velox.methods.chunkkv import _chunk_mean_mlx, _chunk_mean_reference
    rng = np.random.default_rng(size)
    scores = rng.random((2, 3, 50)).astype(np.float32) * 10 ** rng.uniform(-3, 1, (2, 3, 50))
    pos = np.stack([np.stack([np.sort(rng.choice(120, 50, replace=False)) for _ in range(3)])
                    for _ in range(2)]).astype(np.int32)
    got = np.array(mx.compile(lambda s, p: _chunk_mean_mlx(s, p, size))(mx.array(scores), mx.array(pos)))
    want = np.array([[_chunk_mean_reference(scores[i, j].astype(np.float64), pos[i, j], size)
                      for j in range(3)] for i in range(2)])
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
