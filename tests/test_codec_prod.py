"""TurboQuant_prod: MSE stage at bits - 1 plus QJL of its residual; bytes, twins, and the
estimator's statistics.

Monte-Carlo checks draw the codec's tables from many seeds (rotation from ``seed``, sketch from
``seed + 1``) for a fixed query and key. Given the rotation the estimate's error is the QJL
error on the residual ``r``, of variance ``v = ((pi/2)|q|^2|r|^2 - <q, r>^2) / m``: the mean of
the errors standardized by ``sqrt(v)`` is within 4 / sqrt(n) of 0, and sample variances within
4 relative standard errors (sqrt(2 / n) for near-Gaussian errors) of their expectation.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from velox.codecs import append, codes_nbytes, get_codec, numpy_tables, prod, qjl, take
from velox.codecs import turboquant as tq

HEAD_DIMS = [8, 16, 32, 64, 128]
SEEDS = 3000


def _rows(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _draws(q, k, bits, jl_dim, seeds=SEEDS):
    """Per seed: estimates ``[seeds, len(q), len(k)]``, decodes ``[seeds, len(k), d]`` and
    residuals ``[seeds, len(k), d]`` (``k - x_mse`` from the stored norm), NumPy twins."""
    d = q.shape[-1]
    est, dec, res = [], [], []
    for seed in range(seeds):
        t = numpy_tables(prod.tables(d, {"bits": bits, "jl_dim": jl_dim, "seed": seed}))
        c = prod.encode_np(t, k[None, None])
        est.append(prod.scores_np(t, q[None, None], c)[0, 0])
        dec.append(prod.decode_np(t, c)[0, 0])
        mse = tq.mse_decode_np(prod._mse(t), tq.MseCodes(c.idx, c.norm))[0, 0]
        res.append(k - mse)
    return np.stack(est), np.stack(dec), np.stack(res)


def _qr_moments(q, res, m):
    """Per seed: the bound ``(pi/2)|q|^2|r|^2/m`` and the exact variance given the rotation."""
    qq = (q * q).sum(-1)[None, :, None]
    rr = (res * res).sum(-1)[:, None, :]
    qr = np.einsum("qd,skd->sqk", q, res)
    bound = math.pi / 2 * qq * rr / m
    return bound, bound - qr**2 / m


def test_registered():
    codec = get_codec("turboquant_prod")
    assert codec is prod.CODEC
    assert codec.params == ("bits", "jl_dim", "seed")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tables_are_the_two_stages(head_dim, bits):
    t = prod.tables(head_dim, {"bits": bits, "jl_dim": 0, "seed": 7})
    assert t.jl_dim == (head_dim if bits == 2 else min(head_dim, 64))
    mse = tq.mse_tables(head_dim, bits - 1, 7)
    for name in ("rotation", "centroids", "boundaries"):
        np.testing.assert_array_equal(np.array(getattr(t, name)), np.array(getattr(mse, name)))
    assert (t.bits - 1, t.head_dim, t.padded) == (mse.bits, mse.head_dim, mse.padded)
    sk = qjl.sketch_tables(head_dim, t.jl_dim, 8)
    np.testing.assert_array_equal(np.array(t.sketch), np.array(sk.sketch))
    again = prod.tables(head_dim, {"bits": bits, "jl_dim": 0, "seed": 7})
    for x, y in zip(t, again):
        assert np.array_equal(np.array(x), np.array(y))


@pytest.mark.parametrize("bits", [1, 10, 2.5, True])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits must be an integer in 2..9"):
        prod.tables(16, {"bits": bits})


@pytest.mark.parametrize("head_dim,bits,jl_dim", [(8, 2, 0), (16, 3, 0), (32, 2, 0), (64, 3, 0),
                                                  (128, 4, 0), (128, 2, 0), (128, 3, 256),
                                                  (64, 5, 40), (16, 4, 0)])
def test_bytes(head_dim, bits, jl_dim):
    b, h, n = 2, 3, 5
    t = prod.tables(head_dim, {"bits": bits, "jl_dim": jl_dim, "seed": 0})
    m = t.jl_dim
    c = prod.encode(t, mx.array(_rows(np.random.default_rng(0), b, h, n, head_dim)))
    assert [x.dtype for x in c] == [mx.uint32, mx.float16, mx.uint32, mx.float16]
    assert all(x.shape[:3] == (b, h, n) for x in c)
    per_key = tq.padded_dim(head_dim, bits - 1) * (bits - 1) // 8 + 2 + 4 * -(-m // 32) + 2
    if head_dim % 32 == 0 and m % 32 == 0:
        assert per_key == math.ceil(head_dim * (bits - 1) / 8) + m // 8 + 4
    assert codes_nbytes(c) == b * h * n * per_key


@pytest.mark.parametrize("head_dim,bits", [(16, 2), (64, 3), (128, 4)])
def test_codes_are_mse_then_qjl_of_the_residual(head_dim, bits):
    rng = np.random.default_rng(3)
    k = mx.array(_rows(rng, 1, 2, 6, head_dim))
    t = prod.tables(head_dim, {"bits": bits, "jl_dim": 0, "seed": 11})
    c = prod.encode(t, k)
    mse_t = tq.mse_tables(head_dim, bits - 1, 11)
    m = tq.mse_encode(mse_t, k)
    sk = qjl.sketch_tables(head_dim, t.jl_dim, 12)
    r = qjl.encode(sk, k - tq.mse_decode(mse_t, m))
    for x, y in zip(c, (m.idx, m.norm, r.signs, r.norms)):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    np.testing.assert_allclose(np.array(prod.decode(t, c)),
                               np.array(tq.mse_decode(mse_t, m) + qjl.decode(sk, r)), rtol=1e-6, atol=1e-6)


@given(head_dim=st.sampled_from(HEAD_DIMS), bits=st.integers(2, 5),
       jl_dim=st.sampled_from([0, 32, 48]), seed=st.integers(0, 2**31), n=st.integers(1, 30),
       m=st.integers(1, 4))
def test_mx_equals_np(head_dim, bits, jl_dim, seed, n, m):
    rng = np.random.default_rng(seed)
    t = prod.tables(head_dim, {"bits": bits, "jl_dim": jl_dim, "seed": seed})
    tn = numpy_tables(t)
    k = _rows(rng, 2, 2, n, head_dim) * rng.uniform(0.1, 10)
    q = _rows(rng, 2, 2, m, head_dim)
    c, cn = prod.encode(t, mx.array(k)), prod.encode_np(tn, k)
    np.testing.assert_array_equal(np.array(c.idx), cn.idx)
    np.testing.assert_array_equal(np.array(c.signs), cn.signs)
    # norms: the same float32 formulas rounded to float16 (summation order may move one ulp)
    for x, y in ((c.norm, cn.norm), (c.res_norm, cn.res_norm)):
        np.testing.assert_allclose(np.array(x, np.float32), y.astype(np.float32), rtol=2**-10)
    c = c._replace(norm=mx.array(cn.norm), res_norm=mx.array(cn.res_norm))
    s, sn = np.array(prod.scores(t, mx.array(q), c)), prod.scores_np(tn, q, cn)
    dec, decn = np.array(prod.decode(t, c)), prod.decode_np(tn, cn)
    scale = (np.linalg.norm(q, axis=-1)[..., None] * np.linalg.norm(k, axis=-1)[:, :, None, :]).max()
    np.testing.assert_allclose(s, sn, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(dec, decn, rtol=1e-4, atol=1e-5 * np.abs(decn).max())
    np.testing.assert_allclose(s, q @ dec.swapaxes(-1, -2), rtol=1e-4, atol=1e-5 * scale)
    again = prod.encode(prod.tables(head_dim, {"bits": bits, "jl_dim": jl_dim, "seed": seed}),
                        mx.array(k))
    np.testing.assert_array_equal(np.array(again.signs), np.array(c.signs))
    np.testing.assert_array_equal(np.array(again.idx), np.array(c.idx))


@given(a=st.floats(-100, 100).filter(lambda a: abs(a) > 1e-3), seed=st.integers(0, 1000))
def test_linear_in_the_query(a, seed):
    rng = np.random.default_rng(seed)
    t = prod.tables(32, {"bits": 3, "jl_dim": 0, "seed": seed})
    c = prod.encode(t, mx.array(_rows(rng, 1, 2, 9, 32)))
    q = _rows(rng, 1, 2, 3, 32)
    s = np.array(prod.scores(t, mx.array(q), c))
    np.testing.assert_allclose(np.array(prod.scores(t, mx.array(a * q), c)), a * s,
                               rtol=1e-5, atol=abs(a) * 1e-5 * np.abs(s).max())


@pytest.mark.parametrize("bits", [2, 3])
def test_unbiased_over_seeds(bits):
    rng = np.random.default_rng(bits)
    d = 16
    k = _rows(rng, 3, d) * np.array([[0.5], [1.0], [3.0]], np.float32)
    q = _rows(rng, 2, d)
    q[1] = 0.7 * k[1] + 0.3 * q[1]
    est, dec, res = _draws(q, k, bits, 0)
    _, var = _qr_moments(q, res, d if bits == 2 else min(d, 64))
    z = (est - q @ k.T) / np.sqrt(var)
    assert np.all(np.abs(z.mean(0)) <= 4 / math.sqrt(SEEDS))
    # decode is an unbiased estimate of k: per coordinate, Var <= (pi/2)|r|^2/m given the rotation
    m = d if bits == 2 else min(d, 64)
    sigma_k = np.sqrt(math.pi / 2 / m * (res * res).sum(-1, keepdims=True).mean(0))
    assert np.all(np.abs(dec.mean(0) - k) <= 4 * sigma_k / math.sqrt(SEEDS))


@pytest.mark.slow  # runs with --run-slow
def test_variance_bound_and_decreasing_in_m():
    rng = np.random.default_rng(5)
    d, bits = 32, 3
    k = _rows(rng, 2, d)
    q = _rows(rng, 2, d)
    q[1] = k[1] + 0.3 * q[1]
    slack = 4 * math.sqrt(2 / (SEEDS - 1))
    var = {}
    for m in (16, 64):
        est, _, res = _draws(q, k, bits, m)
        err = est - q @ k.T
        bound, exact = _qr_moments(q, res, m)
        var[m] = (err**2).mean(0)
        assert np.all(var[m] <= bound.mean(0) * (1 + slack))
        np.testing.assert_allclose(var[m], exact.mean(0), rtol=slack)
    assert np.all(var[64] < 0.5 * var[16])


def test_append_and_take():
    rng = np.random.default_rng(2)
    t = prod.tables(32, {"bits": 3, "jl_dim": 0, "seed": 0})
    k = _rows(rng, 1, 2, 10, 32)
    whole = prod.encode(t, mx.array(k))
    parts = append(prod.encode(t, mx.array(k[:, :, :4])), prod.encode(t, mx.array(k[:, :, 4:])))
    for x, y in zip(whole, parts):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    idx = mx.array(np.array([[[1, 5, 9], [0, 2, 3]]], np.int32))
    sub = prod.encode(t, mx.array(np.take_along_axis(k, np.array(idx)[..., None], axis=2)))
    for x, y in zip(take(whole, idx), sub):
        np.testing.assert_array_equal(np.array(x), np.array(y))
