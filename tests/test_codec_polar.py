"""PolarQuant codec (velox.codecs.polar): radii, codebooks, packing, twins, bytes."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from velox.codecs import codes_nbytes, get_codec, numpy_tables, polar

PAPER = dict(bits=2, level1_bits=4, block=16, seed=42)


def _rows(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def test_registered():
    c = get_codec("polar")
    assert c.encode is polar.encode and set(c.params) == {"bits", "level1_bits", "block", "seed"}


def test_rotation_orthogonal():
    for d in (8, 16, 32, 64, 128):
        r = np.array(polar.tables(d, dict(PAPER, block=min(16, d))).rotation, np.float64)
        np.testing.assert_allclose(r.T @ r, np.eye(d), atol=1e-5)


@given(d=st.sampled_from([8, 16, 32, 64, 128]), block=st.sampled_from([2, 4, 8, 16]),
       bits=st.integers(1, 4), l1=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_radius_exact_codes_in_range(d, block, bits, l1, seed):
    block = min(block, d)
    p = dict(bits=bits, level1_bits=l1, block=block, seed=seed % 1000)
    t = polar.tables(d, p)
    x = _rows((1, 2, 5, d), seed, scale=3.0)
    c = polar.encode(t, mx.array(x))
    # the block radii are the rotated blocks' norms, to float16
    y = x @ np.array(t.rotation).T
    norms = np.linalg.norm(y.reshape(1, 2, 5, d // block, block), axis=-1)
    np.testing.assert_allclose(np.array(c.radii, np.float32),
                               norms.astype(np.float16).astype(np.float32))
    # the decoded blocks (rotated basis) have exactly the stored radius
    yh = np.array(polar._decode_rotated(t, c)).reshape(1, 2, 5, d // block, block)
    np.testing.assert_allclose(np.linalg.norm(yh, axis=-1), np.array(c.radii, np.float32), rtol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(np.array(polar.decode(t, c)), axis=-1),
                               np.linalg.norm(np.array(c.radii, np.float32), axis=-1), rtol=1e-5)
    # codes in range, and pack/unpack exact
    counts, widths = zip(*polar._widths(t))
    lv = polar.unpack_codes(c.angles, list(counts), list(widths))
    for codes, w in zip(lv, widths):
        assert int(mx.max(codes)) < 2 ** w
    again = polar.pack_codes(lv, list(widths))
    assert np.array_equal(np.array(again), np.array(c.angles))


def test_angle_within_half_cell():
    """Every decoded angle is its level's centroid, within half the cell of the true angle."""
    t = polar.tables(16, dict(bits=3, level1_bits=4, block=16, seed=3))
    x = _rows((1, 1, 200, 16), 5)
    y = x @ np.array(t.rotation).T
    codes, _ = polar._angle_codes_np(numpy_tables(t), y)
    theta = np.mod(np.arctan2(y[..., 1::2], y[..., 0::2]), 2 * np.pi)
    c1, _ = polar.angle_codebook(1, 4)
    assert np.all(np.abs(theta - c1[codes[0]]) <= np.pi / 16 + 1e-6)
    r = np.hypot(y[..., 0::2], y[..., 1::2])
    for lv in range(2, 5):
        psi = np.arctan2(r[..., 1::2], r[..., 0::2])
        c, b = polar.angle_codebook(lv, 3)
        edges = np.concatenate([[0.0], b, [np.pi / 2]])
        k = codes[lv - 1]
        assert np.all((psi >= edges[k] - 1e-6) & (psi <= edges[k + 1] + 1e-6))
        r = np.hypot(r[..., 0::2], r[..., 1::2])


def test_codebook_is_lloyd_max_of_the_level_density():
    """Centroids are the cell means of sin(2 psi)^(2^(l-1)-1); they concentrate near pi/4."""
    for lv in (2, 3, 4):
        c, b = polar.angle_codebook(lv, 2)
        g = np.linspace(0, np.pi / 2, 400001)[1:-1]
        w = np.sin(2 * g) ** (2 ** (lv - 1) - 1)
        edges = np.concatenate([[0.0], b, [np.pi / 2]])
        for k in range(4):
            m = (g >= edges[k]) & (g < edges[k + 1])
            assert abs((w[m] * g[m]).sum() / w[m].sum() - c[k]) < 1e-4
        np.testing.assert_allclose(c + c[::-1], np.pi / 2, atol=1e-6)   # symmetric about pi/4
    spread = [np.ptp(polar.angle_codebook(lv, 2)[0]) for lv in (2, 3, 4, 5)]
    assert all(a > b for a, b in zip(spread, spread[1:]))


@pytest.mark.slow  # runs with --run-slow
def test_error_decreases_with_bits_and_high_bits_recover_x():
    x = _rows((1, 2, 64, 64), 1)
    errs = []
    for bits in range(1, 9):
        t = polar.tables(64, dict(bits=bits, level1_bits=bits, block=16, seed=0))
        xh = np.array(polar.decode(t, polar.encode(t, mx.array(x))))
        errs.append(np.sum((xh - x) ** 2) / np.sum(x ** 2))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 1e-4
    t = polar.tables(64, dict(bits=8, level1_bits=8, block=16, seed=0))
    np.testing.assert_allclose(np.array(polar.decode(t, polar.encode(t, mx.array(x)))), x, atol=0.05)


def test_paper_config_error():
    """Block 16 at 4/2/2/2 bits on Gaussian rows: relative MSE about 0.03 (loose bound)."""
    t = polar.tables(128, PAPER)
    x = _rows((1, 4, 64, 128), 2)
    xh = np.array(polar.decode(t, polar.encode(t, mx.array(x))))
    assert np.sum((xh - x) ** 2) / np.sum(x ** 2) < 0.05


def test_determinism_per_seed():
    x = mx.array(_rows((1, 2, 8, 32), 4))
    a = polar.encode(polar.tables(32, dict(PAPER, seed=7)), x)
    b = polar.encode(polar.tables(32, dict(PAPER, seed=7)), x)
    c = polar.encode(polar.tables(32, dict(PAPER, seed=8)), x)
    assert all(np.array_equal(np.array(u), np.array(v)) for u, v in zip(a, b))
    assert not np.array_equal(np.array(a.angles), np.array(c.angles))


@given(d=st.sampled_from([8, 16, 32, 64, 128]), bits=st.integers(1, 8), l1=st.integers(1, 8),
       seed=st.integers(0, 999))
def test_mx_equals_np(d, bits, l1, seed):
    p = dict(bits=bits, level1_bits=l1, block=min(16, d), seed=seed)
    t = polar.tables(d, p)
    tn = numpy_tables(t)
    x = _rows((2, 2, 6, d), seed)
    # the same rotated rows give the same codes (products and comparisons only)
    y = x @ tn.rotation.T
    cm, rm = polar._angle_codes(t, mx.array(y))
    cn, rn = polar._angle_codes_np(tn, y)
    for a, b in zip(cm, cn):
        assert np.array_equal(np.array(a), b)
    assert np.array_equal(np.array(rm), rn)
    # whole pipeline: the rotation matmul may round differently, so codes agree almost always
    c, c_np = polar.encode(t, mx.array(x)), polar.encode_np(tn, x)
    assert np.mean(np.array(c.angles) == c_np.angles) > 0.99
    np.testing.assert_allclose(np.array(c.radii, np.float32), c_np.radii.astype(np.float32), rtol=1e-3)
    # decode and scores of the same codes agree
    np.testing.assert_allclose(np.array(polar.decode(t, c)), polar.decode_np(tn, c), atol=1e-5)
    q = _rows((2, 2, 3, d), seed + 1)
    np.testing.assert_allclose(np.array(polar.scores(t, mx.array(q), c)), polar.scores_np(tn, q, c),
                               rtol=1e-4, atol=1e-4)


def test_scores_are_dot_with_decoded_keys():
    t = polar.tables(64, PAPER)
    k, q = _rows((1, 2, 10, 64), 6), _rows((1, 2, 3, 64), 7)
    c = polar.encode(t, mx.array(k))
    want = q @ np.swapaxes(np.array(polar.decode(t, c)), -1, -2)
    np.testing.assert_allclose(np.array(polar.scores(t, mx.array(q), c)), want, rtol=1e-4, atol=1e-4)


def test_bytes_formula():
    # the paper: block 16, 4 bits at level 1, 2 bits above, fp16 radius: 3.875 bits/coordinate
    assert polar.bytes_per_row(128, PAPER) * 8 / 128 == 3.875
    for d in (8, 16, 32, 64, 128):
        for block, bits, l1 in ((min(16, d), 2, 4), (2, 3, 3), (min(8, d), 5, 7)):
            p = dict(bits=bits, level1_bits=l1, block=block, seed=0)
            t = polar.tables(d, p)
            c = polar.encode(t, mx.array(_rows((1, 3, 5, d))))
            angle_bits = d // 2 * l1 + (d // 2 - d // block) * bits
            per_row = math.ceil(angle_bits / 8) + 2 * (d // block)
            assert per_row == polar.bytes_per_row(d, p)
            assert codes_nbytes(c) == 15 * per_row
            assert c.angles.dtype == mx.uint8 and c.radii.dtype == mx.float16


def test_any_head_dim_divisible_by_block_and_errors():
    t = polar.tables(48, dict(PAPER))
    x = _rows((1, 1, 4, 48))
    assert polar.decode(t, polar.encode(t, mx.array(x))).shape == (1, 1, 4, 48)
    with pytest.raises(ValueError, match="divide"):
        polar.tables(40, dict(PAPER))
    with pytest.raises(ValueError, match="power of two"):
        polar.tables(48, dict(PAPER, block=12))


def test_zero_row():
    t = polar.tables(16, PAPER)
    c = polar.encode(t, mx.zeros((1, 1, 1, 16)))
    assert np.array_equal(np.array(polar.decode(t, c)), np.zeros((1, 1, 1, 16), np.float32))
