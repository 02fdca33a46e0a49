"""SKVQ: a hand-computed case on every backend, no reordering or clipping as plain group
quantization, and reordering and clipping beating plain groups on skewed channels."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import quant

from tests._helpers import (BACKENDS, SUPPORTED, _data, _errors, token_rows as rows,
                            feed_in_chunks as feed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skvq_by_hand(backend):
    # d = 32, one group of 32 channels, sink t0, window 2, 2 bits, clip factor 0.5, no search.
    # t1 = t2 = [0, 1, ..., 31], t3 = 0. Four tokens: t0 sink, t2 t3 window, t1 quantized.
    ramp = np.arange(32, dtype=np.float32)
    x = np.stack([np.full(32, 100, np.float32), ramp, ramp, np.zeros(32, np.float32)])
    st = velox.skvq_init(1, 1, 32, bits_key=2, bits_value=2, group_size=32, window=2, n_sink=1,
                         reorder=True, clip_search=False, clip_alpha=0.5, backend=backend)
    st = velox.skvq_update(st, rows(x), rows(x))
    # Calibration on t1, t2: channel j's largest magnitude is j -> descending order 31..0.
    assert np.array(st.key_perm)[0, 0].tolist() == list(range(31, -1, -1))
    # t1 clipped to [0.5 * 0, 0.5 * 31] = [0, 15.5]: scale 15.5/3; codes round(j / 5.1667)
    # saturating at 3: j 0-2 -> 0, 3-7 -> 1, 8-12 -> 2, 13-31 -> 3.
    codes = [0] * 3 + [1] * 5 + [2] * 5 + [3] * 19
    assert np.array(quant.unpack(st.key_codes, 2))[0, 0, 0].tolist() == codes[::-1]  # permuted order
    k, v = velox.skvq_get_kv(st)
    assert np.allclose(np.array(k)[0, 0, 1], np.array(codes) * 15.5 / 3, rtol=2 ** -10, atol=1e-5)
    assert np.array_equal(np.array(k)[0, 0, [0, 2, 3]], x[[0, 2, 3]])  # sink and window exact
    # Bytes: sink rows 2 x 32 x 2 B = 128 (float16 residual_dtype); codes 2 x 32 x 2 bits = 16;
    # scales + zeros 4 x 2 B = 8; permutations 2 x 32 (uint8) = 64; clip factors 2 x 4 B = 8;
    # window 2 x 2 x 32 x 2 B = 256; next_pos 4.
    assert velox.skvq_bytes(st) == 128 + 16 + 8 + 64 + 8 + 256 + 4
    # A later token leaves the window under the frozen calibration.
    st = velox.skvq_update(st, rows(-x[1:2]), rows(-x[1:2]))
    assert np.array(st.key_perm)[0, 0].tolist() == list(range(31, -1, -1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_skvq_without_reorder_or_clip_is_group_quantization(backend):
    k, v = _data(1, 2, 60, 64, seed=3)
    st = velox.skvq_init(1, 2, 64, bits_key=3, bits_value=2, window=8, n_sink=2, reorder=False,
                         clip_search=False, clip_alpha=1.0, residual_dtype="model", backend=backend)
    st = feed(velox.skvq_update, st, k, v, [30, 1, 29])
    quantized = slice(2, 52)  # 60 tokens: 2 sinks, 50 quantized, the window of 8
    kc, ks, kz = quant.quantize(k[:, :, quantized], 3, 32)
    assert mx.array_equal(st.key_codes, kc).item() and mx.array_equal(st.key_scales, ks).item()
    kk, vv = velox.skvq_get_kv(st)
    assert mx.array_equal(kk[:, :, quantized], quant.dequantize(kc, ks, kz, 3, 32, mx.float32)).item()
    want_v = quant.dequantize(*quant.quantize(v[:, :, quantized], 2, 32), 2, 32, mx.float32)
    assert mx.array_equal(vv[:, :, quantized], want_v).item()


def test_skvq_reorder_and_clip_beat_plain_groups_on_skewed_channels():
    # Channel scales spread log-uniformly over 1..30: plain contiguous groups mix small and
    # large channels, so small channels get the step of the largest one in their group.
    rng = np.random.default_rng(6)
    scale = np.exp(rng.uniform(0, np.log(30), 128)).astype(np.float32)
    k = mx.array(rng.standard_normal((1, 2, 256, 128)).astype(np.float32) * scale)
    for bits in SUPPORTED["skvq"]:
        base = dict(bits_key=bits, bits_value=bits, window=32, n_sink=0)
        err = {name: _errors("skvq", k, k, **base, **kw)[0][:, :, :224]  # the window is exact
               for name, kw in (("plain", dict(reorder=False, clip_search=False)),
                                ("clip", dict(reorder=False)), ("both", dict()))}
        mse = {name: float((e ** 2).mean()) for name, e in err.items()}
        rel = {name: float(((e / scale) ** 2).mean()) for name, e in err.items()}  # per-channel
        # measured: both/plain 0.13-0.68 in MSE, 0.008-0.05 in per-channel relative MSE; the
        # searched clip never loses to no clipping on these tokens
        assert mse["both"] < 0.75 * mse["plain"] and rel["both"] < 0.1 * rel["plain"], (bits, mse, rel)
        assert mse["clip"] <= mse["plain"], (bits, mse)
