"""Q-Filters, MorphKV, KVzip, CurDKV, NestedKV and RocketKV: hand-computed cases on every
backend, the reductions to TOVA as exact equalities, and each method's own properties."""

import math

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.methods import curdkv, kvzip, nestedkv, qfilters, rocketkv

BACKENDS = ["reference", "mlx"]


def rows(*vals):
    """[1, 1, s, d] from a list of per-token vectors."""
    return mx.array(np.array(vals, np.float32)[None, None])


def pos(state):
    return np.array(velox.positions(state))[0, 0].tolist()


def softmax(x):
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


# --- hand-computed cases ---------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_morphkv_by_hand(backend):
    # d = 1, keys t0..t3 = 1, 0, -1, 1 (values = keys); window 2: voters t2 and t3 (their keys
    # as queries). t2 over t0..t2: softmax(-1, 0, 1) = .0900, .2447, .6652.
    # t3 over t0..t3: softmax(1, 0, -1, 1) = .3995, .1470, .0541, .3995.
    # Sums: t0 .4895, t1 .3917, t2 .7193; t3 (newest, window - 1 = 1) is protected.
    # Budget 3, no sinks: t3, t2, t0 stay; t1 goes.
    k = rows([1.0], [0.0], [-1.0], [1.0])
    st = velox.morphkv_init(1, 1, 1, budget=3, n_sink=0, window=2, backend=backend)
    st = velox.morphkv_update(st, k[:, :, :3], k[:, :, :3])
    st = velox.morphkv_update(st, k[:, :, 3:], k[:, :, 3:])
    assert pos(st) == [0, 2, 3]
    # Max instead of sum: t0 .3995, t1 .2447, t2 .6652: the same choice.
    st = velox.morphkv_init(1, 1, 1, budget=3, n_sink=0, window=2, aggregate="max", backend=backend)
    st = velox.morphkv_update(velox.morphkv_update(st, k[:, :, :3], k[:, :, :3]), k[:, :, 3:], k[:, :, 3:])
    assert pos(st) == [0, 2, 3]
    # TOVA's rule (window 1): t3 alone votes .3995, .1470, .0541, .3995: t2 goes.
    st = velox.morphkv_init(1, 1, 1, budget=3, n_sink=0, window=1, backend=backend)
    st = velox.morphkv_update(velox.morphkv_update(st, k[:, :, :3], k[:, :, :3]), k[:, :, 3:], k[:, :, 3:])
    assert pos(st) == [0, 1, 3]
    # Real queries equal to the keys: t2's profile is stored by the first update and votes with
    # t3's, so the result is the proxy's; afterwards the state holds t3's profile over the
    # kept rows t0, t2, t3.
    st = velox.morphkv_init(1, 1, 1, budget=3, n_sink=0, window=2, backend=backend)
    st = velox.morphkv_update(st, k[:, :, :3], k[:, :, :3], queries=k[:, :, :3])
    assert np.allclose(np.array(st.profiles).ravel(), softmax([-1, 0, 1]), atol=1e-6)
    st = velox.morphkv_update(st, k[:, :, 3:], k[:, :, 3:], queries=k[:, :, 3:])
    assert pos(st) == [0, 2, 3]
    assert np.allclose(np.array(st.profiles).ravel(), softmax([1, 0, -1, 1])[[0, 2, 3]], atol=1e-6)
    # Bytes: 3 kept rows x (key, value) x 4 B + positions 12 + next_pos 4 + one profile 3 x 4 B.
    assert velox.morphkv_bytes(st) == 24 + 12 + 4 + 12


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_rocketkv_by_hand(backend):
    # Stage 1 as SnapKV: prefill keys (d = 1) 0, 1, 0, 3, 2; the window t4 (key 2) votes:
    # logits 0, 2, 0, 6, 4. Sink t0 and window t4 stay, one slot left -> t3.
    # c = 64: split 64**.56 = 10.3 and c2 = 64**.44 = 6.2.
    st = velox.rocketkv_init(1, 1, 1, budget=3, compression_ratio=64.0, page_size=2,
                             obs_window=1, n_sink=1, kernel_size=1, backend=backend)
    k = rows([0.0], [1.0], [0.0], [3.0], [2.0])
    st = velox.rocketkv_update(st, k, k)
    assert pos(st) == [0, 3, 4]
    # Pages of 2 stored slots: [0, 3] -> max 3, min 0; [2] -> max 2, min 2.
    assert np.array(st.page_max).ravel().tolist() == [3.0, 2.0]
    assert np.array(st.page_min).ravel().tolist() == [0.0, 2.0]
    # Decode key 5 joins the last page ([2, 5]: max 5, min 2); key -1 opens a third page.
    st = velox.rocketkv_update(st, rows([5.0]), rows([5.0]))
    assert np.array(st.page_max).ravel().tolist() == [3.0, 5.0]
    assert np.array(st.page_min).ravel().tolist() == [0.0, 2.0]
    assert pos(st) == [0, 3, 4, 5]
    # Stage 2 over 4 stored tokens: ceil(4 / 6.2) = 1 token -> 1 page of 2. Query +1: bounds
    # use K_max, 3 and 5 -> page 1. Query -1: K_min, -0 and -2 -> page 0.
    assert np.array(rocketkv.rocketkv_select(st, rows([1.0]))).ravel().tolist() == [1]
    assert np.array(rocketkv.rocketkv_select(st, rows([-1.0]))).ravel().tolist() == [0]
    # Attention of q = 1 (scale 1) reads page 1 (keys = values 2, 5) and the new token (0):
    # softmax(2, 5, 0) . (2, 5, 0).
    out = rocketkv.rocketkv_attend(st, rows([1.0]), rows([0.0]), rows([0.0]), scale=1.0)
    assert np.allclose(np.array(out).ravel(), softmax([2, 5, 0]) @ [2, 5, 0], atol=1e-6)
    assert rocketkv.rocketkv_read_size(st, rows([1.0])) == rocketkv.ReadSize(1, 2, 3, 4)
    st = velox.rocketkv_update(st, rows([-1.0]), rows([-1.0]))
    assert np.array(st.page_max).ravel().tolist() == [3.0, 5.0, -1.0]
    # Bytes: 5 rows x (k, v) x 4 B + positions 20 + next_pos 4 + 3 pages x (max, min) x 4 B.
    assert velox.rocketkv_bytes(st) == 40 + 20 + 4 + 24


# --- reductions to TOVA ------------------------------------------------------------------

CHUNKS = (21, 1, 1, 6, 1, 1, 13, 1, 2, 1)


def _stream(seed, heads, groups, d=16):
    rng = np.random.default_rng(seed)
    out = []
    for s in CHUNKS:
        k = rng.standard_normal((2, heads, s, d)).astype(np.float32) * 0.7
        v = rng.standard_normal((2, heads, s, d)).astype(np.float32)
        q = rng.standard_normal((2, heads * groups, s, d)).astype(np.float32) if groups else None
        out.append((mx.array(k), mx.array(v), None if q is None else mx.array(q)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [0, 1, 3])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("other", ["morphkv", "kvzip"])
def test_reduces_to_tova(other, per_head, groups, backend):
    """morphkv window=1 and kvzip probe='latest' keep exactly TOVA's tokens."""
    extra = dict(window=1) if other == "morphkv" else dict(probe="latest")
    for seed in range(2 if backend == "mlx" else 1):
        a = velox.tova_init(2, 3, 16, budget=12, n_sink=2, per_head=per_head, backend=backend)
        b = velox.init(other, 2, 3, 16, budget=12, n_sink=2, per_head=per_head, backend=backend, **extra)
        for t, (k, v, q) in enumerate(_stream(seed, 3, groups)):
            a = velox.tova_update(a, k, v, queries=q)
            b = velox.update(b, k, v, queries=q)
            assert np.array_equal(np.array(a.positions), np.array(b.positions)), f"update {t}"


# --- Q-Filters ---------------------------------------------------------------------------

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
    assert np.array_equal(np.array(one.positions), np.array(step.positions))
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


# --- MorphKV / KVzip ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_morphkv_protects_the_next_voters(backend):
    rng = np.random.default_rng(3)
    st = velox.morphkv_init(1, 2, 8, budget=10, n_sink=2, window=4, backend=backend)
    for s in (15, 1, 1, 5, 1):
        k = mx.array(rng.standard_normal((1, 2, s, 8)).astype(np.float32))
        q = mx.array(rng.standard_normal((1, 4, s, 8)).astype(np.float32))
        cand = np.concatenate([np.array(st.keys), np.array(k)], axis=2)  # [1, 2, N, 8]
        cand_pos = np.concatenate([np.array(st.positions)[0], np.array(st.next_pos)[0, :, None]
                                   + np.arange(s)], axis=-1)  # [2, N]
        st = velox.morphkv_update(st, k, k, queries=q)
        seen = int(np.array(st.next_pos)[0, 0])
        p = np.array(st.positions)
        assert (p[..., -3:] == np.arange(seen - 3, seen)).all()  # window - 1 newest stay
        prof = np.array(st.profiles)
        assert prof.shape == (1, 2, 10, 3)  # profiles of the 3 newest tokens over the kept rows
        for j in range(2):  # the newest token's profile: its 2 query heads' mean attention over
            # the candidates at this update, read at the rows that stayed
            logits = np.array(q)[0, 2 * j:2 * j + 2, -1] @ cand[0, j].T / np.sqrt(8)
            want = np.mean([softmax(row) for row in logits], axis=0)
            assert np.allclose(prof[0, j, :, -1], want[np.searchsorted(cand_pos[j], p[0, j])], atol=1e-6)
        assert np.all(prof[0, :, -1, :2] == 0)  # older voters give the newest token nothing


def test_kvzip_importance_is_a_max_over_probes():
    rng = np.random.default_rng(4)
    stored = mx.array(rng.standard_normal((1, 2, 9, 8)).astype(np.float32))
    new = mx.array(rng.standard_normal((1, 2, 3, 8)).astype(np.float32))
    probes = mx.array(rng.standard_normal((1, 2, 2, 6, 8)).astype(np.float32))
    full = np.array(kvzip.kvzip_importance(probes, stored, new))
    part = np.array(kvzip.kvzip_importance(probes[:, :, :, :4], stored, new))
    blocked = np.array(kvzip.kvzip_importance(probes, stored, new, block=2))
    assert ((full >= 0) & (full <= 1)).all()
    assert (full >= part).all()  # more probes can only raise a token's importance
    assert np.allclose(full, blocked, atol=1e-7)


# --- CurDKV -------------------------------------------------------------------------------

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
    assert np.array_equal(np.array(fresh.positions), want_pos)


# --- NestedKV -----------------------------------------------------------------------------

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


# --- RocketKV -----------------------------------------------------------------------------

def test_rocketkv_split_reproduces_the_paper():
    c1, c2 = rocketkv.split_ratio(64.0)
    assert round(c1, 1) == 10.3 and round(c2, 1) == 6.2 and math.isclose(c1 * c2, 64.0)
    assert rocketkv.split_ratio(4096.0)[0] == 4096.0 ** 0.8  # r = 0.2 + 0.72, clipped at 0.8
    st = velox.rocketkv_init(1, 1, 64, compression_ratio=64.0)
    assert (st.page_size, st.head_topk1) == (3, 31)  # ceil(sqrt(6.2)), round(64 * 3 / 6.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rocketkv_pages_incremental_equal_rebuilt(backend):
    rng = np.random.default_rng(7)
    k = mx.array(rng.standard_normal((2, 2, 23, 8)).astype(np.float32))
    st = velox.rocketkv_init(2, 2, 8, budget=64, obs_window=4, n_sink=1, page_size=3,
                             kernel_size=3, backend=backend)
    st = velox.rocketkv_update(st, k[:, :, :5], k[:, :, :5])
    for t in range(5, 23):  # decode steps update the last page or open one
        st = velox.rocketkv_update(st, k[:, :, t:t + 1], k[:, :, t:t + 1])
    hi, lo = rocketkv._pages_mlx(st.keys, 3)
    assert np.array_equal(np.array(st.page_max), np.array(hi))
    assert np.array_equal(np.array(st.page_min), np.array(lo))


def test_rocketkv_page_bound_holds_with_every_channel():
    # With all channels kept, q.K_max on q > 0 and q.K_min on q < 0 bounds q.k in the page.
    rng = np.random.default_rng(8)
    k = mx.array(rng.standard_normal((1, 1, 20, 8)).astype(np.float32))
    st = velox.rocketkv_init(1, 1, 8, budget=64, obs_window=2, n_sink=0, page_size=4,
                             head_topk1=8, kernel_size=1)
    st = velox.rocketkv_update(st, k, k)
    q = rng.standard_normal(8)
    bound = np.where(q > 0, np.array(st.page_max)[0, 0], np.array(st.page_min)[0, 0]) @ q
    dots = (np.array(k)[0, 0] @ q).reshape(5, 4)
    assert (bound[:, None] >= dots - 1e-5).all()


@pytest.mark.parametrize("groups", [1, 3])
def test_rocketkv_attend_reads_the_selected_pages(groups):
    rng = np.random.default_rng(9)
    h, d, P = 2, 8, 3
    k = mx.array(rng.standard_normal((2, h, 40, d)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, h, 40, d)).astype(np.float32))
    st = velox.rocketkv_init(2, h, d, budget=22, compression_ratio=20.0, page_size=P,
                             head_topk1=5, obs_window=4, n_sink=1, kernel_size=3)
    st = velox.rocketkv_update(st, k[:, :, :39], v[:, :, :39])
    q = mx.array(rng.standard_normal((2, h * groups, 1, d)).astype(np.float32))
    new_k, new_v = k[:, :, 39:], v[:, :, 39:]
    pages = np.array(rocketkv.rocketkv_select(st, q))
    size = rocketkv.rocketkv_read_size(st, q)
    assert pages.shape == (2, h, size.pages) and size.pages < size.total_pages == 8
    got = np.array(rocketkv.rocketkv_attend(st, q, new_k, new_v, scale=d ** -0.5))
    keys, vals = np.array(st.keys), np.array(st.values)
    for i in range(2):
        for j in range(h):  # dense attention over the selected pages' tokens + the new token
            slots = [t for p in pages[i, j] for t in range(p * P, min(p * P + P, 22))]
            kk = np.concatenate([keys[i, j, slots], np.array(new_k)[i, j]])
            vv = np.concatenate([vals[i, j, slots], np.array(new_v)[i, j]])
            for g in range(groups):
                qq = np.array(q)[i, j * groups + g, 0]
                want = softmax(kk @ qq * d ** -0.5) @ vv
                assert np.allclose(got[i, j * groups + g, 0], want, atol=1e-5)
    assert size.tokens <= size.pages * P + 1 and size.stored == 22
    # Selection from the bounds: the chosen pages have the top group-summed softmax scores.
    scores = np.array(rocketkv._page_scores(st, mx.array(np.array(q)[:, :, 0].reshape(2, h, groups, d))))
    for i in range(2):
        for j in range(h):
            assert set(pages[i, j]) == set(np.argsort(-scores[i, j], kind="stable")[:size.pages])


def test_rocketkv_attend_is_dense_when_every_page_is_read():
    rng = np.random.default_rng(10)
    k = mx.array(rng.standard_normal((1, 2, 30, 8)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 4, 30, 8)).astype(np.float32))
    st = velox.rocketkv_init(1, 2, 8, budget=16, compression_ratio=1.01, obs_window=4,
                             n_sink=1, kernel_size=3)
    st = velox.rocketkv_update(st, k[:, :, :29], k[:, :, :29], queries=q[:, :, :29])
    assert rocketkv.rocketkv_select(st, q[:, :, 29:]) is None  # c2 ~ 1: every page
    for s, mask in ((1, None), (3, "causal")):
        kk = k[:, :, 30 - s:]
        got = rocketkv.rocketkv_attend(st, q[:, :, 30 - s:], kk, kk, scale=0.3, mask=mask)
        allk = mx.concatenate([st.keys, kk], axis=2)
        want = mx.fast.scaled_dot_product_attention(q[:, :, 30 - s:], allk, allk, scale=0.3, mask=mask)
        assert np.allclose(np.array(got), np.array(want), atol=1e-5)
    # A chunk reads everything: 8 pages of 2 (ceil(sqrt(c2 ~ 1.008))), 16 stored + 3 new.
    assert rocketkv.rocketkv_read_size(st, s=3) == rocketkv.ReadSize(8, 8, 19, 16)


def test_morphkv_profiles_carry_across_proxy_and_real_query_updates():
    """Profiles are per kv head, so updates may switch between real queries (of any group
    size) and the key proxy; both backends agree on every state."""
    rng = np.random.default_rng(6)
    states = {b: velox.morphkv_init(1, 2, 8, budget=12, n_sink=1, window=4, backend=b)
              for b in ("reference", "mlx")}
    for s, groups in ((16, 2), (1, None), (1, 3), (3, None), (1, 2), (1, 1)):
        k = mx.array(rng.standard_normal((1, 2, s, 8)).astype(np.float32))
        q = None if groups is None else mx.array(rng.standard_normal((1, 2 * groups, s, 8)).astype(np.float32))
        states = {b: velox.morphkv_update(st, k, k, queries=q) for b, st in states.items()}
        ref, got = states["reference"], states["mlx"]
        assert np.array_equal(np.array(ref.positions), np.array(got.positions))
        assert np.allclose(np.array(ref.profiles), np.array(got.profiles), atol=1e-6)
        assert got.profiles.shape == (1, 2, 12, 3)
