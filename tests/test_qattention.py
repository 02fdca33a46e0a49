"""Attention over stored segments (``velox.qattention``): blocks of query rows on the codes,
and a chunk's fused attention over the dequantized rows.

``attend_blocks`` scores a chunk's queries in blocks sized so one block's logits stay within
``TILE_BYTES``; the result must not depend on the block size. It, and ``attend_segments``
(which runs a chunk of several queries as the fused attention over the dequantized
segments), must equal dense attention over the dequantized segments plus the new tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from velox import qattention
from velox.qattention import Affine, AffineRows, Dense, attend_blocks, attend_segments, query_block


def _segments(b, h, d, n1, n2, n3, seed):
    rng = np.random.default_rng(seed)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))
    dense = Dense(f(b, h, n1, d), f(b, h, n1, d))
    # KIVI's layout: keys grouped along tokens ([b, h, d, n]), values along channels
    kt, vt = f(b, h, d, n2), f(b, h, n2, d)
    kc, ks, kz = mx.quantize(kt, group_size=32, bits=4)
    vc, vs, vz = mx.quantize(vt, group_size=32, bits=4)
    affine = Affine(kc, ks, kz, vc, vs, vz, 4, 32)
    kr, vr = f(b, h, n3, d), f(b, h, n3, d)
    rc, rs, rz = mx.quantize(kr, group_size=32, bits=2)
    wc, ws, wz = mx.quantize(vr, group_size=32, bits=2)
    rows = AffineRows(rc, rs, rz, wc, ws, wz, 2, 32)
    # the dense keys and values every segment stands for
    k_all = mx.concatenate([dense.keys, mx.dequantize(kc, ks, kz, group_size=32, bits=4).swapaxes(-1, -2),
                            mx.dequantize(rc, rs, rz, group_size=32, bits=2)], axis=2)
    v_all = mx.concatenate([dense.values, mx.dequantize(vc, vs, vz, group_size=32, bits=4),
                            mx.dequantize(wc, ws, wz, group_size=32, bits=2)], axis=2)
    return [dense, affine, rows], k_all, v_all


def _dense_attention(q, k_all, v_all, keys, values, scale, causal):
    b, hq, s, d = q.shape
    h = keys.shape[1]
    g = hq // h
    K = np.concatenate([np.array(k_all), np.array(keys)], axis=2)
    V = np.concatenate([np.array(v_all), np.array(values)], axis=2)
    Q = np.array(q).reshape(b, h, g, s, d) * scale
    logits = np.einsum("bhgsd,bhnd->bhgsn", Q, K)
    n = K.shape[2] - s
    if causal:
        vis = np.arange(s)[None, :] <= np.arange(s)[:, None]
        logits[..., n:] = np.where(vis, logits[..., n:], -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhgsn,bhnd->bhgsd", p, V).reshape(b, hq, s, d)


@pytest.mark.parametrize("s,causal", [(1, False), (7, True), (16, True)])
def test_blocks_of_query_rows_equal_one_block_and_dense_attention(monkeypatch, s, causal):
    b, h, g, d = 2, 2, 3, 64
    segs, k_all, v_all = _segments(b, h, d, 5, 64, 3, seed=s)
    rng = np.random.default_rng(100 + s)
    q = mx.array(rng.standard_normal((b, h * g, s, d)).astype(np.float32))
    keys = mx.array(rng.standard_normal((b, h, s, d)).astype(np.float32))
    values = mx.array(rng.standard_normal((b, h, s, d)).astype(np.float32))
    mask = "causal" if causal else None
    whole = attend_blocks(q, segs, keys, values, scale=0.125, mask=mask)
    fused = attend_segments(q, segs, keys, values, scale=0.125, mask=mask)
    n = k_all.shape[2] + s
    # blocks of 2 query rows per kv head (g * s rows in all)
    monkeypatch.setattr(qattention, "TILE_BYTES", 4 * b * h * n * 2)
    assert query_block(b * h, n, g * s) == min(2, g * s)
    blocked = attend_blocks(q, segs, keys, values, scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(blocked), np.array(whole), rtol=1e-5, atol=1e-6)
    ref = _dense_attention(q, k_all, v_all, keys, values, 0.125, causal)
    np.testing.assert_allclose(np.array(whole), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(fused), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_a_chunk_over_a_bfloat16_model_and_float16_rows(causal):
    """The fused chunk path casts the dequantized rows to the queries' dtype and agrees with
    the blockwise path on the codes (bfloat16 rounding)."""
    b, h, g, d, s = 1, 2, 2, 64, 9
    segs, k_all, v_all = _segments(b, h, d, 4, 32, 2, seed=7)
    segs = [Dense(segs[0].keys.astype(mx.float16), segs[0].values.astype(mx.float16))] + segs[1:]
    rng = np.random.default_rng(5)
    f = lambda *sh: mx.array(rng.standard_normal(sh).astype(np.float32)).astype(mx.bfloat16)
    q, keys, values = f(b, h * g, s, d), f(b, h, s, d), f(b, h, s, d)
    mask = "causal" if causal else None
    fused = attend_segments(q, segs, keys, values, scale=0.125, mask=mask)
    blocks = attend_blocks(q, segs, keys, values, scale=0.125, mask=mask)
    assert fused.dtype == blocks.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(fused.astype(mx.float32)), np.array(blocks.astype(mx.float32)),
                               rtol=3e-2, atol=3e-2)


def test_query_block_bounds():
    assert query_block(8, 32768, 4096, tile_bytes=64 << 20) == 64  # 64 MiB / (8 * 32768 * 4 B)
    assert query_block(8, 10, 4, tile_bytes=64 << 20) == 4         # never more than the rows
    assert query_block(256, 1 << 20, 4, tile_bytes=1 << 20) == 1   # at least one row


def test_output_takes_the_queries_dtype_with_segments_of_another_dtype():
    """A bfloat16 model over float16 residual rows (KIVI's default residual dtype) gets
    bfloat16 back: the next layer's keys must not turn float32."""
    b, h, d = 1, 2, 64
    segs, _, _ = _segments(b, h, d, 4, 32, 2, seed=3)
    segs = [Dense(segs[0].keys.astype(mx.float16), segs[0].values.astype(mx.float16))] + segs[1:]
    q = mx.ones((b, 2 * h, 1, d), mx.bfloat16)
    k = mx.ones((b, h, 1, d), mx.bfloat16)
    out = attend_segments(q, segs, k, k, scale=0.125)
    assert out.dtype == mx.bfloat16
