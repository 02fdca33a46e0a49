"""KITTY: a hand-computed case on every backend, no boost as plain low-bit quantization, and
the planted channels boosted."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import quant

from tests._helpers import (BACKENDS, _data, _errors, _planted, _uniform_keys, same_state,
                            token_rows as rows, feed_in_chunks as feed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kitty_by_hand(backend):
    # 32 tokens, d = 4, key channel c of token t = t * w[c], w = [1, .25, 3, 2]; values alike.
    # hi_fraction .25 of 4 channels -> 1 boosted channel: the largest mean |k|, channel 2.
    t = np.arange(32, dtype=np.float32)
    w = np.array([1, 0.25, 3, 2], np.float32)
    x = rows(t[:, None] * w)
    st = velox.kitty_init(1, 1, 4, hi_fraction=0.25, hi_bit=4, lo_bit=2, group_size=32, backend=backend)
    st = velox.kitty_update(st, x, x)
    assert np.array(st.key_hi_channels).tolist() == [[[[2]]]]
    # Channel 2 at 4 bits: min 0, max 93, scale 93/15 = 6.2, code(t) = round(15t/31).
    hi = np.array(quant.unpack(st.key_hi_codes, 4))[0, 0, 0]
    assert hi.tolist() == [round(15 * i / 31) for i in range(32)]
    # Channels 0, 1, 3 at 2 bits: scale max/3, code(t) = round(3t/31): 0 x6, 1 x10, 2 x10, 3 x6.
    lo = np.array(quant.unpack(st.key_lo_codes, 2))[0, 0]
    assert (lo == [0] * 6 + [1] * 10 + [2] * 10 + [3] * 6).all()
    k, v = velox.kitty_get_kv(st)
    # (scales and zeros are float16: fp16(6.2) = 6.1992, fp16(31/3) = 10.336)
    assert np.allclose(np.array(k)[0, 0, :, 2], hi * 6.2, rtol=2 ** -10, atol=1e-4)
    assert np.allclose(np.array(k)[0, 0, :, 0], lo[0] * 31 / 3, rtol=2 ** -10, atol=1e-4)
    # Values per token at 2 bits: [t, t/4, 3t, 2t] has min t/4, max 3t, scale 11t/12: codes
    # round((.75, 0, 2.75, 1.75) / (11/12)) = (1, 0, 3, 2) -> t/4 + (1, 0, 3, 2) * 11t/12.
    assert np.allclose(np.array(v)[0, 0], t[:, None] * (0.25 + np.array([1, 0, 3, 2]) * 11 / 12),
                       rtol=2 ** -9, atol=1e-3)
    # Bytes: boosted codes 1 channel x 32 x 4 bits = 16, plain 3 x 32 x 2 bits = 24, the boosted
    # index 1 (uint8), key scales + zeros 2 x 4 x 2 B = 16 (float16), value codes 4 x 32 x 2
    # bits = 32, value scales + zeros 2 x 32 x 2 B = 128, next_pos 4.
    assert velox.kitty_bytes(st) == 16 + 24 + 1 + 16 + 32 + 128 + 4
    # Token by token ends in the same state.
    st2 = velox.kitty_init(1, 1, 4, hi_fraction=0.25, backend=backend)
    st2 = feed(velox.kitty_update, st2, x, x, [1] * 32)
    assert same_state(st, st2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kitty_without_boost_is_uniform_lo(backend):
    k, v = _data(1, 2, 70, 32, seed=2)
    st = feed(velox.kitty_update, velox.kitty_init(1, 2, 32, hi_fraction=0.0, lo_bit=2, backend=backend),
              k, v, [33, 1, 30, 6])
    codes, scales, _ = quant.quantize(k[:, :, :64].swapaxes(2, 3), 2, 32)
    assert st.key_hi_codes.size == 0 and mx.array_equal(st.key_lo_codes, codes).item()
    assert mx.array_equal(st.key_scales.swapaxes(2, 3), scales).item()
    kk, vv = velox.kitty_get_kv(st)
    assert mx.array_equal(kk[:, :, :64], _uniform_keys(k[:, :, :64], 2, 32)).item()
    want_v = quant.dequantize(*quant.quantize(v[:, :, :64], 2, 32), 2, 32, mx.float32)
    assert mx.array_equal(vv[:, :, :64], want_v).item()
    assert mx.array_equal(kk[:, :, 64:], k[:, :, 64:]).item()  # the buffer is exact


def test_kitty_boosts_the_planted_channels():
    k, v = _planted(n=96, d=64, seed=9)
    big = np.flatnonzero(np.abs(np.array(k)).mean(axis=(0, 1, 2)) > 5)  # the 4 planted channels
    st = velox.kitty_update(velox.kitty_init(1, 2, 64, hi_fraction=4 / 64, hi_bit=4, lo_bit=2), k, v)
    assert (np.sort(np.array(st.key_hi_channels), axis=-1) == big).all()
    boosted = _errors("kitty", k, v, hi_fraction=4 / 64)[0]
    uniform = _errors("kitty", k, v, hi_fraction=0.0)[0]
    assert (boosted ** 2).mean() < 0.25 * (uniform ** 2).mean()
