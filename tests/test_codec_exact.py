"""Tiny codec cases worked out by hand, with hand-built tables (identity rotation, a chosen
sketch), so every number below follows from the formulas in the comments."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from velox.codecs import polar, prod, qjl, spectral, turboquant


def _rows(*vals):
    return mx.array(np.array(vals, np.float32)[None, None])  # [1, 1, n, d]


def test_turboquant_mse_one_bit_by_hand():
    # d = 4, identity rotation, 1 bit: the Gaussian Lloyd-Max centroids are -c and +c with
    # c = sqrt(2/pi) = 0.797885, the boundary 0. x = (2, -2, 2, -2): ||x|| = 4, the unit-variance
    # coordinates y = x / 4 * sqrt(4) = (1, -1, 1, -1) code as (1, 0, 1, 0), packed 1 bit each
    # into one word: 0b0101. Decode: +-c * 4 / sqrt(4) = +-2c = +-1.595769.
    # Scores: q = (1, 0, 0, 0) reads 2c; q = (1, 1, 0, 0) reads 2c - 2c = 0.
    t = turboquant.mse_tables(4, 1)._replace(rotation=mx.eye(4))
    c = math.sqrt(2 / math.pi)
    codes = turboquant.mse_encode(t, _rows([2.0, -2.0, 2.0, -2.0]))
    assert float(codes.norm[0, 0, 0]) == 4.0
    assert int(np.array(codes.idx)[0, 0, 0, 0]) == 0b0101
    dec = np.array(turboquant.mse_decode(t, codes))[0, 0, 0]
    assert np.allclose(dec, [2 * c, -2 * c, 2 * c, -2 * c], atol=1e-6)
    q = mx.array(np.array([[[[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]]], np.float32))
    assert np.allclose(np.array(turboquant.mse_scores(t, q, codes))[0, 0, :, 0], [2 * c, 0.0], atol=1e-6)


def test_qjl_by_hand():
    # d = 2, m = 2, S = I (rows 2..31 zero padding): k = (3, -4): sign(S k) = (+, -), ||k|| = 5.
    # Estimate of <q, k> = sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>:
    #   q = (2, 0): sqrt(pi/2) / 2 * 5 * (2 * 1 + 0 * -1) = 5 sqrt(pi/2) = 6.266571 (exact: 6)
    #   q = (1, 1): sqrt(pi/2) / 2 * 5 * (1 - 1) = 0 (exact: -1)
    # Decode: sqrt(pi/2) / 2 * 5 * S^T sign = (3.133285, -3.133285).
    t = qjl.tables(2, {"jl_dim": 2, "seed": 0})
    sketch = np.zeros(np.array(t.sketch).shape, np.float32)
    sketch[0, 0] = sketch[1, 1] = 1.0
    t = t._replace(sketch=mx.array(sketch))
    codes = qjl.encode(t, _rows([3.0, -4.0]))
    q = mx.array(np.array([[[[2.0, 0.0], [1.0, 1.0]]]], np.float32))
    s = np.array(qjl.scores(t, q, codes))[0, 0, :, 0]
    k = math.sqrt(math.pi / 2) / 2 * 5
    assert np.allclose(s, [2 * k, 0.0], atol=1e-5)
    assert np.allclose(np.array(qjl.decode(t, codes))[0, 0, 0], [k, -k], atol=1e-5)
    assert np.array_equal(np.array(codes.signs)[0, 0, 0], [0b01])  # bit j set when (S k)_j > 0


def test_turboquant_prod_by_hand():
    # bits = 2: the MSE stage at 1 bit, QJL of the residual. d = 2, identity rotation, S = I.
    # x = (3, -4): y = x / 5 * sqrt(2) = (0.8485, -1.1314) codes (1, 0); x_mse = c * (1, -1) * 5
    # / sqrt(2) = (2.820948, -2.820948) with c = sqrt(2/pi). r = x - x_mse = (0.179052,
    # -1.179052): sign(S r) = (+, -); the estimate of <q, x> is <q, x_mse> + sqrt(pi/2) / 2 *
    # ||r|| * <S q, sign(S r)>, for q = (1, 0): 2.820948 + sqrt(pi/2) / 2 * 1.192570.
    t = prod.tables(2, {"bits": 2, "jl_dim": 2, "seed": 0})
    eye_pad = np.zeros(np.array(t.sketch).shape, np.float32)
    eye_pad[0, 0] = eye_pad[1, 1] = 1.0
    t = t._replace(rotation=mx.eye(2), sketch=mx.array(eye_pad))
    codes = prod.encode(t, _rows([3.0, -4.0]))
    q = mx.array(np.array([[[[1.0, 0.0]]]], np.float32))
    c = math.sqrt(2 / math.pi)
    x_mse = c * 5 / math.sqrt(2)
    r = np.array([3.0 - x_mse, -4.0 + x_mse])
    want = x_mse + math.sqrt(math.pi / 2) / 2 * np.linalg.norm(r)
    got = float(prod.scores(t, q, codes)[0, 0, 0, 0])
    # the stored norms are float16: ||x|| = 5 exactly, ||r|| = 1.19257 to float16's 1e-3
    assert abs(got - want) < 2e-3, (got, want)


def test_polar_by_hand():
    # d = block = 4 (two levels), identity rotation, level-1 angles at 2 bits, level 2 at 1 bit.
    # Level 1: the angle of (y[2i], y[2i+1]) in [0, 2 pi), uniform cells of pi/2: code k for
    # [k pi/2, (k+1) pi/2), centroid (k + 1/2) pi/2. Level 2: psi = atan(r1 / r0) in [0, pi/2]
    # with density prop. to sin(2 psi) (2^(2-1) - 1 = 1); at 1 bit its Lloyd-Max cells split at
    # pi/4 (symmetry) and the lower centroid is int_0^{pi/4} psi sin 2psi / int_0^{pi/4} sin 2psi
    # = (1/4) / (1/2) = 1/2 rad, the upper pi/2 - 1/2.
    # x = (3, 4, 8, -6): pair (3, 4) has r0 = 5 and angle atan2(4, 3) = 0.927 -> code 0;
    # pair (8, -6) has r1 = 10 and angle 2 pi - atan(6/8) = 5.640 -> code 3; psi = atan(10/5)
    # = 1.107 > pi/4 -> code 1; the block's radius sqrt(125) is stored in float16.
    # Bit stream (little-endian, level 1 first): 0 -> 00, 3 -> 11, 1 -> 1: 0b11100 = 28.
    t = polar.tables(4, {"bits": 1, "level1_bits": 2, "block": 4})._replace(rotation=mx.eye(4))
    codes = polar.encode(t, _rows([3.0, 4.0, 8.0, -6.0]))
    R = float(np.float16(math.sqrt(125.0)))
    assert float(codes.radii[0, 0, 0, 0]) == R
    assert np.array(codes.angles)[0, 0, 0].tolist() == [0b11100]
    # decode: down the tree, r0' = R cos(pi/2 - 1/2) = R sin(1/2), r1' = R sin(pi/2 - 1/2)
    # = R cos(1/2); then each pair at its level-1 centroid, pi/4 and 7 pi/4.
    r0, r1 = R * math.sin(0.5), R * math.cos(0.5)
    h = math.sqrt(0.5)
    want = [r0 * h, r0 * h, r1 * h, -r1 * h]
    dec = np.array(polar.decode(t, codes))[0, 0, 0]
    assert np.allclose(dec, want, atol=2e-5), (dec, want)
    assert abs(np.linalg.norm(dec) - R) < 1e-5  # the decoded block's norm is its stored radius
    # scores: q = (1, 0, 0, 0) reads r0 / sqrt 2; q = (0, 0, 1, -1) reads sqrt(2) r1
    q = mx.array(np.array([[[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, -1.0]]]], np.float32))
    got = np.array(polar.scores(t, q, codes))[0, 0, :, 0]
    assert np.allclose(got, [r0 * h, math.sqrt(2) * r1], atol=2e-5), got


def test_turboquant_rvq_by_hand():
    # d = 4, identity rotation, bits = 1 for both stages. Stage 1: Gaussian Lloyd-Max at 1 bit,
    # centroids +-c, c = sqrt(2/pi), boundary 0. Stage 2: Laplacian (unit variance, scale
    # beta = 1/sqrt 2) at 1 bit: the centroids are the half-line means +-beta = +-1/sqrt 2.
    # x = (3, -1, 1, -1): ||x|| = sqrt 12; y = x / ||x|| * sqrt 4 = x / sqrt 3
    # = (1.7321, -0.5774, 0.5774, -0.5774) -> idx1 = (1, 0, 1, 0), packed 1 bit each (zero
    # padded to 32 indices, one word): 0b0101.
    t = turboquant.rvq_tables(4, 1)._replace(rotation=mx.eye(4))
    codes = turboquant.rvq_encode(t, _rows([3.0, -1.0, 1.0, -1.0]))
    c, beta = math.sqrt(2 / math.pi), math.sqrt(0.5)
    y = np.array([3.0, -1.0, 1.0, -1.0]) / math.sqrt(3)
    c1 = c * np.array([1, -1, 1, -1])
    e = y - c1                                  # (0.9342, 0.2205, -0.2205, 0.2205)
    # z = e / rms(e) keeps e's signs: idx2 = (1, 1, 0, 1) -> 0b1011; c2 = beta (1, 1, -1, 1)
    c2 = beta * np.array([1, 1, -1, 1])
    gain = e @ c2 / (c2 @ c2)                   # least squares: 1.5957 beta / (4 beta^2) = 0.5642
    assert np.array(codes.idx)[0, 0, 0].tolist() == [0b0101]
    assert np.array(codes.res_idx)[0, 0, 0].tolist() == [0b1011]
    assert float(codes.norm[0, 0, 0]) == float(np.float16(math.sqrt(12)))
    assert float(codes.gain[0, 0, 0]) == float(np.float16(gain))
    # stage 2 lowers the row's error: ||e - g c2||^2 = ||e||^2 - <e, c2>^2 / ||c2||^2
    left = np.sum((e - gain * c2) ** 2)
    assert math.isclose(left, np.sum(e ** 2) - (e @ c2) ** 2 / (c2 @ c2), rel_tol=1e-12)
    assert left < np.sum(e ** 2)
    # decode: (c1 + g c2) * ||x|| / sqrt(4), with the float16 norm and gain
    n16, g16 = float(np.float16(math.sqrt(12))), float(np.float16(gain))
    want = (c1 + g16 * c2) * n16 / 2
    dec = np.array(turboquant.rvq_decode(t, codes))[0, 0, 0]
    assert np.allclose(dec, want, atol=1e-6), (dec, want)
    q = mx.array(np.array([[[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]]], np.float32))
    got = np.array(turboquant.rvq_scores(t, q, codes))[0, 0, :, 0]
    assert np.allclose(got, [want[0], want[1] + want[2]], atol=1e-6), got


def test_spectral_by_hand():
    # d = 4, identity basis (params["rotation"] = I), isotropic spreads s_j = 1/sqrt(4) = 1/2,
    # 1 bit a coordinate (centroids +-c, c = sqrt(2/pi)), d_eff = 2 signal coordinates, QJL
    # with m = 2 and S = I on them.
    # x = (3, -3, 1, -1): y = x, ||x|| = sqrt 20 (float16 n), u_j = y_j / (n s_j) codes
    # (1, 0, 1, 0), one bit stream: 0b0101. Scalar stage: y^ = c n / 2 (1, -1, 1, -1).
    # Signal residual r = y[:2] - y^[:2] = (3 - a, -3 + a), a = c n / 2 = 1.7841:
    # sign(S r) = (+, -) -> bits 0b01; ||r|| in float16. QJL fixes the signal coordinates:
    # y^[:2] + sqrt(pi/2) / m * ||r|| * S^T sign(S r); the others stay +-a.
    t = spectral.tables(4, {"bits": 1, "d_eff": 2, "jl_dim": 2, "rotation": np.eye(4)})
    t = t._replace(sketch=mx.eye(2))
    codes = spectral.encode(t, _rows([3.0, -3.0, 1.0, -1.0]))
    c = math.sqrt(2 / math.pi)
    n = float(np.float16(math.sqrt(20)))
    a = c * n / 2
    r = np.array([3.0 - a, -3.0 + a])
    rn = float(np.float16(np.linalg.norm(r)))
    k = math.sqrt(math.pi / 2) / 2 * rn
    assert float(codes.norms[0, 0, 0]) == n
    assert np.array(codes.codes)[0, 0, 0].tolist() == [0b0101]
    assert np.array(codes.signs)[0, 0, 0].tolist() == [0b01]
    assert float(codes.rnorms[0, 0, 0, 0]) == rn
    want = [a + k, -a - k, a, -a]               # (2.8617, -2.8617, 1.7841, -1.7841)
    dec = np.array(spectral.decode(t, codes))[0, 0, 0]
    assert np.allclose(dec, want, atol=1e-5), (dec, want)
    # scores: the scalar part plus sqrt(pi/2) / m * ||r|| * <S q[:2], sign(S r)>
    # q = (1, 0, 0, 0): a + k; q = (0, 0, 1, 0): a (no signal part, no QJL term);
    # q = (1, 1, 0, 0): (a - a) + k (1 - 1) = 0.
    q = mx.array(np.array([[[[1.0, 0, 0, 0], [0, 0, 1.0, 0], [1.0, 1.0, 0, 0]]]], np.float32))
    got = np.array(spectral.scores(t, q, codes))[0, 0, :, 0]
    assert np.allclose(got, [a + k, a, 0.0], atol=1e-5), got
    # without QJL the signal coordinates keep the scalar stage's +-a
    t0 = spectral.tables(4, {"bits": 1, "d_eff": 2, "apply_qjl": False, "rotation": np.eye(4)})
    dec0 = np.array(spectral.decode(t0, spectral.encode(t0, _rows([3.0, -3.0, 1.0, -1.0]))))
    assert np.allclose(dec0[0, 0, 0], [a, -a, a, -a], atol=1e-6)
