"""AnchorKV: a hand-worked prompt on both backends, every token kept, anchors exact, the
projection's invariants, stored residuals never worse, the byte budget from the arrays,
anchor positions, packing, the one-shot rule, real queries, determinism."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import velox  # noqa: F401  (loads the registry)
from velox.accounting import state_nbytes
from velox.codecs import pq
from velox.codecs.lloyd import codebook
from velox.codecs.rotation import random_rotation
from velox.methods import anchorkv as ak

BACKENDS = ["reference", "mlx"]


def _inputs(b, h, S, d, data, groups=0):
    rng = np.random.default_rng(data)
    k = (0.5 * rng.standard_normal((b, h, S, d))).astype(np.float32)
    v = rng.standard_normal((b, h, S, d)).astype(np.float32)
    q = rng.standard_normal((b, h * groups, S, d)).astype(np.float32) if groups else None
    return k, v, q


def _prompt(b, h, S, d, data, backend="mlx", groups=0, dtype=mx.float32, **params):
    k, v, q = _inputs(b, h, S, d, data, groups)
    st = ak.init(b, h, d, backend=backend, dtype=dtype, **params)
    st = ak.update(st, mx.array(k).astype(dtype), mx.array(v).astype(dtype),
                   queries=None if q is None else mx.array(q).astype(dtype))
    return st, k, v


def _flags(state, side):
    S = state.key_gamma.shape[2]
    return np.array(pq.unpack(getattr(state, f"{side}_stored"), 1, S)).astype(bool)


def _index(state, side):
    S, k = state.key_gamma.shape[2], state.anchor_positions.shape[2]
    return np.array(pq.unpack(getattr(state, f"{side}_index"), max(1, (k - 1).bit_length()), S))


prompts = st.fixed_dictionaries(dict(
    b=st.integers(1, 2), h=st.integers(1, 3), S=st.integers(2, 160),
    d=st.sampled_from([8, 16, 32, 64]), data=st.integers(0, 2 ** 16),
    theta=st.sampled_from([0.01, 0.1, 0.3, 0.6, 1.0]), window=st.integers(1, 12),
    rho=st.sampled_from([0.0, 0.5, 1.0]), anchor_frac=st.sampled_from([0.05, 0.2, 0.5]),
    residual_bits=st.sampled_from([1, 2, 3])))


def _split(p):
    dims = {n: p[n] for n in ("b", "h", "S", "d", "data")}
    return dims, {n: v for n, v in p.items() if n not in dims}


# --- a prompt worked by hand -------------------------------------------------------------------

def _hand_rows():
    # 64 tokens, d = 2. Even tokens are (t % 4 + 1) * e1, odd ones -(t % 3 + 1) * e2: each an
    # exact multiple of an anchor. Tokens 62, 63 (the window) are e1 and e2. Token 5 is
    # (0.5, -2): |cos| 0.24 with e1, 0.97 with e2 -> anchor 1 (e2), gamma -2, r = (0.5, 0).
    # Token 9 is (3, 0.25): anchor 0 (e1), gamma 3, r = (0, 0.25).
    x = np.zeros((64, 2), np.float32)
    for t in range(64):
        x[t] = [t % 4 + 1, 0] if t % 2 == 0 else [0, -(t % 3 + 1)]
    x[5], x[9], x[62], x[63] = [0.5, -2], [3, 0.25], [1, 0], [0, 1]
    return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_anchorkv_by_hand(backend):
    x = _hand_rows()
    # window 2, anchor_frac 1/64: k = max(2, round(1)) = 2 anchors, the window {62, 63};
    # index bits max(1, ceil(log2 2)) = 1.
    # Budget (one head, float32): theta = 1 of 64 * 2 * 2 * 2 = 512 B. Fixed: anchors 2 rows x 2
    # sides x 2 x 4 B = 32, positions 2 x 4 = 8, per side 64 one-bit indices in two words (8) +
    # 64 float16 gammas (128) + 64 one-bit flags in two words (8) = 144, x 2 = 288: 328 B.
    # Left 184 B; a slot is one word of 2 x 2 bits (4 B) + a float16 gain (2): 30 slots, 15 for
    # keys and 15 for values.
    lay = ak.layout(1, 64, 2, 4, theta=1.0, window=2, rho=0.7, anchor_frac=1 / 64, residual_bits=2)
    assert lay == ak.Layout(64, 2, 2, 0, 0, 1, 15, 15)
    st = ak.init(1, 1, 2, theta=1.0, window=2, anchor_frac=1 / 64, backend=backend)
    st = ak.update(st, mx.array(x[None, None]), mx.array(x[None, None]))
    assert np.array(ak.anchors(st))[0, 0].tolist() == [62, 63]
    want_idx = [0 if t % 2 == 0 else 1 for t in range(64)]
    want_gamma = [t % 4 + 1 if t % 2 == 0 else -(t % 3 + 1) for t in range(64)]
    want_idx[5], want_gamma[5], want_idx[9], want_gamma[9] = 1, -2, 0, 3
    want_gamma[62], want_gamma[63] = 1, 1
    for side in ("key", "value"):
        assert _index(st, side)[0, 0].tolist() == want_idx
        assert np.array(getattr(st, f"{side}_gamma").astype(mx.float32))[0, 0].tolist() == want_gamma
    # Residuals are nonzero for tokens 5 and 9 only, so only they have a positive utility; the
    # other 13 slots go to zero-utility ties, the newest non-anchor tokens first: 49..61.
    for side in ("key", "value"):
        assert np.flatnonzero(_flags(st, side)[0, 0]).tolist() == [5, 9] + list(range(49, 62))
    # A residual (0, c) or (c, 0) rotates to (+-c, +-c) / sqrt(2): both coordinates in the
    # outer cells, the least-squares gain c / (sqrt(2) 1.5104) puts them back; a zero residual
    # decodes to 0. Every row is exact but 5 and 9, within the float16 gain's rounding.
    for got in ak.get_kv(st):
        got = np.array(got)[0, 0]
        keep = np.ones(64, bool)
        keep[[5, 9]] = False
        assert np.array_equal(got[keep], x[keep])
        np.testing.assert_allclose(got[[5, 9]], x[[5, 9]], rtol=0, atol=2 ** -11 * 0.5 * 2)
    assert ak.nbytes(st) == 328 + 30 * 6 + 4  # and next_pos (int32)


def test_residual_codec_by_hand():
    # d = 2, 1 bit: centroids +-sqrt(2/pi), boundary 0. R = H diag(s) / sqrt(2). The residual
    # (3, 1) rotates to y = R r; each coordinate's cell is its sign; the least-squares gain of
    # the centroids puts each at the mean |y|: y' = sign(y) (|y_1| + |y_2|) / 2, r^ = R^T y'.
    r = np.array([[3.0, 1.0]], np.float32)
    rot = random_rotation(2, 7)
    y = rot @ r[0]
    want = rot.T @ (np.sign(y) * np.abs(y).mean())
    c, _ = codebook("gaussian", 1)
    assert c[-1] == pytest.approx(math.sqrt(2 / math.pi), rel=1e-6)
    for enc, dec, arr in ((ak.encode_residuals, ak.decode_residuals, mx.array),
                          (ak.encode_residuals_np, ak.decode_residuals_np, np.asarray)):
        codes, gain = enc(arr(r[None]), 7, 1)
        assert float(np.array(gain)[0, 0]) == pytest.approx(np.abs(y).mean() / c[-1], rel=2 ** -11)
        np.testing.assert_allclose(np.array(dec(codes, gain, 2, 7, 1))[0, 0], want, rtol=0, atol=3 * 2 ** -10)


# --- invariants ------------------------------------------------------------------------------

@given(p=prompts)
def test_no_token_is_dropped(p):
    dims, params = _split(p)
    st, k, v = _prompt(**dims, **params)
    b, h, S, d = k.shape
    rng = np.random.default_rng(dims["data"] + 1)
    ks, vs = [k], [v]
    for s in (1, 1, 3):  # decode steps, then a chunk: all appended exact
        nk, nv = (rng.standard_normal((b, h, s, d)).astype(np.float32) for _ in range(2))
        st = ak.update(st, mx.array(nk), mx.array(nv))
        ks.append(nk)
        vs.append(nv)
    n = S + 5
    assert np.array(ak.positions(st)).tolist() == [[list(range(n))] * h] * b
    assert np.array(st.next_pos).tolist() == [[n] * h] * b
    gk, gv = (np.array(a) for a in ak.get_kv(st))
    assert gk.shape == gv.shape == (b, h, n, d)
    assert np.array_equal(gk[:, :, S:], np.concatenate(ks[1:], 2))
    assert np.array_equal(gv[:, :, S:], np.concatenate(vs[1:], 2))


@given(p=prompts)
def test_anchors_are_exact_and_positioned(p):
    dims, params = _split(p)
    st, k, v = _prompt(**dims, **params)
    b, h, S, d = k.shape
    lay = ak.layout(h, S, d, 4, **params)
    ap = np.array(ak.anchors(st))
    assert ap.shape == (b, h, lay.anchors) == (b, h, min(S, max(params["window"], math.floor(
        params["anchor_frac"] * S + 0.5))))
    gk, gv = (np.array(a) for a in ak.get_kv(st))
    for i in range(b):
        for j in range(h):
            row = ap[i, j]
            assert (np.diff(row) > 0).all() and row.min() >= 0 and row.max() < S
            assert set(range(S - min(params["window"], S), S)) <= set(row.tolist())
            assert np.array_equal(gk[i, j, row], k[i, j, row]) and np.array_equal(gv[i, j, row], v[i, j, row])
            for side in ("key", "value"):
                assert _index(st, side)[i, j, row].tolist() == list(range(len(row)))
                assert (np.array(getattr(st, f"{side}_gamma"))[i, j, row] == 1).all()
                assert not _flags(st, side)[i, j, row].any()


@given(p=prompts)
def test_projection_invariants(p):
    dims, params = _split(p)
    k, v, _ = _inputs(**dims)
    b, h, S, d = k.shape
    st = _prompt(**dims, **params)[0]
    ap = np.array(ak.anchors(st))
    rank = np.zeros((b, h, S), bool)
    np.put_along_axis(rank, ap, True, axis=-1)
    for x in (k, v):
        idx, gamma, r = (np.array(a) for a in ak.project(mx.array(x), mx.array(ap), mx.array(rank)))
        g = gamma.astype(np.float64)
        for i in range(b):
            for j in range(h):
                a = x[i, j, ap[i, j]].astype(np.float64)
                ridx, rgamma, rr = ak.project_np(x[i, j], ap[i, j])
                assert np.array_equal(ridx, idx[i, j])
                # gamma in float16: a float32 quotient on a rounding boundary (another BLAS's
                # dot) may round to the neighbouring float16, one ulp, and move r with it
                g16, rg16 = gamma[i, j].astype(np.float32), rgamma.astype(np.float32)
                same = g16 == rg16
                assert (np.abs(g16 - rg16) <= 2.0 ** -10 * np.abs(rg16) + 2.0 ** -24).all()
                assert same.mean() >= 0.99
                np.testing.assert_allclose(rr[same], r[i, j][same], atol=1e-6)
                chosen = a[idx[i, j]]
                # x = gamma a + r, to float32 rounding
                recon = g[i, j, :, None] * chosen + r[i, j]
                assert np.abs(recon - x[i, j]).max() <= 1e-6 * (1 + np.abs(x[i, j]).max())
                # <r, a> = (gamma* - gamma16) |a|^2: zero but for gamma's float16 rounding
                exact = (x[i, j] * chosen).sum(-1) / (chosen * chosen).sum(-1)
                dot = (r[i, j] * chosen).sum(-1)
                bound = (2 ** -11 * np.abs(exact) + 1e-6) * (chosen * chosen).sum(-1) + 1e-5
                assert (np.abs(dot) <= bound).all()
                # the anchor is the one of largest |cos|
                cos = np.abs(x[i, j] @ a.T) / np.outer(np.linalg.norm(x[i, j], axis=-1),
                                                       np.linalg.norm(a, axis=-1))
                best = cos.max(axis=-1)
                picked = cos[np.arange(S), idx[i, j]]
                free = ~rank[i, j]
                assert (picked[free] >= best[free] - 1e-6).all()


@given(p=prompts)
def test_stored_residuals_never_increase_the_error(p):
    dims, params = _split(p)
    st, k, v = _prompt(**dims, **params)
    b, h, S, d = k.shape
    ap = np.array(ak.anchors(st))
    for x, got, side in ((k, ak.get_kv(st)[0], "key"), (v, ak.get_kv(st)[1], "value")):
        got = np.array(got)[:, :, :S]
        idx, gamma = _index(st, side), np.array(getattr(st, f"{side}_gamma").astype(mx.float32))
        a = np.take_along_axis(x, ap[..., None], axis=2)
        base = gamma[..., None] * np.take_along_axis(a, idx[..., None], axis=2)
        stored = _flags(st, side)
        assert (stored.reshape(b, -1).sum(-1) == getattr(st, f"{side}_codes").shape[1]).all()
        e_with = np.linalg.norm(got - x, axis=-1)
        e_without = np.linalg.norm(base - x, axis=-1)
        tol = 1e-5 * (1 + np.linalg.norm(x, axis=-1))
        assert (e_with[stored] <= e_without[stored] + tol[stored]).all()
        free = ~stored
        np.put_along_axis(free, ap, False, axis=-1)
        assert np.allclose(got[free], base[free], atol=1e-6)


@given(rows=st.integers(1, 40), d=st.sampled_from([8, 32, 64]), bits=st.integers(1, 4),
       seed=st.integers(0, 1000), scale=st.sampled_from([1e-3, 1.0, 100.0]))
def test_residual_codec_round_trip(rows, d, bits, seed, scale):
    rng = np.random.default_rng(seed)
    r = (scale * rng.standard_normal((1, rows, d))).astype(np.float32)
    r[0, 0] = 0.0  # a zero residual decodes to 0
    codes, gain = ak.encode_residuals(mx.array(r), seed, bits)
    assert codes.shape == (1, rows, pq.words(d, bits)) and codes.dtype == mx.uint32
    assert gain.dtype == mx.float16 and (np.array(gain) >= 0).all()
    # the packing is an exact inverse of the cells
    cells = np.array(pq.unpack(codes, bits, d))
    assert cells.max() < 2 ** bits and np.array_equal(np.array(pq.pack(mx.array(cells), bits)), np.array(codes))
    got = np.array(ak.decode_residuals(codes, gain, d, seed, bits))
    err = np.linalg.norm(got - r, axis=-1)
    assert (err <= np.linalg.norm(r, axis=-1) * (1 + 1e-5) + 1e-7).all()
    assert np.array_equal(got[0, 0], np.zeros(d, np.float32))
    ncodes, ngain = ak.encode_residuals_np(r, seed, bits)
    same = (ncodes == np.array(codes)).all(-1)
    assert same.mean() >= 0.9  # a coordinate on a cell boundary may code to either side
    assert np.array_equal(np.array(gain)[same], ngain[same]) or np.allclose(
        np.array(gain)[same].astype(np.float32), ngain[same].astype(np.float32), rtol=2 ** -10)


@given(p=prompts)
def test_bytes_within_theta(p):
    dims, params = _split(p)
    st, k, v = _prompt(**dims, **params)
    b, h, S, d = k.shape
    lay = ak.layout(h, S, d, 4, **params)
    fixed = ak._fixed_nbytes(S, d, lay.anchors, lay.index_bits, 4)
    slot = 4 * pq.words(d, params["residual_bits"]) + 2
    arrays = [x for x in st if isinstance(x, mx.array)]
    assert ak.nbytes(st) == state_nbytes(st) == sum(x.nbytes for x in arrays)
    assert ak.compressed_nbytes(st) == b * (h * fixed + (lay.key_slots + lay.value_slots) * slot)
    assert st.key_codes.shape[1] == lay.key_slots and st.value_codes.shape[1] == lay.value_slots
    budget = math.floor(params["theta"] * ak.full_nbytes(h, S, d))
    if h * fixed <= budget:
        assert ak.compressed_nbytes(st) <= b * budget
        n = (budget - h * fixed) // slot
        assert lay.key_slots == min(n // 2, h * (S - lay.anchors))
        assert lay.value_slots == min(n - n // 2, h * (S - lay.anchors))
    else:  # theta too small for the anchors and metadata: no residual, not an error
        assert lay.key_slots == lay.value_slots == 0


def test_defaults_at_2k_tokens_fit_theta():
    # head_dim 64, 2,048 tokens, float16 cache, the defaults: 32 anchors (5-bit indices).
    st, k, v = _prompt(1, 3, 2048, 64, 0, dtype=mx.float16)
    lay = ak.layout(3, 2048, 64, 2, theta=0.05, window=32, rho=0.7, anchor_frac=1 / 128,
                    residual_bits=2)
    assert lay.anchors == 32 and lay.index_bits == 5 and lay.key_slots > 0
    full = ak.full_nbytes(3, 2048, 64)
    assert ak.compressed_nbytes(st) <= 0.05 * full
    assert ak.compressed_nbytes(st) == st.key_codes.nbytes + st.key_gain.nbytes + st.value_codes.nbytes \
        + st.value_gain.nbytes + 3 * ak._fixed_nbytes(2048, 64, 32, 5, 2)


def test_theta_too_small_stores_no_residual():
    st, k, v = _prompt(1, 2, 100, 16, 3, theta=0.001)
    assert st.key_codes.shape == (1, 0, 1) and st.value_gain.shape == (1, 0)
    assert not _flags(st, "key").any() and not _flags(st, "value").any()
    gk, _ = ak.get_kv(st)
    assert np.isfinite(np.array(gk)).all()


def test_stored_residuals_are_the_top_utilities():
    # theta 0.3 leaves slots for part of the tokens (199 of 324 a side): the stored ones, pooled
    # over the heads of a batch row, are the top key (value) utilities.
    b, h, S, d = 2, 3, 120, 64
    st, k, v = _prompt(b, h, S, d, 5, theta=0.3, window=6, anchor_frac=0.1)
    ap = np.array(ak.anchors(st))
    is_anchor = np.zeros((b, h, S), bool)
    np.put_along_axis(is_anchor, ap, True, axis=-1)
    kx, vx = mx.array(k), mx.array(v)
    rk = ak.project(kx, mx.array(ap), mx.array(is_anchor))[2]
    rv = ak.project(vx, mx.array(ap), mx.array(is_anchor))[2]
    q = kx[:, :, None, S - 6:]
    from velox.attention import candidate_weights
    alpha = candidate_weights(q, kx[:, :, :0], kx)
    uk, uv = (np.array(u) for u in ak.utilities(q * d ** -0.5, alpha, vx, rk, rv))
    for u, side in ((uk, "key"), (uv, "value")):
        stored = _flags(st, side)
        u = np.where(is_anchor, -np.inf, u)
        for i in range(b):
            n = stored[i].sum()
            assert 0 < n < h * S - is_anchor[i].sum()
            assert u[i][stored[i]].min() >= u[i][~stored[i]].max()
            assert len(set(np.nonzero(stored[i])[0].tolist())) == h  # every head holds some


# --- selection, queries, determinism -------------------------------------------------------------

def test_attention_anchors_are_the_top_window_mass():
    # rho 1: every non-window anchor is among the positions the window's queries attend most.
    b, h, S, d, w = 1, 2, 90, 16, 5
    for groups in (0, 2):
        st, k, v = _prompt(b, h, S, d, 11, groups=groups, window=w, rho=1.0, anchor_frac=0.2)
        _, _, q = _inputs(b, h, S, d, 11, groups)
        probes = k[:, :, None] if q is None else q.reshape(b, h, groups, S, d)
        ap = np.array(ak.anchors(st))
        for j in range(h):
            qq = probes[0, j, :, S - w:].astype(np.float64)
            logits = qq @ k[0, j].T.astype(np.float64) / np.sqrt(d)
            logits = np.where(np.arange(S)[None, None] <= np.arange(S - w, S)[None, :, None], logits, -np.inf)
            wts = np.exp(logits - logits.max(-1, keepdims=True))
            mass = (wts / wts.sum(-1, keepdims=True)).sum(1).mean(0)[:S - w]
            top = set(np.argsort(-mass)[:18 - w].tolist())  # k = round(0.2 * 90) = 18
            assert set(ap[0, j].tolist()) - set(range(S - w, S)) == top


def test_real_queries_change_the_anchors():
    a = np.array(ak.anchors(_prompt(1, 2, 90, 16, 4, groups=0, window=5, rho=1.0, anchor_frac=0.2)[0]))
    b = np.array(ak.anchors(_prompt(1, 2, 90, 16, 4, groups=2, window=5, rho=1.0, anchor_frac=0.2)[0]))
    assert not np.array_equal(a, b)


def test_determinism_given_the_seed():
    one = _prompt(2, 2, 70, 16, 1, window=4, rho=0.0, anchor_frac=0.3, seed=5)[0]
    two = _prompt(2, 2, 70, 16, 1, window=4, rho=0.0, anchor_frac=0.3, seed=5)[0]
    other = _prompt(2, 2, 70, 16, 1, window=4, rho=0.0, anchor_frac=0.3, seed=6)[0]
    for x, y in zip(one, two):
        if isinstance(x, mx.array):
            assert np.array_equal(np.array(x), np.array(y))
    assert not np.array_equal(np.array(ak.anchors(one)), np.array(ak.anchors(other)))
    # the uniform draw belongs to the head, not the batch row
    ap = np.array(ak.anchors(one))
    assert np.array_equal(ap[0], ap[1]) and not np.array_equal(ap[0, 0], ap[0, 1])


def test_one_shot_rule():
    k, v, _ = _inputs(1, 2, 40, 8, 2)
    # a first update of one token: nothing is ever compressed
    st = ak.init(1, 2, 8)
    st = ak.update(st, mx.array(k[:, :, :1]), mx.array(v[:, :, :1]))
    st = ak.update(st, mx.array(k[:, :, 1:]), mx.array(v[:, :, 1:]))
    assert st.key_gamma.shape[2] == 0 and np.array_equal(np.array(ak.get_kv(st)[0]), k)
    # a prompt in two chunks: the first is compressed, the second appended exact
    st = ak.init(1, 2, 8, theta=0.5, window=4)
    st = ak.update(st, mx.array(k[:, :, :30]), mx.array(v[:, :, :30]))
    st = ak.update(st, mx.array(k[:, :, 30:]), mx.array(v[:, :, 30:]))
    assert st.key_gamma.shape[2] == 30 and st.tail_keys.shape[2] == 10
    assert np.array_equal(np.array(ak.get_kv(st)[1])[:, :, 30:], v[:, :, 30:])


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_cache(dtype):
    k, v, _ = _inputs(1, 2, 50, 16, 9)
    st = ak.init(1, 2, 16, dtype=dtype, theta=0.5, window=4)
    st = ak.update(st, mx.array(k).astype(dtype), mx.array(v).astype(dtype))
    gk, gv = ak.get_kv(st)
    assert gk.dtype == gv.dtype == dtype and st.anchor_keys.dtype == dtype
    ap = np.array(ak.anchors(st))[0, 0]
    assert np.array_equal(np.array(gk.astype(mx.float32))[0, 0, ap],
                          np.array(mx.array(k).astype(dtype).astype(mx.float32))[0, 0, ap])
