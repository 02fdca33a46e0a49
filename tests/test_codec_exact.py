"""Tiny codec cases worked out by hand, with hand-built tables (identity rotation, a chosen
sketch), so every number below follows from the formulas in the comments."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from velox.codecs import prod, qjl, turboquant


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
