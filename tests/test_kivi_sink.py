"""KIVI-Sink: a hand-computed case on every backend, no sinks as exactly KIVI, and a planted
sink that never widens its group."""

import mlx.core as mx
import numpy as np
import pytest

import velox

from tests._helpers import (BACKENDS, _data, _planted, same_state, token_rows as rows,
                            feed_in_chunks as feed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kivi_sink_by_hand(backend):
    # 32 tokens, every channel of token t equals t, except t5 = 775 (25 x 31): the largest key
    # norm, so the sink. 2 bits, groups of 32, no residual window.
    t = np.arange(32, dtype=np.float32)
    t[5] = 775
    x = rows(np.repeat(t[:, None], 32, axis=1))
    st = velox.kivi_sink_init(1, 1, 32, bits=2, group_size=32, residual_length=0, n_sink_tokens=1,
                              backend=backend)
    st = velox.kivi_sink_update(st, x, x)
    assert np.array(st.sink_positions).tolist() == [[[5]]]
    # The group's range excludes the sink (its row is replaced by t0): min 0, max 31, scale
    # 31/3 as without it, not 775/3; codes round(3t/31) as in KIVI's hand case (slot 5: t0's 0).
    assert np.allclose(np.array(st.key_scales)[0, 0, :, 0], 31 / 3, rtol=2 ** -11)
    codes = np.array([0] * 6 + [1] * 10 + [2] * 10 + [3] * 6)
    words = [sum(int(c) << (2 * i) for i, c in enumerate(codes[16 * w:16 * w + 16])) for w in range(2)]
    assert np.array(st.key_codes)[0, 0, 0].tolist() == words
    k, v = velox.kivi_sink_get_kv(st)
    assert np.array(k)[0, 0, 5, 0] == 775 and np.array_equal(np.array(v)[0, 0], np.array(x)[0, 0])
    # Bytes: KIVI's codes 2 x 256, float16 scales and zeros 2 x 2 x 32 x 2 B, next_pos 4 (772)
    # + the sink row (keys and values) 2 x 32 x 2 B (float16 residual_dtype) + its position 4 B.
    assert velox.kivi_sink_bytes(st) == 772 + 128 + 4
    plain = velox.kivi_update(velox.kivi_init(1, 1, 32, bits=2, group_size=32, residual_length=0), x, x)
    assert np.allclose(np.array(plain.key_scales)[0, 0, :, 0], 775 / 3, rtol=2 ** -11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kivi_sink_without_sinks_is_kivi(backend):
    k, v = _data(2, 2, 95, 32)
    chunks = [50, 1, 1, 40, 3]
    a = velox.kivi_init(2, 2, 32, residual_length=20, backend=backend)
    a = feed(velox.kivi_update, a, k, v, chunks)
    b = feed(velox.kivi_sink_update, velox.kivi_sink_init(2, 2, 32, residual_length=20, n_sink_tokens=0,
                                                          backend=backend), k, v, chunks)
    assert same_state(a, [getattr(b, f) for f in a._fields])
    assert all(x.size == 0 for x in (b.sink_keys, b.sink_values, b.sink_positions))
    assert velox.kivi_bytes(a) == velox.kivi_sink_bytes(b)  # the empty sink arrays hold 0 bytes
    assert all(mx.array_equal(x, y).item() for x, y in zip(velox.kivi_get_kv(a), velox.kivi_sink_get_kv(b)))


def test_kivi_sink_planted_sink_never_widens_its_group():
    k, v = _planted(n=96, d=32, seed=7)
    k = np.array(k)
    k[:, :, 37] *= 25  # a 25x-norm token in the second group
    k = mx.array(k)
    st = velox.kivi_sink_update(velox.kivi_sink_init(1, 2, 32, residual_length=0, n_sink_tokens=1), k, v)
    assert np.array(st.sink_positions).ravel().tolist() == [37, 37]
    # The group's (scale, zero) equal those of the group with the sink row left out.
    rest = mx.concatenate([k[:, :, 32:37], k[:, :, 38:64]], axis=2).swapaxes(2, 3)
    rest = rest.astype(mx.float16).astype(mx.float32)  # rows pass the float16 residual window
    lo, hi = rest.min(axis=-1), rest.max(axis=-1)
    assert mx.array_equal(st.key_zeros[..., 1], lo.astype(mx.float16)).item()
    assert mx.array_equal(st.key_scales[..., 1], ((hi - lo) / 3).astype(mx.float16)).item()
    plain = velox.kivi_update(velox.kivi_init(1, 2, 32, residual_length=0), k, v)
    ek = np.abs(np.array(velox.kivi_sink_get_kv(st)[0]) - np.array(k))[:, :, 32:64]
    ep = np.abs(np.array(velox.kivi_get_kv(plain)[0]) - np.array(k))[:, :, 32:64]
    sink = np.abs(np.array(k))[:, :, 37]  # the sink row is exact, in float16 (residual_dtype)
    assert (ek[:, :, 5] <= 2 ** -11 * sink).all() and ek.mean() < 0.5 * ep.mean()  # measured: 0.23
