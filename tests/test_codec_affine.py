"""The per-token affine codec: codes equal to the NumPy twin, error within the bound, rows
independent, bytes as packed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from velox import quant
from velox.codecs import get_codec, numpy_tables, take
from velox.codecs import affine


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_codes_match_numpy_and_error_is_bounded(bits, dtype):
    rng = np.random.default_rng(bits)
    x = mx.array(rng.normal(size=(2, 3, 7, 64)).astype(np.float32)).astype(quant.dtype_of(dtype))
    codec = get_codec("affine")
    t = codec.tables(64, dict(bits=bits, group_size=32, dtype=dtype))
    c = codec.encode(t, x)
    cn = codec.encode_np(numpy_tables(t), np.array(x.astype(mx.float32)))
    assert np.array_equal(np.array(c.codes), cn.codes)
    assert np.array_equal(np.array(c.scales.astype(mx.float32)), cn.scales)
    err = np.abs(np.array(codec.decode(t, c)) - np.array(x.astype(mx.float32)))
    bound = np.array(quant.error_bound(c.scales, c.zeros, bits, 32))
    assert (err <= bound + 1e-7).all()
    assert np.allclose(codec.decode_np(t, cn), np.array(codec.decode(t, c)), atol=1e-6)
    q = mx.array(rng.normal(size=(2, 3, 4, 64)).astype(np.float32))
    assert np.allclose(np.array(codec.scores(t, q, c)),
                       np.array(q) @ np.array(codec.decode(t, c)).swapaxes(-1, -2), atol=1e-4)


def test_rows_are_independent_and_bytes_are_packed():
    x = mx.random.normal((1, 2, 6, 64), key=mx.random.key(0))
    t = affine.tables(64, dict(bits=4, group_size=32))
    c = affine.encode(t, x)
    idx = mx.array([[[0, 2, 5]] * 2], mx.int32)
    kept = take(c, idx)
    again = affine.encode(t, x[:, :, [0, 2, 5]])
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(kept, again))
    # 64 channels x 4 bits = 8 uint32 words; 2 groups x (scale + zero) float16 = 8 bytes
    assert sum(a.nbytes for a in c) == 1 * 2 * 6 * (8 * 4 + 8)


def test_group_size_must_divide_head_dim():
    with pytest.raises(ValueError, match="multiple of group_size"):
        affine.tables(48, dict(bits=4, group_size=32))
