"""PyramidKV, SqueezeAttention, ChunkKV, CaM, KNorm, Keyformer: hand-computed cases, the exact
reductions to H2O / SnapKV, and the cross-layer hooks driven layer by layer without the adapter."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import velox
import velox.testing as vt
from velox.crosslayer import round_to_total
from velox.methods.keyformer import hash_uniform, hash_uniform_np
from velox.methods.pyramidkv import pyramid_budgets
from velox.methods.squeeze import concentration, squeeze_budgets
from velox.registry import get_method

BACKENDS = ["reference", "mlx"]


def rows(*vals):
    """[1, 1, s, d] from a list of per-token vectors."""
    return mx.array(np.array(vals, np.float32)[None, None])


def pos(state, i=0, j=0):
    return np.array(velox.positions(state))[i, j].tolist()


def stream(seed, *, chunks=(37, 1, 1, 9, 1, 1, 20, 1, 1), b=2, h=2, d=16, groups=0):
    """Random keys (std 0.5), values and optional GQA queries for a prefill + decode sequence."""
    rng = np.random.default_rng(seed)
    out = []
    for s in chunks:
        k = mx.array(0.5 * rng.standard_normal((b, h, s, d)).astype(np.float32))
        v = mx.array(rng.standard_normal((b, h, s, d)).astype(np.float32))
        q = mx.array(rng.standard_normal((b, h * groups, s, d)).astype(np.float32)) if groups else None
        out.append((k, v, q))
    return out


def assert_same_rows(a, b):
    assert np.array_equal(np.array(velox.positions(a)), np.array(velox.positions(b)))
    for x, y in zip(velox.get_kv(a), velox.get_kv(b)):
        assert mx.array_equal(x, y).item()


# --- hand-computed cases ------------------------------------------------------------------

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


def test_pyramid_budgets_by_hand():
    # 4 layers, average 10, 2 reserved (sinks + window): free 8, top 8/2 = 4, bottom 16 - 4 = 12,
    # step 8/3: shares 12, 9.33, 6.67, 4 (sum 32). Floors 12, 9, 6, 4 (31); the one unit left
    # goes to the largest fraction (.67, layer 2): 12, 9, 7, 4; plus 2 reserved each.
    assert pyramid_budgets(4, 10, 2.0, reserved=2) == [14, 11, 9, 6]
    assert pyramid_budgets(4, 10, 1.0, reserved=2) == [10, 10, 10, 10]   # beta 1: flat
    assert pyramid_budgets(1, 10, 5.0) == [10]
    assert round_to_total([2.5, 2.5, 1.0], 6) == [3, 2, 1]               # ties: earlier entry


@pytest.mark.parametrize("backend", BACKENDS)
def test_pyramidkv_by_hand(backend):
    # Within a layer the rule is SnapKV's: prompt keys (d=1) 0, 1, 0, 3, 2, window = t4 (its
    # key 2 is the proxy query): logits 0, 2, 0, 6, 4; sink t0 and window t4 kept, t3 wins the
    # last slot. A decode token is appended.
    st = velox.pyramidkv_init(1, 1, 1, budget=3, obs_window=1, n_sink=1, kernel_size=1, backend=backend)
    k = rows([0.0], [1.0], [0.0], [3.0], [2.0])
    st = velox.pyramidkv_update(st, k, k)
    assert pos(st) == [0, 3, 4]
    assert pos(velox.pyramidkv_update(st, rows([5.0]), rows([5.0]))) == [0, 3, 4, 5]


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


def test_squeeze_concentration_and_budgets_by_hand():
    same = mx.broadcast_to(mx.array([1.0, 2.0]), (1, 1, 3, 2))
    assert np.allclose(np.array(concentration(same)), 1.0)                    # identical: 1
    assert np.allclose(np.array(concentration(rows([1, 0], [0, 3]))), 0.0)   # orthogonal: 0
    assert np.allclose(np.array(concentration(rows([1, 1], [3, 0]))),        # scale-invariant
                       np.array(concentration(rows([2, 2], [1, 0]))))
    assert np.array(concentration(rows([1, 1]))).tolist() == [[0.0]]          # one key: 0
    # c = .5, 0, 1 -> importance 1 - c = .5, 1, 0, mean .5 -> w = 1, 2, 0. Average 10,
    # strength 1: shares 10, 20, 0; floor 3 lifts the last to 3 and takes its 3 from the
    # excess over the floor (7, 17) pro rata: 3 + 21 * 7/24 = 9.125, 3 + 21 * 17/24 = 17.875
    # -> 9, 17, 3 (29); the unit left goes to the larger fraction: 9, 18, 3.
    assert squeeze_budgets([0.5, 0.0, 1.0], 10, 1.0, floor=3) == [9, 18, 3]
    assert squeeze_budgets([0.5, 0.0, 1.0], 10, 0.5, floor=3) == [10, 15, 5]   # 10 (.5 + .5 w)
    assert squeeze_budgets([0.5, 0.0, 1.0], 10, 0.0, floor=3) == [10, 10, 10]


@pytest.mark.parametrize("backend", BACKENDS)
def test_squeeze_reallocation_by_hand(backend):
    # Two layers, average budget 10, floor n_sink + grace + 1 = 2. The first forward's keys are
    # identical in layer 0 (c = 1) and the basis vectors e1..e4 three times in layer 1:
    # |sum u|^2 = 36, c = (36 - 12) / (12 * 11) = 2/11. Importance 0, 9/11 -> w = 0, 2,
    # shares 0, 20; the floor lifts layer 0 to 2, layer 1 keeps 20 - 2 = 18.
    m = get_method("squeeze")
    params = dict(budget=10, n_sink=1, grace=0, decay=1.0, strength=1.0)
    record = m.model_init([params, params])
    states = [velox.squeeze_init(1, 1, 4, backend=backend, **params) for _ in range(2)]
    prompt = [mx.broadcast_to(mx.array([1.0, 0, 0, 0]), (1, 1, 12, 4)),
              mx.array(np.tile(np.eye(4, dtype=np.float32), (3, 1))[None, None])]
    for layer in range(2):
        x = prompt[layer]
        record, states[layer] = m.layer_update(record, layer, states[layer], x, x)
    assert np.allclose(np.array(record.concentration), [1, 2 / 11], atol=1e-6)
    assert record.resolved and tuple(record.budgets) == (2, 18)
    assert [len(pos(s)) for s in states] == [10, 10]        # the first forward used the average
    for layer in range(2):                                  # the next forward adopts them
        record, states[layer] = m.layer_update(record, layer, states[layer], prompt[layer][:, :, :3],
                                               prompt[layer][:, :, :3])
    assert [s.budget for s in states] == [2, 18] and [len(pos(s)) for s in states] == [2, 13]


# --- exact reductions -------------------------------------------------------------------------

MATCHED = dict(budget=24, n_sink=3)


def run_pair(a_init, a_update, b_init, b_update, seed, groups):
    for k, v, q in stream(seed, groups=groups):
        a_init, b_init = a_update(a_init, k, v, queries=q), b_update(b_init, k, v, queries=q)
        assert_same_rows(a_init, b_init)
    return a_init, b_init


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [0, 2])
def test_chunk_size_one_is_h2o(backend, groups):
    kw = dict(MATCHED, grace=5, decay=0.9, backend=backend)
    a, b = run_pair(velox.chunkkv_init(2, 2, 16, chunk_size=1, **kw), velox.chunkkv_update,
                    velox.h2o_init(2, 2, 16, **kw), velox.h2o_update, 1, groups)
    assert np.array_equal(np.array(a.scores), np.array(b.scores))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [0, 2])
def test_cam_drop_is_h2o(backend, groups):
    kw = dict(MATCHED, grace=5, decay=0.9, backend=backend)
    run_pair(velox.cam_init(2, 2, 16, merge="drop", **kw), velox.cam_update,
             velox.h2o_init(2, 2, 16, **kw), velox.h2o_update, 2, groups)


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_squeeze_strength_zero_is_h2o_in_every_layer(backend):
    m = get_method("squeeze")
    params = dict(MATCHED, grace=5, decay=0.9, strength=0.0)
    n_layers = 3
    record = m.model_init([params] * n_layers)
    sq = [velox.squeeze_init(2, 2, 16, backend=backend, **params) for _ in range(n_layers)]
    h2o = [velox.h2o_init(2, 2, 16, grace=5, decay=0.9, backend=backend, **MATCHED)
           for _ in range(n_layers)]
    for k, v, q in stream(4, groups=2):
        for layer in range(n_layers):
            lk, lv = k * (layer + 1), v - layer   # a different geometry per layer
            record, sq[layer] = m.layer_update(record, layer, sq[layer], lk, lv, queries=q)
            h2o[layer] = velox.h2o_update(h2o[layer], lk, lv, queries=q)
            assert_same_rows(sq[layer], h2o[layer])
    assert record.resolved and tuple(record.budgets) == (24, 24, 24)


def test_pyramidkv_layer_is_snapkv():
    for k, v, q in [stream(6, chunks=(40, 1, 25, 1), groups=g)[0] for g in (0, 2)]:
        kw = dict(budget=30, obs_window=6, n_sink=2, kernel_size=3, pooling="maxpool")
        a = velox.pyramidkv_update(velox.pyramidkv_init(2, 2, 16, beta=7.0, **kw), k, v, queries=q)
        b = velox.snapkv_update(velox.snapkv_init(2, 2, 16, **kw), k, v, queries=q)
        assert_same_rows(a, b)


# --- cross-layer hooks, driven layer by layer --------------------------------------------------

@pytest.mark.parametrize("n_layers,budget,beta",
                         [(30, 512, 2.0), (7, 40, 20.0), (5, 13, 1.5), (2, 50, 1.0)])
def test_pyramidkv_schedule(n_layers, budget, beta):
    params = dict(budget=budget, obs_window=8, n_sink=4, beta=beta)
    per_layer = get_method("pyramidkv").per_layer_params(n_layers, params)
    budgets = [p["budget"] for p in per_layer]
    assert sum(budgets) == n_layers * budget                            # exact
    assert all(x >= y for x, y in zip(budgets, budgets[1:]))            # non-increasing
    assert all(x > 4 + 8 for x in budgets)                               # each layer valid
    assert all(p["beta"] == beta and p["obs_window"] == 8 for p in per_layer)
    steeper = pyramid_budgets(n_layers, budget, beta + 1.0, reserved=12)
    assert steeper[0] - steeper[-1] >= budgets[0] - budgets[-1]          # larger beta, wider spread


def test_pyramidkv_layers_keep_their_budgets():
    m = get_method("pyramidkv")
    per_layer = m.per_layer_params(4, dict(budget=20, obs_window=4, n_sink=2, beta=3.0))
    states = [velox.pyramidkv_init(2, 2, 16, **p) for p in per_layer]
    for k, v, q in stream(7, chunks=(30, 12, 1, 1)):
        states = [velox.pyramidkv_update(s, k, v, queries=q) for s in states]
    kept = [len(pos(s)) for s in states]
    budgets = [p["budget"] for p in per_layer]
    assert kept == [b + 2 for b in budgets]                  # cut after the chunks, then 2 decodes
    assert sum(budgets) == 4 * 20


@pytest.mark.parametrize("backend", BACKENDS)
def test_squeeze_budgets_sum_to_the_total(backend):
    m = get_method("squeeze")
    params = dict(budget=20, n_sink=2, grace=3, decay=0.95, strength=1.0)
    n_layers = 4
    record = m.model_init([params] * n_layers)
    states = [velox.squeeze_init(1, 2, 8, backend=backend, **params) for _ in range(n_layers)]
    rng = np.random.default_rng(8)
    direction = rng.standard_normal(8).astype(np.float32)
    held = [0] * n_layers
    for s in (30, 10, 1, 1, 1):
        budgets = record.budgets  # in force for this forward
        for layer in range(n_layers):  # layer l's keys share a direction with weight l
            x = rng.standard_normal((1, 2, s, 8)).astype(np.float32) + layer * direction
            x = mx.array(x)
            record, states[layer] = m.layer_update(record, layer, states[layer], x, x)
        held = [min(b, n + s) for b, n in zip(budgets, held)]
        assert [len(pos(st)) for st in states] == held
        assert record.resolved and sum(record.budgets) == n_layers * 20
    # Concentrated layers (the shared direction dominates) give budget to diffuse ones.
    assert list(record.budgets) == sorted(record.budgets, reverse=True)
    assert record.budgets[0] > 20 > record.budgets[-1] >= 2 + 3 + 1


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


@pytest.mark.parametrize("key,shared,a,b", [("squeeze", "strength", 0.3, 0.6),
                                            ("chunkkv", "reuse_layers", 1, 2)])
def test_model_init_refuses_layers_that_disagree_on_a_model_level_parameter(key, shared, a, b):
    init = get_method(key).model_init
    with pytest.raises(ValueError, match=f"layers disagree on {shared}"):
        init([{shared: a}, {shared: b}])
    with pytest.raises(ValueError, match=f"{key} needs at least one layer"):
        init([])
    init([{shared: a}, {shared: a}])  # agreeing layers are accepted


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
