"""A²ATS: windowed RoPE, query-aware product quantization of pre-RoPE keys, retrieval attention,
calibration."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox.codecs import a2ats as ac
from velox.codecs import pq
from velox.methods import a2ats as am
from velox.registry import get_method

M = get_method("a2ats")


def rows(seed, shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def random_state(h=2, d=16, s=4, bits=4, backend="mlx", **kw):
    return M.init(1, h, d, sub_dim=s, codebook_bits=bits, codebook="random", backend=backend, **kw)


def filled(n, seed, h=2, d=16, chunks=None, **kw):
    """A random-codebook state after ``n`` tokens (in ``chunks``) and the rows it was given."""
    k, v = rows(seed, (1, h, n, d)), rows(seed + 1, (1, h, n, d))
    state = random_state(h, d, **kw)
    lo = 0
    for c in chunks or [n]:
        state = M.update(state, mx.array(k[:, :, lo:lo + c]), mx.array(v[:, :, lo:lo + c]))
        lo += c
    return state, k, v


# --- a hand-worked case -------------------------------------------------------------------------

def _hand_state(backend, aware=True, b=3):
    # d = 4, one kv head, sub_dim 2, 1 bit. RoPE f = (pi/2, 0): pair (x0, x2) turns a quarter
    # turn a position, pair (x1, x3) not at all. Codebooks: sub-space 0 {(1, 0), (0, 1)},
    # sub-space 1 {(0, 2), (2, 0)}; H_0 = diag(0.1, 1), H_1 = I.
    state = M.init(1, 1, 4, sub_dim=2, codebook_bits=1, codebook="random", window=1, b=b,
                   retrieval_fraction=0.5, use_query_aware=aware, backend=backend)
    arrays = {"codebook": np.array([[[[1, 0], [0, 1]], [[0, 2], [2, 0]]]], np.float32),
              "metric": np.array([[np.diag([0.1, 1.0]), np.eye(2)]], np.float32),
              "freqs": np.array([[np.pi / 2, 0.0]], np.float32), "b": np.array([b], np.float32)}
    return M.calibrate(state, arrays)


HAND_KEYS = [[1.0, 0.0, 0.0, 2.0],     # p = 0: pre (1, 0, 0, 2): (1, 0) -> c0, (0, 2) -> c0
             [-2.0, 1.0, 0.0, 0.0],    # p = 1: un-rotated (x0, x2) = (-2, 0) -> (0, 2): pre
                                       #   (0, 1, 2, 0): (0, 1) -> c1, (2, 0) -> c1
             [-0.6, 0.55, 0.0, 2.0]]   # p = 2: a half turn: pre (0.6, 0.55, ~0, 2); (0.6, 0.55)
#   is 0.4625 from (1, 0) and 0.5625 from (0, 1) (Euclidean: c0) but 0.3185 and 0.2385 under
#   H_0 = diag(0.1, 1) (query-aware: c1); (~0, 2) -> c0.
HAND_VALUES = np.eye(4, dtype=np.float32)[:3]


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_by_hand(backend):
    state = M.update(_hand_state(backend), mx.array([[HAND_KEYS]]), mx.array(HAND_VALUES[None, None]))
    # indices (j0, j1), bit j of the packed word: (0, 0) -> 0, (1, 1) -> 3, (1, 0) -> 1
    assert np.array(state.codes.idx[0, 0, :, 0]).tolist() == [0, 3, 1]
    euclid = M.update(_hand_state(backend, aware=False), mx.array([[HAND_KEYS]]),
                      mx.array(HAND_VALUES[None, None]))
    assert np.array(euclid.codes.idx[0, 0, :, 0]).tolist() == [0, 3, 0]
    # get_kv: the rows as given (exact)
    k, v = M.get_kv(state)
    assert np.array_equal(np.array(k[0, 0]), np.array(HAND_KEYS, np.float32))
    # a query at t = 3 with window 1: every stored token is far (3 - p >= 1). b = 3: the query
    # turns by b - t = 0. q = (1, 2, 3, 4) against the centroids (1, 0, 0, 2), (0, 1, 2, 0),
    # (0, 1, 0, 2): 9, 8, 10. ceil(0.5 * 3) = 2 retrieved: tokens 0 and 2.
    q = mx.array([[[[1.0, 2.0, 3.0, 4.0]]]])
    np.testing.assert_allclose(np.array(am.approx_scores(state, q)[0, 0, 0]),
                               [9, 8, 10], atol=1e-5)
    assert np.array(am.retrieve(state, q)[0, 0, 0]).tolist() == [0, 2]
    # b = 4: the query turns by 1: (x0, x2) = (1, 3) -> (-3, 1): q' = (-3, 2, 1, 4) -> 5, 4, 10
    s4 = M.update(_hand_state(backend, b=4), mx.array([[HAND_KEYS]]), mx.array(HAND_VALUES[None, None]))
    np.testing.assert_allclose(np.array(am.approx_scores(s4, q)[0, 0, 0]),
                               [5, 4, 10], atol=1e-5)
    # attention (scale 1) over tokens 0 and 2 and a new zero key with value e3: exact logits
    # q . k = 9 and -0.6 + 1.1 + 8 = 8.5, and 0: weights softmax(9, 8.5, 0) on e0, e2, e3;
    # token 1 (value e1) takes none.
    out = np.array(M.attend(state, q, mx.zeros((1, 1, 1, 4)), mx.array([[[[0, 0, 0, 1.0]]]]),
                            scale=1.0))[0, 0, 0]
    w = np.exp([9.0, 8.5, 0.0])
    w /= w.sum()
    np.testing.assert_allclose(out, [w[0], 0.0, w[1], w[2]], atol=1e-6)


# --- exactness --------------------------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 30), extra=st.integers(0, 5), g=st.sampled_from([1, 2]),
       seed=st.integers(0, 100))
def test_window_at_least_the_context_is_no_compression(n, extra, g, seed):
    """Every token within the window: the output is the full cache's attention over the input
    rows, to the bit."""
    state, k, v = filled(n, seed, window=n + 1 + extra)
    q, kn, vn = (mx.array(rows(seed + i, s)) for i, s in
                 ((2, (1, 2 * g, 1, 16)), (3, (1, 2, 1, 16)), (4, (1, 2, 1, 16))))
    got = M.attend(state, q, kn, vn, scale=0.25)
    want = mx.fast.scaled_dot_product_attention(
        q, mx.concatenate([mx.array(k), kn], axis=2), mx.concatenate([mx.array(v), vn], axis=2),
        scale=0.25)
    assert np.array_equal(np.array(got), np.array(want))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 40), window=st.integers(1, 20), seed=st.integers(0, 100))
def test_window_tokens_score_exactly(n, window, seed):
    """The logits of the stored tokens inside the window are (q * scale) . k of the input rows
    at their positions (t - p < window), to the bit; the far count follows the positions."""
    state, k, _ = filled(n, seed, window=window)
    q = mx.array(rows(seed + 2, (1, 4, 1, 16)))
    far = am.far_count(state)
    assert far == max(0, n + 1 - window)  # query at t = n: p <= n - window are far
    got = am.window_logits(state, q, scale=0.5)
    near = mx.array(k[:, :, far:])
    want = (q.reshape(1, 2, 2, 16) * 0.5) @ near.swapaxes(-1, -2)
    assert got.shape[-1] == n - far and np.array_equal(np.array(got), np.array(want))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(5, 40), seed=st.integers(0, 100))
def test_retrieving_every_far_token_is_dense_attention(n, seed):
    state, k, v = filled(n, seed, window=3, retrieval_fraction=1.0)
    q, kn, vn = (mx.array(rows(seed + i, s)) for i, s in
                 ((2, (1, 4, 1, 16)), (3, (1, 2, 1, 16)), (4, (1, 2, 1, 16))))
    got = M.attend(state, q, kn, vn, scale=0.25)
    want = mx.fast.scaled_dot_product_attention(
        q, mx.concatenate([mx.array(k), kn], axis=2), mx.concatenate([mx.array(v), vn], axis=2),
        scale=0.25)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def _attention_np(state, q, kn, vn, scale):
    """The retrieval attention of one decode query, written out in NumPy (float64) from the
    state's rows and codes: far tokens scored by the centroids with the query turned to b - t,
    the top ceil(f * far) (ties to the newer) read exactly with the window and the new rows."""
    k, v = (np.array(x, np.float64) for x in (state.keys, state.values))
    bsz, h, n, d = k.shape
    hq, t = q.shape[1], n + kn.shape[2] - 1
    far = max(0, min(n, t + 1 - state.window))
    cb = ac.decode_np(state.tables, state.codes)
    out = np.zeros((bsz, hq, 1, d))
    for b in range(bsz):
        for i in range(hq):
            kh = i // (hq // h)
            qi = np.array(q[b, i, 0], np.float64)
            qb = ac.rotate_np(qi[None].astype(np.float32), np.array([state.b - t]),
                              np.array(state.tables.freqs))[0].astype(np.float64)
            approx = cb[b, kh, :far].astype(np.float64) @ qb
            kk = math.ceil(state.retrieval_fraction * far - 1e-9) if far else 0
            order = sorted(range(far), key=lambda j: (approx[j], j), reverse=True)[:kk]
            keep = sorted(order) + list(range(far, n))
            rows_k = np.concatenate([k[b, kh, keep], np.array(kn[b, kh], np.float64)])
            rows_v = np.concatenate([v[b, kh, keep], np.array(vn[b, kh], np.float64)])
            lg = rows_k @ qi * scale
            w = np.exp(lg - lg.max())
            out[b, i, 0] = (w / w.sum()) @ rows_v
    return out


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 40), window=st.integers(1, 12), frac=st.floats(0.05, 1.0),
       g=st.sampled_from([1, 3]), seed=st.integers(0, 100))
def test_attention_equals_its_numpy_statement(n, window, frac, g, seed):
    state, _, _ = filled(n, seed, window=window, retrieval_fraction=frac, b=int(seed * 37))
    q, kn, vn = (mx.array(rows(seed + i, s)) for i, s in
                 ((2, (1, 2 * g, 1, 16)), (3, (1, 2, 1, 16)), (4, (1, 2, 1, 16))))
    got = np.array(M.attend(state, q, kn, vn, scale=0.25))
    np.testing.assert_allclose(got, _attention_np(state, q, kn, vn, 0.25), atol=2e-5, rtol=1e-4)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 60), window=st.integers(1, 10), frac=st.floats(0.05, 1.0),
       seed=st.integers(0, 100))
def test_retrieved_tokens_are_the_top_of_the_approximate_scores(n, window, frac, seed):
    state, _, _ = filled(n, seed, window=window, retrieval_fraction=frac)
    q = mx.array(rows(seed + 2, (1, 4, 1, 16)))
    far = am.far_count(state)
    if far == 0:
        return
    approx = np.array(am.approx_scores(state, q))
    idx = np.array(am.retrieve(state, q))
    assert idx.shape[-1] == min(far, math.ceil(frac * far - 1e-9)) >= 1
    for b, h, gi in np.ndindex(*idx.shape[:3]):
        chosen = idx[b, h, gi]
        assert (np.diff(chosen) > 0).all()
        rest = np.setdiff1d(np.arange(far), chosen)
        if rest.size:
            assert approx[b, h, gi, chosen].min() >= approx[b, h, gi, rest].max()


def test_retrieval_ranks_non_finite_scores_lowest():
    state, _, _ = filled(20, 3, window=2, retrieval_fraction=0.5)
    q = mx.array(rows(5, (1, 4, 1, 16)))
    q = mx.where(mx.arange(16) == 0, mx.array(np.nan), q)  # every approximate score NaN
    idx = np.array(am.retrieve(state, q))
    # all ranked -inf: ties to the newer tokens
    far = am.far_count(state)
    k = math.ceil(0.5 * far)
    assert (idx == np.arange(far - k, far)).all()


# --- storage ----------------------------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(chunks=st.lists(st.integers(1, 9), min_size=1, max_size=5), seed=st.integers(0, 100),
       backend=st.sampled_from(["mlx", "reference"]))
def test_no_token_is_dropped(chunks, seed, backend):
    n = sum(chunks)
    state, k, v = filled(n, seed, chunks=chunks, window=3, backend=backend)
    gk, gv = M.get_kv(state)
    assert np.array_equal(np.array(gk), k) and np.array_equal(np.array(gv), v)
    assert np.array(M.positions(state)).tolist() == [[list(range(n))] * 2]
    assert state.codes.idx.shape[2] == n and np.array(state.next_pos).tolist() == [[n, n]]


@settings(max_examples=15, deadline=None)
@given(s=st.sampled_from([1, 2, 4, 8]), bits=st.integers(1, 8), seed=st.integers(0, 100))
def test_bits_and_bytes(s, bits, seed):
    """bits / sub_dim bits an element of key codes, indices below 2^bits (nothing past them in
    the words), and nbytes: exact rows + packed words + tables + next_pos."""
    d, n = 16, 7
    state, _, _ = filled(n, seed, d=d, s=s, bits=bits)
    j = d // s
    words = pq.words(j, bits)
    assert state.codes.idx.shape == (1, 2, n, words)
    assert j * bits / d == bits / s
    idx = ac.indices(state.tables, state.codes)
    assert int(mx.max(idx).item()) < 2 ** bits
    assert np.array_equal(np.array(pq.pack(idx, bits)), np.array(state.codes.idx))
    tables = sum(x.nbytes for x in state.tables if isinstance(x, mx.array))
    assert M.nbytes(state) == 2 * (2 * n * d * 4) + 2 * n * words * 4 + tables + 2 * 4  # next_pos


def test_bytes_a_token_at_the_defaults():
    """head_dim 64 in float16 at the defaults: 8 bytes of codes (1 bit an element of the key)
    and 256 of exact rows a token and kv head, 264 against the full cache's 256."""
    a = M.init(1, 1, 64, dtype=mx.float16, codebook="random")
    b = M.update(a, mx.zeros((1, 1, 10, 64), mx.float16), mx.zeros((1, 1, 10, 64), mx.float16))
    assert (M.nbytes(b) - M.nbytes(a)) / 10 == 264
    assert b.codes.idx.shape[-1] * 32 / 64 == 1.0


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 100))
def test_backends_give_the_same_codes(seed):
    """The reference (NumPy) and mlx backends: the same codes, but where a sub-vector lies
    within float32 rounding of two equally near centroids (at most 2% of the rows)."""
    a, _, _ = filled(40, seed, chunks=[30, 1, 9], bits=6)
    b, _, _ = filled(40, seed, chunks=[30, 1, 9], bits=6, backend="reference")
    differ = (np.array(a.codes.idx) != np.array(b.codes.idx)).any(axis=-1)
    assert differ.mean() <= 0.02


# --- the assignment ---------------------------------------------------------------------------

def _pre(state, k):
    n = k.shape[2]
    return ac.rotate_np(k, -np.broadcast_to(np.arange(n), k.shape[:3]), np.array(state.tables.freqs))


def _brute(pre, cb, metric=None):
    """Nearest centroid of each sub-vector by brute force (float64): [b, h, n, J]."""
    bsz, h, n, d = pre.shape
    hc, j, kk, s = cb.shape
    x = pre.reshape(bsz, h, n, j, s).astype(np.float64)
    out = np.zeros((bsz, h, n, j), np.int64)
    for idx in np.ndindex(bsz, h, n, j):
        c = cb[0 if hc == 1 else idx[1], idx[3]].astype(np.float64)
        diff = x[idx] - c
        m = np.eye(s) if metric is None else metric[0 if metric.shape[0] == 1 else idx[1], idx[3]]
        out[idx] = np.argmin(np.einsum("ks,sr,kr->k", diff, m, diff))
    return out


def _installed(aware, metric, seed, h=2, d=16, s=4, bits=4):
    state = random_state(h, d, s, bits, use_query_aware=aware)
    j = d // s
    return M.calibrate(state, {"codebook": rows(seed, (h, j, 1 << bits, s)), "metric": metric,
                               "freqs": np.tile(ac.inverse_frequencies(d, 500.0), (h, 1)),
                               "b": np.full(h, 2048.0, np.float32)})


def _psd(seed, h, j, s):
    a = rows(seed, (h, j, s, s))
    return (a @ np.swapaxes(a, -1, -2) + 0.01 * np.eye(s)).astype(np.float32)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 100))
def test_euclidean_and_query_aware_assignments(seed):
    """use_query_aware=False: the Euclidean nearest centroid; True: the nearest under H (brute
    force); H = I: the two are the same codes."""
    h, d, s = 2, 16, 4
    k = rows(seed + 5, (1, h, 12, d))
    metric = _psd(seed, h, d // s, s)
    for aware in (False, True):
        st_ = M.update(_installed(aware, metric, seed), mx.array(k), mx.array(k))
        cb = np.array(st_.tables.codebook).astype(np.float32)
        want = _brute(_pre(st_, k), cb, metric if aware else None)
        got = np.array(ac.indices(st_.tables, st_.codes))
        assert (got == want).mean() >= 0.99  # float32 rounding at near-ties only
    eye = np.broadcast_to(np.eye(s, dtype=np.float32), metric.shape).copy()
    a = M.update(_installed(True, eye, seed), mx.array(k), mx.array(k))
    b = M.update(_installed(False, eye, seed), mx.array(k), mx.array(k))
    assert np.array_equal(np.array(a.codes.idx), np.array(b.codes.idx))


def test_h_is_checked_symmetric_psd_and_shaped():
    cb = rows(0, (1, 4, 16, 4))
    good = _psd(1, 1, 4, 4)
    ac.tables_from_arrays(16, 4, 4, cb, good)
    bad = good.copy()
    bad[0, 0, 0, 1] += 1.0
    with pytest.raises(ValueError, match="symmetric"):
        ac.tables_from_arrays(16, 4, 4, cb, bad)
    neg = good - 100 * np.eye(4, dtype=np.float32)
    with pytest.raises(ValueError, match="positive semi-definite"):
        ac.tables_from_arrays(16, 4, 4, cb, neg)
    with pytest.raises(ValueError, match=r"\[kv_heads, 4, 4, 4\]"):
        ac.tables_from_arrays(16, 4, 4, cb, good[:, :, :3, :3])
    with pytest.raises(ValueError, match="non-finite"):
        ac.tables_from_arrays(16, 4, 4, cb, np.full_like(good, np.nan))


@pytest.mark.parametrize("head_dim, sub_dim", [(15, 5), (16, 3), (12, 8)])
def test_invalid_head_dim_raises(head_dim, sub_dim):
    with pytest.raises(ValueError, match="head_dim"):
        M.init(1, 1, head_dim, sub_dim=sub_dim, codebook="random")


# --- RoPE ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("base", [10000.0, 100000.0])
def test_rope_frequencies_of_a_model_rope_and_unrotation(base):
    d = 32
    rope = nn.RoPE(d, traditional=False, base=base)
    f = ac.rope_frequencies(rope, d)
    np.testing.assert_allclose(f, ac.inverse_frequencies(d, base), rtol=1e-5, atol=1e-7)
    # a post-RoPE key at position p un-rotated by p is the pre-RoPE key
    x = rows(0, (1, 1, 50, d))
    post = rope(mx.array(x), offset=0)
    pre = ac.rotate(post, -mx.arange(50)[None, None], mx.array(f))
    np.testing.assert_allclose(np.array(pre), x, atol=2e-4)


def test_interleaved_rope_is_refused():
    with pytest.raises(ValueError, match="rotate-half"):
        ac.rope_frequencies(nn.RoPE(16, traditional=True), 16)


def test_llama3_scaling_matches_mlx_lm():
    from mlx_lm.models.rope_utils import initialize_rope
    rope = initialize_rope(64, 500000.0, False, {"rope_type": "llama3", "factor": 32.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192}, 131072)
    np.testing.assert_allclose(ac.rope_frequencies(rope, 64),
                               ac.inverse_frequencies(64, 500000.0, "llama3.2"), rtol=1e-4, atol=1e-8)


# --- calibration --------------------------------------------------------------------------------

def test_fit_on_synthetic_queries_minimises_the_score_error():
    """fit_a2ats: shapes, H symmetric PSD, and per sub-space the H-assigned centroid's squared
    score error over the calibration queries is never above the Euclidean one's."""
    from velox.adapters.artifacts import fit_a2ats
    t, h, g, d, s, bits = 300, 2, 2, 16, 4, 3
    rope = nn.RoPE(d, base=1000.0)
    pre_k = rows(0, (h, t, d))
    pre_q = rows(1, (h * g, t, d)) * np.linspace(0.1, 3, d, dtype=np.float32)
    k = np.array(rope(mx.array(pre_k)[None]))[0].transpose(1, 0, 2)
    q = np.array(rope(mx.array(pre_q)[None]))[0].transpose(1, 0, 2)
    out = fit_a2ats(k, {"sub_dim": s, "codebook_bits": bits, "b": 100, "iters": 4},
                    queries=q, rope=rope)
    j = d // s
    assert out["codebook"].shape == (h, j, 1 << bits, s) and out["metric"].shape == (h, j, s, s)
    assert out["freqs"].shape == (h, d // 2) and (out["b"] == 100).all()
    ac.tables_from_arrays(d, s, bits, out["codebook"], out["metric"])  # symmetric PSD, checked
    qb = ac.rotate_np(q, np.broadcast_to(100 - np.arange(t)[:, None], q.shape[:2]), out["freqs"][0])
    for i in range(h):
        x = pre_k[i][None, None]
        cb = out["codebook"][i:i + 1].astype(np.float32)
        aware = _brute(x, cb, out["metric"][i:i + 1])[0, 0]
        euclid = _brute(x, cb)[0, 0]
        qs = qb[:, i * g:(i + 1) * g].reshape(-1, j, s).astype(np.float64)
        for jj in range(j):
            err = lambda idx: ((qs[:, jj] @ (x[0, 0, :, jj * s:(jj + 1) * s] - cb[0, jj, idx]).T) ** 2).mean(0)  # noqa: E731
            assert (err(aware[:, jj]) <= err(euclid[:, jj]) + 1e-6).all()


def test_shipped_calibration_is_the_default_for_the_embedded_model_only():
    a = M.init(1, 3, 64, layer=0)
    assert a.tables.calibrated and a.tables.codebook.shape == (3, 8, 256, 8)
    a2 = M.init(1, 3, 64, layer=0)
    assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.tables[:3], a2.tables[:3]))
    M.update(a, mx.zeros((1, 3, 2, 64)), mx.zeros((1, 3, 2, 64)))
    assert [p["layer"] for p in M.per_layer_params(30, {})] == list(range(30))
    assert {p["layer"] for p in M.per_layer_params(12, {})} == {-1}
    for other in (M.init(1, 2, 64, layer=0), M.init(1, 3, 64), M.init(1, 3, 64, layer=0, b=100)):
        with pytest.raises(ValueError, match="velox calibrate --method a2ats"):
            M.update(other, mx.zeros((1, other.keys.shape[1], 1, 64)),
                     mx.zeros((1, other.keys.shape[1], 1, 64)))


def test_calibration_of_another_b_or_shape_is_refused():
    state = random_state(b=2048)
    good = {"codebook": rows(0, (2, 4, 16, 4)), "metric": _psd(1, 2, 4, 4),
            "freqs": np.ones((2, 8), np.float32), "b": np.full(2, 2048.0, np.float32)}
    M.calibrate(state, good)
    with pytest.raises(ValueError, match="b=1024"):
        M.calibrate(state, dict(good, b=np.full(2, 1024.0, np.float32)))
    with pytest.raises(ValueError, match="codebook"):
        M.calibrate(state, dict(good, codebook=rows(0, (2, 4, 8, 4))))


def test_determinism_per_seed_and_artifact():
    k = mx.array(rows(0, (1, 2, 20, 16)))

    def coded(**kw):
        return M.update(random_state(**kw), k, k)
    a, b, c = coded(seed=5), coded(seed=5), coded(seed=6)
    assert np.array_equal(np.array(a.tables.codebook), np.array(b.tables.codebook))
    assert np.array_equal(np.array(a.codes.idx), np.array(b.codes.idx))
    assert not np.array_equal(np.array(a.tables.codebook), np.array(c.tables.codebook))
    # the shipped calibration: the same tables and codes at every init
    k3 = mx.array(rows(1, (1, 3, 20, 64)))
    x, y = (M.update(M.init(1, 3, 64, layer=4), k3, k3) for _ in range(2))
    assert np.array_equal(np.array(x.codes.idx), np.array(y.codes.idx))


# --- the data-free tier: codebooks fitted at the prefill -----------------------------------------

def _prefill_state(b=2, h=2, d=16, s=4, bits=5, backend="mlx", seed=3, **kw):
    return M.init(b, h, d, sub_dim=s, codebook_bits=bits, codebook="prefill", seed=seed,
                  rope_base=500.0, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_prefill_codebooks_are_kmeans_of_the_prompts_pre_rope_keys(backend):
    """Each (batch row, kv head, sub-space)'s codebook is velox.codecs.pq.kmeans run directly
    on that sub-space of the row's prompt keys, each un-rotated by its position (seed
    [seed, 2]); H = I; the frequencies are rope_base's."""
    b, h, d, s, n = 2, 2, 16, 4, 50
    k, v = rows(0, (b, h, n, d)), rows(1, (b, h, n, d))
    state = M.update(_prefill_state(b, h, d, s, backend=backend), mx.array(k), mx.array(v))
    t = state.tables
    assert t.codebook.shape == (b, h, d // s, 32, s) and t.calibrated
    np.testing.assert_array_equal(np.array(t.metric), np.broadcast_to(np.eye(s), t.metric.shape))
    np.testing.assert_array_equal(np.array(t.freqs), ac.inverse_frequencies(d, 500.0))
    pre = _pre(state, k)
    for i, j, jj in np.ndindex(b, h, d // s):
        want = np.array(pq.kmeans(pre[i, j, :, jj * s:(jj + 1) * s], 32, iters=ac.PREFILL_ITERS,
                                  seed=[3, 2]))
        np.testing.assert_allclose(np.array(t.codebook[i, j, jj]).astype(np.float32),
                                   want.astype(np.float16).astype(np.float32), rtol=1e-3, atol=1e-4)


def test_prefill_assignment_is_euclidean_frozen_and_deterministic():
    k, v = mx.array(rows(0, (2, 2, 40, 16))), mx.array(rows(1, (2, 2, 40, 16)))
    a = M.update(_prefill_state(), k[:, :, :30], v[:, :, :30])
    later = M.update(a, k[:, :, 30:], v[:, :, 30:])
    assert mx.array_equal(a.tables.codebook, later.tables.codebook).item()  # frozen
    plain = M.update(M.update(_prefill_state(use_query_aware=False), k[:, :, :30], v[:, :, :30]),
                     k[:, :, 30:], v[:, :, 30:])
    assert mx.array_equal(plain.codes.idx, later.codes.idx).item()  # H = I: Euclidean either way
    # the codes are the brute-force nearest centroids of each row's own codebooks
    pre = _pre(later, np.array(k))
    cb = np.array(later.tables.codebook).astype(np.float32)
    got = np.array(ac.indices(later.tables, later.codes))
    for i in range(2):
        want = _brute(pre[i:i + 1], cb[i])
        assert (got[i:i + 1] != want).any(-1).mean() <= 0.02
    # 30 tokens, 16 centroids: the seed draws the initial centroids (with fewer tokens than
    # centroids every sub-vector is one, whatever the seed)
    a, again, other = (M.update(_prefill_state(bits=4, seed=sd), k[:, :, :30], v[:, :, :30])
                       for sd in (3, 3, 4))
    assert mx.array_equal(a.tables.codebook, again.tables.codebook).item()
    assert not mx.array_equal(a.tables.codebook, other.tables.codebook).item()


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 100))
def test_prefill_backends_agree_and_bytes_count_the_codebooks(seed):
    b, h, d, s, bits, n = 2, 2, 16, 4, 5, 33
    k, v = mx.array(rows(seed, (b, h, n, d))), mx.array(rows(seed + 1, (b, h, n, d)))
    got = [M.update(M.update(_prefill_state(backend=be, seed=seed), k[:, :, :32], v[:, :, :32]),
                    k[:, :, 32:], v[:, :, 32:]) for be in ("mlx", "reference")]
    assert mx.array_equal(got[0].tables.codebook, got[1].tables.codebook).item()
    assert (np.array(got[0].codes.idx) != np.array(got[1].codes.idx)).any(-1).mean() <= 0.02
    assert int(mx.max(ac.indices(got[0].tables, got[0].codes)).item()) < 1 << bits
    # a float16 codebook a batch row, kv head and sub-space, counted; the fit keeps its shape
    fresh = _prefill_state(seed=seed)
    tables = sum(x.nbytes for x in got[0].tables if isinstance(x, mx.array))
    assert tables - (fresh.tables.metric.nbytes + fresh.tables.freqs.nbytes) == b * h * (d // s) * (1 << bits) * s * 2
    assert M.nbytes(got[0]) == M.nbytes(fresh) + 2 * (b * h * n * d * 4) + b * h * n * pq.words(d // s, bits) * 4


def test_prefill_runs_on_any_model_without_an_artifact(tiny_llama):
    from velox.adapters.mlxlm import make_cache

    assert {p["layer"] for p in M.per_layer_params(30, {"codebook": "prefill"})} == {-1}
    model = tiny_llama  # no shipped fit: any model runs with codebook="prefill"
    caches = make_cache(model, "a2ats", codebook="prefill", codebook_bits=4, window=2)
    model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]), cache=caches)
    out = model(mx.array([[9]]), cache=caches)
    assert np.isfinite(np.array(out)).all()
