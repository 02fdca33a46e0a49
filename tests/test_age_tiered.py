"""Age-tiered quantization: a hand-computed case on every backend, the tier boundaries,
path-independent and bounded requantization, and uniform widths as group quantization."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import quant

from tests._helpers import BACKENDS, BITS, arr, feed, gaussian, per_channel, rms_ratio, states_equal


@pytest.mark.parametrize("backend", BACKENDS)
def test_age_tiered_by_hand(backend):
    # d = 32, one unit of 32 tokens. Keys: every channel of token t holds x[t] = 0, 255, 8, 9,
    # 128, 42, then zeros; per channel along the tokens: min 0, max 255. Values: every token
    # holds 255 - x[c] at channel c; per token along the channels: the same range.
    # 8-bit step (255 - 0) / 255 = 1, so the recent codes are the values themselves.
    # Aged to 4 bits: k = 255 / 15 = 17, code round(q / 17), step 17:
    #   0 -> 0, 255 -> 15*17, 8 -> round(.47) = 0, 9 -> round(.53) = 1 -> 17,
    #   128 -> round(7.53) = 8 -> 136, 42 -> round(2.47) = 2 -> 34.
    # Aged to 2 bits: k = 15 / 3 = 5, code round(q4 / 5), step 85:
    #   0, 15 -> 3 -> 255, 0, 1 -> 0, 8 -> round(1.6) = 2 -> 170, 2 -> round(.4) = 0.
    # Values 255 - x: the mirror image (k is odd, so rounding is symmetric).
    x = np.zeros(32, np.float32)
    x[:6] = [0, 255, 8, 9, 128, 42]
    k = arr(np.broadcast_to(x[:, None], (32, 32))[None, None])
    v = arr(np.broadcast_to(255 - x[None, :], (32, 32))[None, None])
    st = velox.age_tiered_init(1, 1, 32, recent_boundary=1, mid_boundary=2, backend=backend)
    st = velox.age_tiered_update(st, k, v)  # T = 32: the group's newest token has age 0: recent
    got_k, got_v = (np.array(a)[0, 0] for a in velox.age_tiered_get_kv(st))
    assert got_k[:, 7].tolist() == x.tolist() and got_v[9].tolist() == (255 - x).tolist()
    one = arr(np.zeros((1, 1, 1, 32)))
    st = velox.age_tiered_update(st, one, one)  # T = 33: age 1 >= recent_boundary: mid
    k4, v4 = (np.array(a)[0, 0] for a in velox.age_tiered_get_kv(st))
    assert (k4[:6] == np.array([0, 255, 0, 17, 136, 34])[:, None]).all()
    assert (v4[:32, :6] == [255, 0, 255, 238, 119, 221]).all()  # 255 - (the same rounding)
    assert (np.array(st.mid_keys_scales) == 17.0).all() and (np.array(st.mid_values_scales) == 17.0).all()
    assert st.recent_keys_scales.shape[-1] == 0 and st.recent_values_scales.shape[2] == 0
    st = velox.age_tiered_update(st, one, one)  # T = 34: age 2 >= mid_boundary: old
    k2 = np.array(velox.age_tiered_get_kv(st)[0])[0, 0]
    assert (k2[:6] == np.array([0, 255, 0, 0, 170, 0])[:, None]).all()
    assert (np.array(st.old_keys_scales) == 85.0).all()
    # Keys: codes 32 channels x 32 tokens x 2 bits = 256 B, float16 scale and zero per channel
    # 32 x 2 x 2 = 128; values: codes 32 tokens x 32 channels x 2 bits = 256, scale and zero
    # per token 128; 2 exact tail tokens per kind 2 x 2 x 32 x 4 B (float32) = 512; next_pos 4.
    assert velox.age_tiered_bytes(st) == 256 + 128 + 256 + 128 + 512 + 4


def test_age_tiered_tier_boundaries():
    # G = 32, recent_boundary = 40, mid_boundary = 100. Group j's newest token is 32 j + 31.
    # After T tokens its age is T - 32 (j + 1): recent below 40, mid below 100, old after.
    counts = [velox.methods.age_tiered.tier_counts(t, 32, 40, 100)
              for t in (31, 32, 71, 72, 131, 132, 200)]
    assert counts == [
        {"old": 0, "mid": 0, "recent": 0},   # no complete group
        {"old": 0, "mid": 0, "recent": 1},   # group 0, age 0
        {"old": 0, "mid": 0, "recent": 2},   # group 0 age 39: still recent
        {"old": 0, "mid": 1, "recent": 1},   # group 0 age 40: mid
        {"old": 0, "mid": 2, "recent": 2},   # 4 groups, ages 99, 67 | 35, 3
        {"old": 1, "mid": 1, "recent": 2},   # ages 100 | 68 | 36, 4: group 0 is old
        {"old": 3, "mid": 2, "recent": 1},   # 6 groups: ages 168, 136, 104 | 72, 40 | 8
    ]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_age_tiered_requantization_is_path_independent_and_bounded(dtype):
    # Ages 8 -> 4 -> 2 bits; a 200-token prompt in one chunk or token by token: same state.
    x = gaussian((1, 2, 200, 32), 0)
    k, v = arr(x, dtype), arr(-x, dtype)
    kw = dict(recent_boundary=40, mid_boundary=100)
    one = feed(velox.age_tiered_init(1, 2, 32, dtype=dtype, **kw), velox.age_tiered_update, k, v)
    steps = feed(velox.age_tiered_init(1, 2, 32, dtype=dtype, **kw), velox.age_tiered_update, k, v,
                 [70] + [1] * 50 + [80])
    states_equal(one, steps)
    # Nested grids: the old tier's error is within half a 2-bit step (the bound), and its
    # codes are those of direct 2-bit quantization of the exact values but for the few a
    # double rounding moves by one.
    got = np.array(velox.age_tiered_get_kv(one)[0].astype(mx.float32))
    n_old = one.old_keys_scales.shape[-1] * 32
    exact = np.array(k.astype(mx.float32))[:, :, :n_old]
    bound = np.array(velox.methods.age_tiered.error_bound(one)[0])[:, :, :n_old]
    assert (np.abs(got[:, :, :n_old] - exact) <= bound).all()
    direct = np.array(quant.unpack(quant.quantize(k[:, :, :n_old].swapaxes(2, 3), 2, 32)[0], 2))
    chained = np.array(quant.unpack(one.old_keys_codes, 2))
    diff = np.abs(direct.astype(np.int64) - chained.astype(np.int64))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.05


@pytest.mark.parametrize("bits", BITS)
def test_age_tiered_uniform_bits_equal_group_quantization(bits):
    # All tiers at the same width: every complete unit is plain quantization, keys per
    # channel (KIVI's keys), values per token (KIVI's values).
    x = gaussian((2, 2, 150, 32), bits)
    k, v = arr(x), arr(x * 2)
    st = feed(velox.age_tiered_init(2, 2, 32, recent_boundary=40, mid_boundary=80, bits_recent=bits,
                                    bits_mid=bits, bits_old=bits), velox.age_tiered_update, k, v)
    got_k, got_v = (np.array(a) for a in velox.age_tiered_get_kv(st))
    want_k, step = per_channel(x, bits, 32)
    want_v = np.array(quant.dequantize(*quant.quantize(arr(x[:, :, :128] * 2), bits, 32), bits, 32,
                                       mx.float32))
    assert np.array_equal(got_k[:, :, :128], want_k) and np.array_equal(got_v[:, :, :128], want_v)
    assert np.array_equal(got_k[:, :, 128:], x[:, :, 128:])  # the incomplete group: exact
    assert (np.abs(got_k[:, :, :128] - x[:, :, :128]) <= step / 2 * (1 + 1e-5) + 1e-6).all()
    if bits >= 3:  # the uniform-noise model: mean squared error ~ step^2 / 12
        assert 0.8 < rms_ratio(x[:, :, :128], got_k[:, :, :128], step) < 1.1
