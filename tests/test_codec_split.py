"""Outlier channels (``velox.codecs.split`` and the codec caches' ``n_outlier``): the channel
choice, the split codec against its two parts, bytes by hand, the twins, the statistics.

Monte-Carlo checks draw the split codec's tables from many seeds (each part its own rotation and,
for ``turboquant_prod``, its own sketch) for a fixed query and key: the mean of the estimate's
errors is within 4 standard errors of 0.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import velox
from velox import codec_cache
from velox.codecs import append, codes_nbytes, get_codec, numpy_tables, prod, split, take
from velox.codecs import turboquant as tq
from velox.codecs.turboquant import padded_dim
from velox.registry import get_method

METHODS = ["turboquant_mse", "turboquant_prod", "turboquant_rvq"]
BASE_BITS = {"turboquant_mse": (1, 8), "turboquant_prod": (2, 9), "turboquant_rvq": (1, 8)}


def _rows(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _planted(rng, shape, channels, scale=10.0):
    """Gaussian rows whose ``channels`` are ``scale`` times larger."""
    x = _rows(rng, *shape)
    x[..., channels] *= np.float32(scale)
    return x


def _words(bits: int) -> int:
    return 4 * math.ceil(bits / 32)


# --- the channel choice -----------------------------------------------------------------------

@pytest.mark.parametrize("d,n_out", [(8, 2), (16, 4), (64, 32), (128, 32), (24, 5)])
def test_planted_outliers_are_chosen(d, n_out):
    rng = np.random.default_rng(d)
    b, h = 2, 3
    keys = _rows(rng, b, h, 20, d)
    want = np.zeros((b, h, d), np.int32)
    for i in range(b):
        for j in range(h):
            ch = np.sort(rng.choice(d, n_out, replace=False))
            keys[i, j][:, ch] *= 10
            rest = np.setdiff1d(np.arange(d), ch)
            want[i, j] = np.concatenate([ch, rest])
    got = np.array(split.channel_order(mx.array(keys), n_out))
    got_np = split.channel_order_np(keys, n_out)
    assert got.dtype == np.int32 and got_np.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_np, want)


def test_order_is_by_mean_square_and_ties_go_to_the_lower_index():
    # energies (sum of squares over 2 tokens): channel 3 largest, then 1 and 4 tied, then 0 ...
    k = np.array([[1, 2, 0, 3, 2, 0.5], [1, 2, 0, 3, 2, 0.5]], np.float32)[None, None]
    for n_out, want in [(1, [3, 0, 1, 2, 4, 5]), (2, [1, 3, 0, 2, 4, 5]), (3, [1, 3, 4, 0, 2, 5])]:
        np.testing.assert_array_equal(np.array(split.channel_order(mx.array(k), n_out))[0, 0], want)
        np.testing.assert_array_equal(split.channel_order_np(k, n_out)[0, 0], want)
    zeros = np.zeros((1, 2, 3, 8), np.float32)  # all tied: the first channels
    np.testing.assert_array_equal(split.channel_order_np(zeros, 3), np.broadcast_to(np.arange(8), (1, 2, 8)))
    np.testing.assert_array_equal(np.array(split.channel_order(mx.array(zeros), 3)),
                                  np.broadcast_to(np.arange(8), (1, 2, 8)))


def test_non_finite_channels_count_as_largest():
    k = _rows(np.random.default_rng(0), 1, 1, 4, 8)
    k[0, 0, 1, 6] = np.nan
    k[0, 0, 2, 2] = np.inf
    for order in (np.array(split.channel_order(mx.array(k), 2)), split.channel_order_np(k, 2)):
        np.testing.assert_array_equal(order[0, 0, :2], [2, 6])
        np.testing.assert_array_equal(np.sort(order[0, 0]), np.arange(8))


@given(d=st.sampled_from([8, 16, 24, 64]), seed=st.integers(0, 2**31))
def test_gather_scatter_invert(d, seed):
    rng = np.random.default_rng(seed)
    x = _rows(rng, 2, 3, 4, d)
    order = split.channel_order_np(_rows(rng, 2, 3, 5, d), int(rng.integers(1, d)))
    g = split.gather_np(x, order)
    assert g[1, 2, 3, 0] == x[1, 2, 3, order[1, 2, 0]]
    np.testing.assert_array_equal(split.scatter_np(g, order), x)
    gm = split.gather(mx.array(x), mx.array(order))
    np.testing.assert_array_equal(np.array(gm), g)
    np.testing.assert_array_equal(np.array(split.scatter(gm, mx.array(order))), x)


# --- the split codec ----------------------------------------------------------------------------

def _params(key, bits, outlier_bits, n_out, seed=7, **kw):
    return dict(bits=bits, outlier_bits=outlier_bits, n_outlier=n_out, seed=seed, **kw)


@pytest.mark.parametrize("key", METHODS)
def test_split_codec_tables_are_two_instances(key):
    base = get_codec(key)
    codec = split.of(key)
    assert codec is get_codec(f"{key}_split") and codec is split.of(base)
    assert codec.params == (*base.params, "n_outlier", "outlier_bits")
    lo = BASE_BITS[key][0]
    t = codec.tables(48, _params(key, lo + 1, lo + 2, 12))
    assert isinstance(t, split.SplitTables) and (t.n_outlier, t.head_dim) == (12, 48)
    # the outlier part: its own dimension, outlier_bits, seed + 2; the rest: bits, seed
    want_o = base.tables(12, dict(bits=lo + 2, seed=9))
    want_i = base.tables(36, dict(bits=lo + 1, seed=7))
    for got, want in ((t.outlier, want_o), (t.inlier, want_i)):
        assert type(got) is type(want)
        for x, y in zip(got, want):
            if isinstance(x, mx.array):
                np.testing.assert_array_equal(np.array(x), np.array(y))
            else:
                assert x == y
    r = np.array(t.outlier.rotation, np.float64)  # 12: not a power of two (QR), orthogonal
    np.testing.assert_allclose(r @ r.T, np.eye(12), atol=2e-6)
    assert not np.allclose(np.array(t.inlier.rotation)[:12, :12], r, atol=1e-3)
    # outlier_bits 0: the same bits as the rest
    assert codec.tables(48, _params(key, lo + 1, 0, 12)).outlier.bits == lo + 1


@pytest.mark.parametrize("key", METHODS)
def test_split_codec_rejects_n_outlier_out_of_range(key):
    codec = split.of(key)
    for n in (0, 16, 17, -1, 2.5):
        with pytest.raises(ValueError, match="n_outlier"):
            codec.tables(16, dict(n_outlier=n))


@pytest.mark.parametrize("key", METHODS)
@pytest.mark.parametrize("d,n_out", [(16, 4), (64, 32), (24, 7)])
def test_split_equals_its_parts(key, d, n_out):
    """encode = the parts' codes; decode = the parts' decodes side by side; scores = the sum of
    the parts' scores, the query split the same way."""
    rng = np.random.default_rng(d + n_out)
    base, codec = get_codec(key), split.of(key)
    lo = BASE_BITS[key][0]
    t = codec.tables(d, _params(key, lo + 1, lo + 2, n_out))
    k, q = _rows(rng, 2, 2, 9, d), _rows(rng, 2, 2, 3, d)
    c = codec.encode(t, mx.array(k))
    o = base.encode(t.outlier, mx.array(k[..., :n_out]))
    i = base.encode(t.inlier, mx.array(k[..., n_out:]))
    assert type(c).__name__ == f"Split{type(o).__name__}"
    assert type(c)._fields == tuple(f"outlier_{f}" for f in o._fields) + tuple(f"inlier_{f}" for f in i._fields)
    for x, y in zip(c, (*o, *i)):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    po, pi = split.parts(c)
    assert type(po) is type(o)
    dec = np.array(codec.decode(t, c))
    np.testing.assert_array_equal(dec, np.concatenate([np.array(base.decode(t.outlier, o)),
                                                       np.array(base.decode(t.inlier, i))], -1))
    s = np.array(codec.scores(t, mx.array(q), c))
    parts = (np.array(base.scores(t.outlier, mx.array(q[..., :n_out]), o))
             + np.array(base.scores(t.inlier, mx.array(q[..., n_out:]), i)))
    np.testing.assert_allclose(s, parts, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s, q @ dec.swapaxes(-1, -2), rtol=1e-4, atol=1e-4 * np.abs(s).max())
    assert all(x.shape[:3] == (2, 2, 9) for x in c)


@pytest.mark.parametrize("key", METHODS)
def test_split_codes_append_and_take(key):
    rng = np.random.default_rng(1)
    codec = split.of(key)
    t = codec.tables(16, _params(key, 3, 4, 5))
    a, b = (codec.encode(t, mx.array(_rows(rng, 1, 2, n, 16))) for n in (3, 4))
    ab = append(a, b)
    assert type(ab) is type(a) and all(x.shape[2] == 7 for x in ab)
    idx = mx.array(np.array([[[0, 4, 6], [1, 2, 5]]], np.int32))
    got = take(ab, idx)
    for f, x, y in zip(got._fields, got, ab):  # the codes taken are the codes, exactly
        np.testing.assert_array_equal(np.array(x)[0, 0], np.array(y)[0, 0, [0, 4, 6]], err_msg=f)
    # Decoding ends in a float32 matmul by the rotation (or sketch) over 3 rows here and 7
    # there: a BLAS may round a row's products differently at the two shapes (OpenBLAS does,
    # in the last bit), so the decoded rows agree to float32 rounding.
    np.testing.assert_allclose(np.array(codec.decode(t, got))[0, 0],
                               np.array(codec.decode(t, ab))[0, 0, [0, 4, 6]], rtol=1e-6, atol=1e-6)


@given(key=st.sampled_from(METHODS), d=st.sampled_from([8, 16, 32, 64, 128, 24]),
       seed=st.integers(0, 2**31), n=st.integers(1, 20), m=st.integers(1, 3),
       data=st.data())
def test_mx_equals_np(key, d, seed, n, m, data):
    lo, hi = BASE_BITS[key]
    n_out = data.draw(st.integers(1, d - 1), label="n_outlier")
    bits = data.draw(st.integers(lo, min(hi, lo + 3)), label="bits")
    ob = data.draw(st.sampled_from([0] + list(range(lo, min(hi, lo + 3) + 1))), label="outlier_bits")
    rng = np.random.default_rng(seed)
    codec = split.of(key)
    t = codec.tables(d, _params(key, bits, ob, n_out, seed=seed % 1000))
    tn = numpy_tables(t)
    k = _rows(rng, 2, 2, n, d) * np.float32(rng.uniform(0.1, 10))
    q = _rows(rng, 2, 2, m, d)
    c, cn = codec.encode(t, mx.array(k)), codec.encode_np(tn, k)
    assert type(c) is type(cn)
    base = get_codec(key)  # the NumPy split is the NumPy parts, exactly
    parts = (*base.encode_np(numpy_tables(t.outlier), k[..., :n_out]),
             *base.encode_np(numpy_tables(t.inlier), k[..., n_out:]))
    for x, y in zip(cn, parts):
        np.testing.assert_array_equal(x, y)
    for f, x, y in zip(c._fields, c, cn):
        x = np.array(x)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        if x.dtype == np.uint32:  # indices: a row may flip a coordinate within rounding of a
            # cell boundary (stage 2 of rvq: its residual divided by its RMS, ~1e-4 a unit)
            rows = int(np.prod(x.shape[:3]))
            flips = int(np.sum(np.any(x != y, axis=-1)))
            assert flips <= 1 + (0.2 if f.endswith("res_idx") else 0.02) * rows, f
        else:  # norms and gains: float16 of the same float32 formulas (one step)
            np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=2**-9,
                                       atol=1e-3 if "gain" in f else 0, err_msg=f)
    c = type(c)(*(mx.array(y) for y in cn))  # the same codes: decode and scores agree
    s, sn = np.array(codec.scores(t, mx.array(q), c)), codec.scores_np(tn, q, cn)
    dec, decn = np.array(codec.decode(t, c)), codec.decode_np(tn, cn)
    scale = float(np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max())
    np.testing.assert_allclose(s, sn, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(dec, decn, rtol=1e-4, atol=1e-5 * np.abs(decn).max())


def test_prod_split_is_unbiased_over_seeds():
    """Each part's estimate is unbiased for its share of q . k (its own rotation and sketch), so
    the split's score is unbiased for q . k."""
    rng = np.random.default_rng(5)
    d, n_out, seeds = 16, 4, 1500
    k = _planted(rng, (3, d), [2, 7, 11, 13]) * np.array([[0.5], [1.0], [3.0]], np.float32)
    q = _rows(rng, 2, d)
    q[1] = 0.7 * k[1] / 10 + 0.3 * q[1]
    codec = split.of("turboquant_prod")
    order = split.channel_order_np(k[None, None], n_out)
    kk, qq = split.gather_np(k[None, None], order), split.gather_np(q[None, None], order)
    est, dec = [], []
    for seed in range(seeds):
        t = numpy_tables(codec.tables(d, dict(bits=2, outlier_bits=3, jl_dim=0, n_outlier=n_out,
                                              seed=seed)))
        c = codec.encode_np(t, kk)
        est.append(codec.scores_np(t, qq, c)[0, 0])
        dec.append(split.scatter_np(codec.decode_np(t, c), order)[0, 0])
    est, dec = np.stack(est), np.stack(dec)
    err = est - q @ k.T
    assert np.all(np.abs(err.mean(0)) <= 4 * err.std(0) / math.sqrt(seeds))
    derr = dec - k
    assert np.all(np.abs(derr.mean(0)) <= 4 * derr.std(0) / math.sqrt(seeds) + 1e-6)


def test_mse_between_the_plain_widths():
    """bits 2 with half the channels (the planted outliers) at 3 bits: the relative MSE lies
    between the plain 2-bit and 3-bit codecs'."""
    rng = np.random.default_rng(11)
    d, n = 64, 512
    ch = np.sort(rng.choice(d, d // 2, replace=False))
    k = _planted(rng, (1, 2, n, d), ch, scale=3.0)

    def rel_mse(**params):
        st = velox.init("turboquant_mse", 1, 2, d, backend="mlx", **params)
        st = velox.update(st, mx.array(k), mx.array(k))
        kh = np.array(velox.get_kv(st)[0])
        return float(np.sum((kh - k) ** 2) / np.sum(k * k)), st

    two, _ = rel_mse(bits=2)
    three, _ = rel_mse(bits=3)
    mixed, st = rel_mse(bits=2, outlier_bits=3, n_outlier=d // 2)
    np.testing.assert_array_equal(np.array(st.key_channels)[0, 0, :d // 2], ch)
    assert three < mixed < two, (three, mixed, two)


# --- the codec caches ---------------------------------------------------------------------------

@pytest.mark.parametrize("key", METHODS)
@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_no_split_is_the_plain_codec(key, backend):
    rng = np.random.default_rng(2)
    k, v = _rows(rng, 1, 2, 11, 32), _rows(rng, 1, 2, 11, 32)
    st = velox.init(key, 1, 2, 32, backend=backend, n_outlier=0, outlier_bits=3)
    st = velox.update(st, mx.array(k), mx.array(v))
    base = get_codec(key)
    assert codec_cache.codec_of(st) is base
    assert st.key_channels.shape == (1, 2, 0) and st.key_channels.nbytes == 0
    t = base.tables(32, dict(bits=2, seed=42, **({"jl_dim": 0} if key == "turboquant_prod" else {})))
    want = base.encode(t, mx.array(k)) if backend == "mlx" else base.encode_np(numpy_tables(t), k)
    held = codec_cache.held_codes(st)[0]  # the codes of the tokens held (the first rows)
    assert type(held) is type(want)
    for x, y in zip(held, want):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    plain = velox.update(velox.init(key, 1, 2, 32, backend=backend), mx.array(k), mx.array(v))
    assert velox.nbytes(plain) == velox.nbytes(st)


@pytest.mark.parametrize("key", METHODS)
@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_cache_chooses_on_the_first_update_and_keeps_it(key, backend):
    rng = np.random.default_rng(3)
    d, n_out = 16, 4
    first = [1, 5, 9, 14]
    st = velox.init(key, 2, 2, d, backend=backend, n_outlier=n_out, outlier_bits=4)
    assert codec_cache.codec_of(st) is split.of(key)
    np.testing.assert_array_equal(np.array(st.key_channels), np.broadcast_to(np.arange(d), (2, 2, d)))
    k1 = _planted(rng, (2, 2, 12, d), first)
    st = velox.update(st, mx.array(k1), mx.array(k1))
    want = np.concatenate([first, np.setdiff1d(np.arange(d), first)])
    np.testing.assert_array_equal(np.array(st.key_channels), np.broadcast_to(want, (2, 2, d)))
    k2 = _planted(rng, (2, 2, 6, d), [0, 2, 3, 4], scale=100.0)  # other outliers later: ignored
    st = velox.update(st, mx.array(k2), mx.array(k2))
    np.testing.assert_array_equal(np.array(st.key_channels), np.broadcast_to(want, (2, 2, d)))
    # the stored codes are the split codec's codes of the keys in that channel order
    codec = split.of(key)
    keys = np.concatenate([k1, k2], axis=2)
    kk = split.gather_np(keys, np.array(st.key_channels))
    codes = codec.encode(st.tables, mx.array(kk)) if backend == "mlx" else codec.encode_np(
        numpy_tables(st.tables), kk)
    held = codec_cache.held_codes(st)[0]
    for f, x, y in zip(held._fields, held, codes):
        x, y = np.array(x), np.array(y)
        if x.dtype == np.uint32:
            assert np.mean(np.any(x != y, axis=-1)) <= 0.1, f
    # get_kv: the codec's decode, channels back in place
    dec = split.scatter_np(np.array(codec.decode(st.tables, held)), np.array(st.key_channels))
    np.testing.assert_array_equal(np.array(velox.get_kv(st)[0]), dec)
    assert np.sum((dec - keys) ** 2) < 0.5 * np.sum(keys ** 2)


@pytest.mark.parametrize("key", METHODS)
def test_attention_reads_the_split_scores(key):
    rng = np.random.default_rng(4)
    d = 32
    st = velox.init(key, 1, 2, d, n_outlier=8, outlier_bits=3)
    k = _planted(rng, (1, 2, 20, d), [0, 3, 8, 9, 10, 20, 30, 31])
    st = velox.update(st, mx.array(k), mx.array(_rows(rng, 1, 2, 20, d)))
    q = _rows(rng, 1, 2, 3, d)
    got = np.array(codec_cache.key_scores(st, mx.array(q)))
    order = np.array(st.key_channels)
    want = np.array(split.of(key).scores(st.tables, mx.array(split.gather_np(q, order)),
                                         codec_cache.held_codes(st)[0]))
    np.testing.assert_array_equal(got, want)
    # the same as q against the decoded keys (channels in place)
    kh = np.array(velox.get_kv(st)[0])
    np.testing.assert_allclose(got, q @ kh.swapaxes(-1, -2), rtol=1e-4, atol=1e-4 * np.abs(got).max())
    # attend: softmax over those logits and the new token's exact one
    kn, vn = _rows(rng, 1, 2, 1, d), _rows(rng, 1, 2, 1, d)
    out = np.array(get_method(key).attend(st, mx.array(q[:, :, :1]), mx.array(kn), mx.array(vn), scale=1.0))
    logits = np.concatenate([got[:, :, :1], q[:, :, :1] @ kn.swapaxes(-1, -2)], -1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    vals = np.concatenate([np.array(velox.get_kv(st)[1], np.float32), vn], 2)
    np.testing.assert_allclose(out, p @ vals, rtol=1e-4, atol=1e-4)


def _split_key_bytes(key, d, n_out, bits, ob, jl_dim=0):
    """Key bytes per token of a split: each part's codes at its own dimension and bits."""
    def part(dim, b):
        if key == "turboquant_mse":
            return padded_dim(dim, b) * b // 8 + 2
        if key == "turboquant_rvq":
            return 2 * (padded_dim(dim, b) * b // 8) + 2 + 2
        m = jl_dim or prod.default_jl_dim(dim, b)
        return padded_dim(dim, b - 1) * (b - 1) // 8 + 2 + _words(m) + 2
    return part(n_out, ob or bits) + part(d - n_out, bits)


def _split_tables_bytes(key, d, n_out, bits, ob, jl_dim=0):
    def part(dim, b):
        out = dim * dim * 4
        if key == "turboquant_prod":
            m = jl_dim or prod.default_jl_dim(dim, b)
            out += _words(m) * 8 * dim * 4 + (2 ** (b - 1) + 2 ** (b - 1) - 1) * 4
        elif key == "turboquant_rvq":
            out += 2 * (2 ** b + 2 ** b - 1) * 4
        else:
            out += (2 ** b + 2 ** b - 1) * 4
        return out
    return part(n_out, ob or bits) + part(d - n_out, bits)


@pytest.mark.parametrize("key", METHODS)
@pytest.mark.parametrize("d,n_out,bits,ob", [(128, 32, 2, 3), (128, 32, 3, 4), (64, 32, 2, 3),
                                             (64, 32, 3, 4), (48, 12, 3, 0), (16, 5, 4, 6)])
def test_bytes_by_hand(key, d, n_out, bits, ob):
    if key == "turboquant_prod":
        bits, ob = bits + 1, ob and ob + 1  # the same MSE widths plus the sketch
    b, h, n = 1, 2, 40
    rng = np.random.default_rng(0)
    st = velox.init(key, b, h, d, dtype=mx.float16, n_outlier=n_out, outlier_bits=ob, bits=bits)
    k = mx.array(_rows(rng, b, h, n, d)).astype(mx.float16)
    st = velox.update(st, k, k)
    values = 2 * d if key == "turboquant_rvq" else d + 2 + 2
    per_token = _split_key_bytes(key, d, n_out, bits, ob) + values
    fixed = _split_tables_bytes(key, d, n_out, bits, ob) + b * h * d * 4  # tables, key_channels
    assert codes_nbytes(codec_cache.held_codes(st)[0]) == b * h * n * _split_key_bytes(key, d, n_out, bits, ob)
    rows = codec_cache.capacity(st)  # the tokens' rows and the empty ones after them
    assert abs(velox.nbytes(st) - (b * h * rows * per_token + fixed)) <= 0.01 * velox.nbytes(st)
    assert velox.state_nbytes(st.tables) == _split_tables_bytes(key, d, n_out, bits, ob)
    assert st.key_channels.nbytes == b * h * d * 4


def test_paper_settings_bits_per_channel():
    """TurboQuant's fractional widths: head_dim 128, 32 outlier channels; 2.5 = 32 at 3 bits and
    96 at 2 (index bits 2.25 a channel, norms 0.25), 3.5 = 32 at 4 and 96 at 3 (3.25 + 0.25)."""
    for bits, ob, want in [(2, 3, 2.5), (3, 4, 3.5)]:
        assert _split_key_bytes("turboquant_mse", 128, 32, bits, ob) * 8 / 128 == want


@pytest.mark.parametrize("key", METHODS)
def test_parameter_errors(key, no_shape_checks):
    m = get_method(key)
    with pytest.raises(ValueError, match="n_outlier.*head_dim"):
        m.init(1, 1, 16, n_outlier=16)
    with pytest.raises(ValueError, match="n_outlier"):
        m.init(1, 1, 16, n_outlier=-1)
    lo, hi = BASE_BITS[key]
    with pytest.raises(ValueError, match="outlier_bits"):
        m.init(1, 1, 16, n_outlier=4, outlier_bits=hi + 1)
    with pytest.raises(ValueError, match="outlier_bits"):
        m.init(1, 1, 16, n_outlier=4, outlier_bits=-1)
    if lo > 1:
        with pytest.raises(ValueError, match="outlier_bits"):
            m.init(1, 1, 16, n_outlier=4, outlier_bits=lo - 1)
    m.init(1, 1, 16, n_outlier=15, outlier_bits=hi)
