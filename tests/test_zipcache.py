"""ZipCache: a hand-computed case on every backend, all or no salient tokens as uniform
quantization, and the attended tokens kept at high bits."""

import math

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import quant

from tests._helpers import (BACKENDS, _data, _uniform_keys, token_rows as rows,
                            feed_in_chunks as feed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zipcache_by_hand(backend):
    # d = 32, groups of 8, hi_fraction 1/8 -> 1 salient token per group. Keys are zero except
    # k2 = [20, 0, ...]; every query is [1, 0, ...], so query t sees logits 0 except 20/sqrt(32)
    # on t2: e = exp(20 / sqrt(32)) ~ 34.3.
    d, e = 32, math.exp(20 / math.sqrt(32))
    k = np.zeros((8, d), np.float32)
    k[2, 0] = 20
    q = np.zeros((8, d), np.float32)
    q[:, 0] = 1
    v = np.arange(8 * d, dtype=np.float32).reshape(8, d) % 7
    st = velox.zipcache_init(1, 1, d, hi_bits=4, lo_bits=2, hi_fraction=0.125, group_size=8,
                             backend=backend)
    st = velox.zipcache_update(st, rows(k[:4]), rows(v[:4]), queries=rows(q[:4]))
    # Attention received so far (queries 0..3): t0 gets 1 (query 0 sees only t0), 1/2, then
    # 1/(e+2) and 1/(e+3); t1 1/2 + 1/(e+2) + 1/(e+3); t2 e/(e+2) + e/(e+3); t3 1/(e+3).
    want = [1 + 1 / 2 + 1 / (e + 2) + 1 / (e + 3), 1 / 2 + 1 / (e + 2) + 1 / (e + 3),
            e / (e + 2) + e / (e + 3), 1 / (e + 3)]
    assert np.allclose(np.array(st.buffer_scores)[0, 0], want, rtol=1e-5)
    st = velox.zipcache_update(st, rows(k[4:]), rows(v[4:]), queries=rows(q[4:]))
    # Normalized by the queries that could attend each token (8, 7, ..., 1): t0 ~ (1.5 + 6 x
    # 0.027) / 8 = 0.21, t2 ~ (6 x 0.9) / 6 = 0.9 > everyone else (t7: 1/(e+7)/1 = 0.024).
    assert np.array(st.salient).tolist() == [[[[2]]]]
    kk, vv = velox.zipcache_get_kv(st)
    # The salient set is one token: per channel its range is a point, so it is exact; the
    # other seven keys are zero, exact too.
    assert np.array_equal(np.array(kk)[0, 0], k)
    # Bytes: key codes 1 x 32 x 4 bits = 16 and 7 x 32 x 2 bits = 56, per-channel scales and
    # zeros of both sets 4 x 32 x 2 B = 256 (float16), the salient index 1, value codes 16 + 56,
    # value channel factors 32 x 2 B = 64, per-token value scales + zeros 2 x 8 x 2 B = 32,
    # next_pos 4.
    assert velox.zipcache_bytes(st) == 16 + 56 + 256 + 1 + 16 + 56 + 64 + 32 + 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fraction,bits", [(0.0, 2), (1.0, 4)])
def test_zipcache_all_or_none_salient_is_uniform(backend, fraction, bits):
    # hi_fraction 0: every token at lo_bits; 1: every token at hi_bits. Keys per channel over
    # each group; values channel-separable token-wise: v / c, c = sqrt(max |v|) per group.
    k, v = _data(1, 2, 48, 32, seed=1)
    st = velox.zipcache_init(1, 2, 32, hi_bits=4, lo_bits=2, hi_fraction=fraction, group_size=16,
                             backend=backend)
    st = feed(velox.zipcache_update, st, k, v, [17, 1, 30])
    kk, vv = velox.zipcache_get_kv(st)
    assert mx.array_equal(kk, _uniform_keys(k, bits, 16)).item()
    c = mx.sqrt(mx.abs(v).reshape(1, 2, 3, 16, 32).max(axis=3, keepdims=True))
    c = c.astype(mx.float16).astype(mx.float32)  # the stored (float16) channel factors
    y = (v.reshape(1, 2, 3, 16, 32) / c).reshape(1, 2, 48, 32)
    yq = quant.dequantize(*quant.quantize(y, bits, 32), bits, 32, mx.float32).reshape(1, 2, 3, 16, 32)
    want_v = (yq * c).reshape(1, 2, 48, 32)
    assert mx.array_equal(vv, want_v).item()
    assert (st.key_hi_codes.size == 0) == (fraction == 0.0)
    assert (st.key_lo_codes.size == 0) == (fraction == 1.0)


def test_zipcache_salient_tokens_are_the_attended_ones_at_high_bits():
    # Planted heavy hitters: 4 tokens of each 32 whose keys align with every query.
    rng = np.random.default_rng(8)
    n, d = 128, 64
    k = rng.standard_normal((1, 1, n, d)).astype(np.float32)
    q = np.zeros((1, 1, n, d), np.float32)
    q[..., 0] = 3
    hot = np.concatenate([g * 32 + rng.choice(np.arange(8, 32), 4, replace=False) for g in range(4)])
    k[:, :, hot, 0] = 8
    k, q = mx.array(k), mx.array(q)
    st = velox.zipcache_init(1, 1, d, hi_bits=8, lo_bits=2, hi_fraction=0.125, group_size=32)
    st = velox.zipcache_update(st, k, k, queries=q)
    sal = np.sort((np.array(st.salient)[0, 0] + np.arange(0, n, 32)[:, None]).ravel())
    assert sal.tolist() == sorted(hot.tolist())
    err = np.abs(np.array(velox.zipcache_get_kv(st)[0]) - np.array(k))[0, 0]
    cold = np.setdiff1d(np.arange(n), hot)
    assert err[hot].mean() < 0.1 * err[cold].mean()
