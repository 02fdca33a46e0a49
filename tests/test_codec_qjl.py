"""The QJL sign-sketch codec: packing, twins, and the estimator's statistics.

Monte-Carlo checks draw the sketch from many seeds (each seed is the codec's own table) for a
fixed query and key; a mean is within 4 standard errors of its expectation and a sample
variance within 4 of its relative standard errors (sqrt(2 / n) for near-Gaussian estimates).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from velox.codecs import append, codes_nbytes, get_codec, numpy_tables, take
from velox.codecs import qjl

HEAD_DIMS = [8, 16, 32, 64, 128]
SEEDS = 3000


def _rows(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _estimates(q, k, jl_dim, seeds=SEEDS):
    """Estimates of ``q . k`` ``[seeds, len(q), len(k)]`` and decodes ``[seeds, len(k), d]``,
    one sketch per seed (NumPy twins)."""
    d = q.shape[-1]
    est, dec = [], []
    for seed in range(seeds):
        t = numpy_tables(qjl.tables(d, {"jl_dim": jl_dim, "seed": seed}))
        c = qjl.encode_np(t, k[None, None])
        est.append(qjl.scores_np(t, q[None, None], c)[0, 0])
        dec.append(qjl.decode_np(t, c)[0, 0])
    return np.stack(est), np.stack(dec)


def test_registered():
    codec = get_codec("qjl")
    assert codec is qjl.CODEC
    assert codec.params == ("jl_dim", "seed")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("jl_dim", [0, 32, 40])
def test_sketch_tables(head_dim, jl_dim):
    t = qjl.tables(head_dim, {"jl_dim": jl_dim, "seed": 5})
    m = jl_dim or head_dim
    s = np.array(t.sketch)
    assert t.jl_dim == m and s.dtype == np.float32
    assert s.shape == (-(-m // 32) * 32, head_dim)
    assert not s[m:].any()
    ref = np.random.default_rng(5).standard_normal((m, head_dim)).astype(np.float32)
    np.testing.assert_array_equal(s[:m], ref)
    np.testing.assert_array_equal(np.array(qjl.tables(head_dim, {"jl_dim": jl_dim, "seed": 5}).sketch), s)
    assert not np.array_equal(np.array(qjl.tables(head_dim, {"jl_dim": jl_dim, "seed": 6}).sketch), s)


def test_bad_jl_dim():
    with pytest.raises(ValueError, match="jl_dim=-1"):
        qjl.tables(16, {"jl_dim": -1, "seed": 0})


@pytest.mark.parametrize("head_dim,jl_dim", [(8, 0), (16, 0), (32, 0), (64, 0), (128, 0),
                                             (64, 256), (16, 40), (128, 33)])
def test_bits_really_packed(head_dim, jl_dim):
    b, h, n = 2, 3, 7
    t = qjl.tables(head_dim, {"jl_dim": jl_dim, "seed": 1})
    m = t.jl_dim
    k = _rows(np.random.default_rng(0), b, h, n, head_dim)
    c = qjl.encode(t, mx.array(k))
    assert c.signs.dtype == mx.uint32 and c.norms.dtype == mx.float16
    assert c.signs.shape == (b, h, n, -(-m // 32)) and c.norms.shape == (b, h, n)
    per_token = 4 * -(-m // 32) + 2
    if m % 32 == 0:
        assert per_token == m // 8 + 2
    assert codes_nbytes(c) == b * h * n * per_token
    words = np.array(c.signs)
    bits = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    bits = bits.reshape(b, h, n, -1)
    proj = k @ np.array(t.sketch)[:m].T
    np.testing.assert_array_equal(bits[..., :m], (proj > 0).astype(np.uint32))
    assert not bits[..., m:].any()
    np.testing.assert_allclose(np.array(c.norms, np.float32), np.linalg.norm(k, axis=-1), rtol=1e-3)


@given(head_dim=st.sampled_from(HEAD_DIMS), jl_dim=st.sampled_from([0, 32, 48, 100]),
       seed=st.integers(0, 2**31), n=st.integers(1, 40), m=st.integers(1, 5))
def test_mx_equals_np(head_dim, jl_dim, seed, n, m):
    rng = np.random.default_rng(seed)
    t = qjl.tables(head_dim, {"jl_dim": jl_dim, "seed": seed})
    tn = numpy_tables(t)
    k = _rows(rng, 2, 2, n, head_dim) * rng.uniform(0.1, 10)
    q = _rows(rng, 2, 2, m, head_dim)
    c, cn = qjl.encode(t, mx.array(k)), qjl.encode_np(tn, k)
    np.testing.assert_array_equal(np.array(c.signs), cn.signs)
    # norms: the same float32 formula rounded to float16 (summation order may move one ulp)
    np.testing.assert_allclose(np.array(c.norms, np.float32), cn.norms.astype(np.float32), rtol=2**-10)
    c = qjl.QJLCodes(c.signs, mx.array(cn.norms))
    s, sn = np.array(qjl.scores(t, mx.array(q), c)), qjl.scores_np(tn, q, cn)
    dec, decn = np.array(qjl.decode(t, c)), qjl.decode_np(tn, cn)
    scale = np.linalg.norm(q, axis=-1)[..., None] * np.linalg.norm(k, axis=-1)[:, :, None, :]
    np.testing.assert_allclose(s, sn, rtol=1e-4, atol=1e-5 * scale.max())
    np.testing.assert_allclose(dec, decn, rtol=1e-4, atol=1e-5 * np.abs(decn).max())
    # scores are q . decode: the estimator and its implied reconstruction agree
    np.testing.assert_allclose(s, q @ dec.swapaxes(-1, -2), rtol=1e-4, atol=1e-5 * scale.max())
    again = qjl.encode(qjl.tables(head_dim, {"jl_dim": jl_dim, "seed": seed}), mx.array(k))
    np.testing.assert_array_equal(np.array(again.signs), np.array(c.signs))


@given(a=st.floats(-100, 100).filter(lambda a: abs(a) > 1e-3), beta=st.floats(1e-2, 100),
       seed=st.integers(0, 1000))
def test_scale_equivariance(a, beta, seed):
    rng = np.random.default_rng(seed)
    t = qjl.tables(32, {"jl_dim": 64, "seed": seed})
    k = _rows(rng, 1, 2, 9, 32)
    q = _rows(rng, 1, 2, 3, 32)
    c = qjl.encode(t, mx.array(k))
    s = np.array(qjl.scores(t, mx.array(q), c))
    tol = 1e-5 * np.abs(s).max()
    np.testing.assert_allclose(np.array(qjl.scores(t, mx.array(a * q), c)), a * s, rtol=1e-5, atol=abs(a) * tol)
    cb = qjl.encode(t, mx.array(beta * k))
    np.testing.assert_array_equal(np.array(cb.signs), np.array(c.signs))
    # the float16 norm rounds ||beta k|| and ||k|| separately: within two float16 roundings
    np.testing.assert_allclose(np.array(qjl.scores(t, mx.array(q), cb)), beta * s, rtol=2**-10, atol=beta * tol)


def test_unbiased_over_seeds():
    rng = np.random.default_rng(0)
    d, m = 16, 32
    k = _rows(rng, 3, d) * np.array([[0.5], [1.0], [3.0]], np.float32)
    q = _rows(rng, 2, d)
    q[1] = 0.8 * k[0] / np.linalg.norm(k[0]) * np.linalg.norm(q[1]) + 0.2 * q[1]  # correlated pair
    est, dec = _estimates(q, k, m)
    exact = q @ k.T
    sigma = np.sqrt(np.maximum(math.pi / 2 * np.outer((q * q).sum(-1), (k * k).sum(-1)) - exact**2, 0) / m)
    assert np.all(np.abs(est.mean(0) - exact) <= 4 * sigma / math.sqrt(SEEDS))
    # decode is an unbiased estimate of k: per coordinate, Var <= (pi/2) ||k||^2 / m
    sigma_k = np.sqrt(math.pi / 2 / m) * np.linalg.norm(k, axis=-1, keepdims=True)
    assert np.all(np.abs(dec.mean(0) - k) <= 4 * sigma_k / math.sqrt(SEEDS))


def test_variance_bound_and_decreasing_in_m():
    rng = np.random.default_rng(1)
    d = 32
    k = _rows(rng, 2, d)
    q = _rows(rng, 2, d)
    q[1] = k[1] + 0.3 * q[1]
    bound = math.pi / 2 * np.outer((q * q).sum(-1), (k * k).sum(-1))
    exact = q @ k.T
    slack = 4 * math.sqrt(2 / (SEEDS - 1))
    var = {}
    for m in (16, 64):
        est, _ = _estimates(q, k, m)
        var[m] = est.var(0, ddof=1)
        assert np.all(var[m] <= bound / m * (1 + slack))
        # the exact variance ((pi/2)|q|^2|k|^2 - <q,k>^2)/m, tighter for correlated pairs
        np.testing.assert_allclose(var[m], (bound - exact**2) / m, rtol=slack)
    assert np.all(var[64] < 0.5 * var[16])


def test_append_and_take():
    rng = np.random.default_rng(2)
    t = qjl.tables(16, {"jl_dim": 0, "seed": 0})
    k = _rows(rng, 1, 2, 10, 16)
    whole = qjl.encode(t, mx.array(k))
    parts = append(qjl.encode(t, mx.array(k[:, :, :4])), qjl.encode(t, mx.array(k[:, :, 4:])))
    for x, y in zip(whole, parts):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    idx = mx.array(np.array([[[1, 5, 9], [0, 2, 3]]], np.int32))
    kept = take(whole, idx)
    sub = qjl.encode(t, mx.array(np.take_along_axis(k, np.array(idx)[..., None], axis=2)))
    for x, y in zip(kept, sub):
        np.testing.assert_array_equal(np.array(x), np.array(y))
