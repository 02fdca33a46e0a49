"""KVQuant: a hand-computed case on every backend, no outliers as pure non-uniform
quantization, Lloyd steps that never raise the distortion, and outliers and fitted levels
beating uniform quantization on heavy tails."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import nuq

from tests._helpers import BACKENDS, _data, _errors, _planted, token_rows as rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvquant_by_hand(backend):
    # d = 8, every channel equal. Token 0 (500) is the sink; then 32 tokens 0..29, 1000, -1000.
    # 2 bits, groups of 32, outlier_fraction .05: ceil(1.6) = 2 outliers per key channel (the
    # +-1000) and ceil(.4) = 1 per value token.
    x = np.concatenate([[500], np.arange(30), [1000, -1000]]).astype(np.float32)
    kv = rows(np.repeat(x[:, None], 8, axis=1))
    st = velox.kvquant_init(1, 1, 8, bits=2, outlier_fraction=0.05, group_size=32, lloyd_iters=1,
                            n_sink=1, backend=backend)
    st = velox.kvquant_update(st, kv, kv)
    # Keys, per channel: inliers 0..29, u = t/29. Uniform start (0, 1/3, 2/3, 1): midpoints at
    # u = 1/6, 1/2, 5/6 split t into 0-4, 5-14, 15-24, 25-29; one Lloyd step moves each level
    # to its cell's mean: (2, 9.5, 19.5, 27) / 29.
    # (levels are stored in float16: within 29 x 2**-12 of these)
    assert np.allclose(np.array(st.key_levels)[0, 0, 0] * 29, [2, 9.5, 19.5, 27], atol=29 * 2 ** -12)
    assert np.array(st.key_outlier_index)[0, 0, 0, 0].tolist() == [30, 31]
    k, v = velox.kvquant_get_kv(st)
    # New midpoints (5.75, 14.5, 23.25): t 0-5 -> 2, 6-14 -> 9.5, 15-23 -> 19.5, 24-29 -> 27.
    want = np.array([500] + [2] * 6 + [9.5] * 9 + [19.5] * 9 + [27] * 6 + [1000, -1000], np.float32)
    assert np.allclose(np.array(k)[0, 0, :, 3], want, atol=29 * 2 ** -11)
    assert np.array(k)[0, 0, [0, 31, 32], 3].tolist() == [500, 1000, -1000]  # sink and outliers exact
    # Values, per token: one outlier (channel 0, the lower index among equals), 7 equal
    # inliers (range 0): exact.
    assert np.array_equal(np.array(v)[0, 0], np.array(kv)[0, 0])
    # Bytes: sink rows 2 x 8 x 4 B = 64; key codes 8 x 32 x 2 bits = 64; key scales + zeros
    # 2 x 8 x 2 B = 32 (float16); level tables 2 x 4 x 2 B = 16; key outliers 8 x 2 x (4 B + 1 B
    # index) = 80 (exact: the model's dtype); value codes 64; value scales + zeros 2 x 32 x 2 B
    # = 128; value outliers 32 x (4 + 1) = 160; next_pos 4.
    assert velox.kvquant_bytes(st) == 64 + 64 + 32 + 16 + 80 + 64 + 128 + 160 + 4


def _pure_nuq(x, bits, iters):
    """Reference composition: per-vector min/max normalization (last axis) and one Lloyd
    table per group ``x [b, h, G, m, n]``; returns the reconstruction."""
    b, h, n_g, m, n = x.shape
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    f16 = lambda a: a.astype(mx.float16).astype(mx.float32)  # noqa: E731  (side data in float16)
    s, z = f16(hi - lo)[..., None], f16(lo)[..., None]
    u = mx.where(s > 0, (x - z) / mx.where(s > 0, s, 1.0), 0.0).reshape(b, h, n_g, m * n)
    levels = nuq.lloyd(u, mx.ones(u.shape, mx.bool_), 1 << bits, iters, mx.float16)
    q = nuq.nearest(u, levels).astype(mx.int32)
    return z + s * mx.take_along_axis(levels, q, axis=-1).reshape(b, h, n_g, m, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvquant_without_outliers_is_pure_nuq(backend):
    k, v = _data(1, 2, 64, 16)
    st = velox.kvquant_init(1, 2, 16, bits=3, outlier_fraction=0.0, lloyd_iters=5, n_sink=0,
                            backend=backend)
    st = velox.kvquant_update(st, k, v)
    assert st.key_outliers.size == 0 and st.value_outliers.size == 0
    kk, vv = velox.kvquant_get_kv(st)
    want_k = _pure_nuq(k.reshape(1, 2, 2, 32, 16).swapaxes(3, 4), 3, 5).swapaxes(3, 4).reshape(1, 2, 64, 16)
    want_v = _pure_nuq(v.reshape(1, 2, 2, 32, 16), 3, 5).reshape(1, 2, 64, 16)
    assert mx.array_equal(kk, want_k).item() and mx.array_equal(vv, want_v).item()
    # No Lloyd step keeps the uniform grid: min/max quantization with 2**bits levels.
    st = velox.kvquant_update(velox.kvquant_init(1, 2, 16, bits=2, outlier_fraction=0.0, lloyd_iters=0,
                                                 n_sink=0, backend=backend), k, v)
    want = (np.array([0, 1, 2, 3], np.float32) / 3).astype(np.float16)
    assert np.array_equal(np.array(st.key_levels)[0, 0, 0], want)


def test_lloyd_distortion_never_increases():
    # Each Lloyd step (nearest-level assignment, then cell means) cannot raise the squared
    # error of the points to their levels; the sums are exact fixed point (2**-30), so allow
    # that much per point.
    rng = np.random.default_rng(11)
    u = mx.array(rng.beta(0.5, 2.0, (4, 512)).astype(np.float32))   # skewed, like normalized keys
    valid = mx.array(rng.random((4, 512)) > 0.05)
    w = np.array(valid, np.float32)
    dists = []
    for iters in range(10):  # iters = 0: the uniform grid
        lv = nuq.lloyd(u, valid, 8, iters, mx.float32)
        q = nuq.nearest(u, lv).astype(mx.int32)
        dists.append((np.array((u - mx.take_along_axis(lv, q, axis=-1)) ** 2) * w).sum(axis=-1))
        if iters:
            assert (dists[-1] <= dists[-2] + 512 * 2.0 ** -29).all(), (iters, dists[-2:])
    assert (dists[-1] < 0.8 * dists[0]).all()  # and the fitted levels beat the uniform grid


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kvquant_outliers_and_levels_beat_uniform_on_heavy_tails(bits):
    k, v = _planted(heavy=True, seed=5)
    uniform = _errors("kvquant", k, v, bits=bits, outlier_fraction=0.0, lloyd_iters=0, n_sink=0)
    levels = _errors("kvquant", k, v, bits=bits, outlier_fraction=0.0, n_sink=0)
    both = _errors("kvquant", k, v, bits=bits, n_sink=0)
    for i in range(2):  # keys, values
        mse = [float((e[i] ** 2).mean()) for e in (uniform, levels, both)]
        assert mse[1] < mse[0] and mse[2] < mse[1], mse
