"""adakv, age_tiered, cachegen, gear, amc: hand-computed cases, reductions, error statistics,
entropy-coding round trips and byte counts."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import entropy, nuq, quant
from velox.methods import adakv as adakv_mod
from velox.methods import amc as amc_mod
from velox.methods import cachegen as cachegen_mod
from velox.methods import gear as gear_mod
from velox.registry import get_method

BACKENDS = ["reference", "mlx"]
BITS = quant.SUPPORTED_BITS  # 1 to 8


def arr(x, dtype=mx.float32):
    return mx.array(np.asarray(x, np.float32)).astype(dtype)


def gaussian(shape, seed, std=1.0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * std


def feed(state, update, k, v, chunks=None):
    """Absorb ``k``/``v`` in one chunk, or in the given chunk sizes."""
    chunks = chunks or [k.shape[2]]
    t = 0
    for c in chunks:
        state = update(state, k[:, :, t:t + c], v[:, :, t:t + c])
        t += c
    return state


def states_equal(a, b):
    for name, x in a._asdict().items():
        y = getattr(b, name)
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x),
                                  np.array(y.astype(mx.float32) if y.dtype == mx.bfloat16 else y)), name
        else:
            assert x == y, name


def per_channel(x: np.ndarray, bits: int, g: int):
    """Plain quantization of ``[b, h, n, d]`` per channel in groups of ``g`` tokens (KIVI keys):
    the dequantized values and the per-element step, for the complete groups."""
    n = (x.shape[2] // g) * g
    q, s, z = quant.quantize(arr(x[:, :, :n]).swapaxes(2, 3), bits, g)
    deq = quant.dequantize(q, s, z, bits, g, mx.float32).swapaxes(2, 3)
    step = mx.repeat(s, g, axis=-1).swapaxes(2, 3)
    return np.array(deq), np.array(step)


def rms_ratio(x, xhat, step):
    """Mean squared error over the uniform-noise prediction ``step**2 / 12``."""
    return float(((x - xhat) ** 2).mean() / (step.astype(np.float64) ** 2 / 12).mean())


# --- age_tiered -----------------------------------------------------------------------------

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
    bound = np.array(velox.methods.age_tiered.age_tiered_error_bound(one)[0])[:, :, :n_old]
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


# --- adakv -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_adakv_by_hand(backend):
    # Two heads, d = 1, one group of 32 tokens, target 2.5 over {2, 3, 4}: the ranks spread to
    # 2.25 and 2.75, snapped to 2 and 3 (total 5 = 2 x 2.5). Head 0 cycles 0..7 (key norms
    # 0..7: variance 5.25); head 1 is constant 1 (variance 0): head 0 gets 3 bits, head 1 2.
    # At 3 bits head 0's step is (7 - 0) / 7 = 1: exact. Head 1's step is 0: exact.
    k = np.zeros((1, 2, 32, 1), np.float32)
    k[0, 0, :, 0] = np.arange(32) % 8
    k[0, 1] = 1.0
    st = velox.adakv_init(1, 2, 1, backend=backend)
    st = velox.adakv_update(st, arr(k), arr(-k))
    assert np.array(adakv_mod.head_bits(st)).tolist() == [[[3], [2]]]
    assert np.array(st.head_slot).tolist() == [[[1], [0]]]  # slot 0 (2 bits) holds head 1
    assert st.mid_scales.item() == 1.0 and st.lo_scales.item() == 0.0
    got_k, got_v = velox.adakv_get_kv(st)
    assert np.array_equal(np.array(got_k), k) and np.array_equal(np.array(got_v), -k)
    # Bytes: 3-bit codes 32 x 3 / 8 = 12 and 2-bit 8; two scales and zeros (float16, 8);
    # one slot byte per head (2); stats 2 heads x 2 x 4 = 16; values 2 x 32 x 2 = 128 (float16
    # residual_dtype); next_pos 8.
    assert velox.adakv_bytes(st) == 12 + 8 + 8 + 2 + 16 + 128 + 8


@pytest.mark.parametrize("heads,target,want", [
    (1, 2.5, (2,)), (2, 2.5, (2, 3)), (4, 2.5, (2, 2, 3, 3)), (4, 3.0, (2, 3, 3, 4)),
    (8, 2.5, (2, 2, 2, 2, 3, 3, 3, 3)), (8, 3.5, (3, 3, 3, 3, 4, 4, 4, 4)), (5, 2.0, (2,) * 5),
    (3, 2.5, (2, 2, 3)),  # 7.5 is not reachable: 7 and 8 are as close; no step improves
])
def test_adakv_mean_bits_meet_the_target(heads, target, want):
    table = adakv_mod.bits_by_rank(heads, target, 2, 3, 4)
    assert table == want
    assert abs(sum(table) / heads - target) <= 0.5 / heads + 1e-9


def test_adakv_allocation_follows_importance_and_meets_target():
    # 8 heads whose keys have growing norm spread: the most spread heads get the most bits.
    rng = np.random.default_rng(0)
    scale = np.exp(rng.standard_normal(8)).astype(np.float32)
    k = gaussian((2, 8, 64, 16), 1) * (1 + scale[None, :, None, None] *
                                         gaussian((2, 8, 64, 1), 2))
    st = velox.adakv_init(2, 8, 16, target_avg_bits=3.0)
    st = velox.adakv_update(st, arr(k), arr(k))
    bits = np.array(adakv_mod.head_bits(st))  # [b, h, groups]
    assert (bits.mean(axis=1) == 3.0).all()
    norms = np.linalg.norm(k, axis=-1)
    var = np.stack([norms[:, :, :32 * (g + 1)].var(-1) for g in range(2)], -1)
    order = np.argsort(var, axis=1)
    assert (np.take_along_axis(bits, order, axis=1)[:, 0] == 2).all()   # least important
    assert (np.take_along_axis(bits, order, axis=1)[:, -1] == 4).all()  # most important


@pytest.mark.parametrize("importance", ["norm_variance", "attention_entropy"])
def test_adakv_path_independence(importance):
    x = gaussian((1, 3, 130, 8), 3) * np.array([0.5, 1.0, 2.0], np.float32)[None, :, None, None]
    kw = dict(importance=importance, update_interval=2)
    one = feed(velox.adakv_init(1, 3, 8, **kw), velox.adakv_update, arr(x), arr(-x))
    steps = feed(velox.adakv_init(1, 3, 8, **kw), velox.adakv_update, arr(x), arr(-x), [1] * 40 + [90])
    states_equal(one, steps)


@pytest.mark.parametrize("bits", BITS)
def test_adakv_uniform_widths_equal_group_quantization(bits):
    x = gaussian((1, 3, 70, 8), 10 + bits)
    st = velox.adakv_init(1, 3, 8, target_avg_bits=float(bits), lo_bit=bits, mid_bit=bits, hi_bit=bits,
                          residual_dtype="model")
    st = velox.adakv_update(st, arr(x), arr(-x))
    got_k, got_v = (np.array(a) for a in velox.adakv_get_kv(st))
    want, step = per_channel(x, bits, 32)
    assert np.array_equal(got_k[:, :, :64], want) and np.array_equal(got_k[:, :, 64:], x[:, :, 64:])
    assert np.array_equal(got_v, -x)  # values are exact
    if bits >= 3:
        assert 0.8 < rms_ratio(x[:, :, :64], got_k[:, :, :64], step) < 1.1


def test_adakv_more_bits_less_error():
    # Default widths over 4 heads of equal spread: the 3-bit heads' error is below the 2-bit.
    x = gaussian((1, 4, 256, 32), 4)
    st = velox.adakv_update(velox.adakv_init(1, 4, 32), arr(x), arr(x))
    err = (np.array(velox.adakv_get_kv(st)[0]) - x) ** 2
    bits = np.array(adakv_mod.head_bits(st))[0]               # [h, groups]
    per_group = err.reshape(1, 4, 8, 32, 32).mean(axis=(0, 3, 4))  # [h, groups]
    assert per_group[bits == 3].mean() < 0.5 * per_group[bits == 2].mean()


# --- cachegen -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_cachegen_by_hand(backend):
    # d = 1, 2 bits, two identical groups: 0, 1, 2, 3, then 3s. Step (3 - 0) / 3 = 1, so the
    # codes are the values; deltas 1, 1, 1, then 28 zeros.
    # Group 0 uses the prior, Laplace scale (3 + 1) / 4 = 1: P(0) = 1 - e^-.5 = .39 (1.35
    # bits), P(1) = (e^-.5 - e^-1.5) / 2 = .19 (2.38 bits): 2 (anchor) + 3 x 2.38 + 28 x 1.35
    # = 47 bits -> 2 words, no better than 32 codes x 2 bits packed: stored packed.
    # The model fitted to it: scale mean|delta| = 3/31, byte round(16 log2(3/31)) + 128 =
    # round(-53.9) + 128 = 74, scale 2**(-54/16) = .096: P(0) = .994 (.008 bits), P(1) =
    # (e^-5.2 - e^-15.6) / 2 = .0028 (8.5 bits): group 1 costs 2 + 3 x 8.5 + .2 = 28 bits: 1 word.
    x = np.full((1, 1, 64, 1), 3.0, np.float32)
    x[0, 0, :4, 0] = x[0, 0, 32:36, 0] = [0, 1, 2, 3]
    st = velox.cachegen_init(1, 1, 1, bits=2, backend=backend)
    st = velox.cachegen_update(st, arr(x), arr(x))
    assert np.array(st.keys_lengths).tolist() == [2, 1]
    assert np.array(st.keys_packed).tolist() == [True, False]
    assert np.array(st.keys_model).tolist() == [[[[0, 74]]]]
    assert cachegen_mod.decode_codes(st, "keys").ravel().tolist() == x.ravel().tolist()
    assert np.array_equal(np.array(velox.cachegen_get_kv(st)[0]), x)


def test_entropy_round_trip_is_exact():
    rng = np.random.default_rng(0)
    for lo, hi in ((-15, 15), (0, 255), (-255, 255), (0, 1)):
        sym = np.clip(np.round(rng.laplace(0, 2.0, 5000)), lo, hi).astype(np.int64)
        means = rng.uniform(lo, hi, sym.size)
        scales = entropy.scale_of(rng.integers(0, 256, sym.size))
        uni = rng.integers(0, 7, 300)
        words = entropy.encode(uni, 7, sym, lo, hi, means, scales)
        got_u, got_s = entropy.decode(words, 300, 7, lo, hi, means, scales)
        assert np.array_equal(got_u, uni) and np.array_equal(got_s, sym)
    assert entropy.scale_of(entropy.index_of(1.0)) == 1.0


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_cachegen_decodes_exactly_and_codes_below_packed_on_smooth_data(bits):
    # A random walk along tokens (neighbouring tokens alike: CacheGen's token locality).
    walk = np.cumsum(gaussian((2, 2, 192, 16), bits, std=0.1), axis=2)
    st = velox.cachegen_init(2, 2, 16, bits=bits)
    st = velox.cachegen_update(st, arr(walk), arr(-walk))
    q, s, z = quant.quantize(arr(walk).swapaxes(2, 3), bits, 32)     # keys: per channel
    assert np.array_equal(cachegen_mod.decode_codes(st, "keys"), np.array(quant.unpack(q, bits)))
    q, s, z = nuq.affine(arr(-walk), bits, mx.float32)               # values: per token (16 < 32
    assert np.array_equal(cachegen_mod.decode_codes(st, "values"),    # channels: one group a row)
                          np.array(q).swapaxes(2, 3))
    got, step = np.array(velox.cachegen_get_kv(st)[0]), per_channel(walk, bits, 32)
    assert np.array_equal(got, step[0])  # lossless coding: plain group quantization
    if bits >= 3:
        assert 0.8 < rms_ratio(walk, got, step[1]) < 1.1
    coded, packed = cachegen_mod.coded_nbytes(st), cachegen_mod.packed_nbytes(st)
    assert coded < packed
    if 2 <= bits <= 5:  # deltas a few steps wide: well below fixed width
        assert coded < 0.9 * packed
    # On i.i.d. data deltas do not help: segments fall back to fixed width, never above it.
    iid = velox.cachegen_update(velox.cachegen_init(2, 2, 16, bits=bits),
                                arr(gaussian((2, 2, 192, 16), 99)), arr(walk))
    assert cachegen_mod.coded_nbytes(iid) <= cachegen_mod.packed_nbytes(iid)


def test_cachegen_reads_fixed_width_segments_without_host_decoding(monkeypatch):
    # i.i.d. data: every segment falls back to fixed width. get_kv then slices the stream on
    # the device: no model fitting, no range decoding (it used to fit a model per group and
    # unpack on the host every step: 0.7 tokens/s on SmolLM2 at 2k tokens).
    st = velox.cachegen_update(velox.cachegen_init(1, 2, 16, bits=4),
                               arr(gaussian((1, 2, 192, 16), 7)), arr(gaussian((1, 2, 192, 16), 8)))
    assert np.array(st.keys_packed).all() and np.array(st.values_packed).all()
    want = [np.array(x) for x in velox.cachegen_get_kv(st)]

    def forbidden(*args, **kwargs):
        raise AssertionError("host decoding of a fixed-width segment")

    monkeypatch.setattr(cachegen_mod, "_fit", forbidden)
    monkeypatch.setattr(entropy, "decode", forbidden)
    got = [np.array(x) for x in velox.cachegen_get_kv(st)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_cachegen_mixed_segments_decode_exactly():
    # A walk that turns into noise halfway: coded segments, then fixed-width ones, then coded.
    x = np.cumsum(gaussian((1, 2, 256, 16), 3, std=0.05), axis=2)
    x[:, :, 96:160] = gaussian((1, 2, 64, 16), 4)
    st = velox.cachegen_update(velox.cachegen_init(1, 2, 16, bits=4), arr(x), arr(x))
    flags = np.array(st.keys_packed).tolist()
    assert True in flags and False in flags
    q, _, _ = quant.quantize(arr(x).swapaxes(2, 3), 4, 32)
    assert np.array_equal(cachegen_mod.decode_codes(st, "keys"), np.array(quant.unpack(q, 4)))
    assert mx.array_equal(cachegen_mod.packed_codes(st, "keys"), q).item()


@pytest.mark.parametrize("use_delta,per_channel",
                         [(True, True), (True, False), (False, True), (False, False)])
def test_cachegen_path_independence(use_delta, per_channel):
    walk = np.cumsum(gaussian((1, 2, 100, 8), 5, std=0.2), axis=2)
    kw = dict(use_delta=use_delta, per_channel=per_channel)
    one = feed(velox.cachegen_init(1, 2, 8, **kw), velox.cachegen_update, arr(walk), arr(walk))
    steps = feed(velox.cachegen_init(1, 2, 8, **kw), velox.cachegen_update, arr(walk), arr(walk),
                 [33, 1, 1, 30, 35])
    states_equal(one, steps)
    assert np.array_equal(np.array(velox.cachegen_get_kv(one)[0]), per_channel_ref(walk, 4))


def per_channel_ref(x, bits):
    deq, _ = per_channel(x, bits, 32)
    return np.concatenate([deq, x[:, :, deq.shape[2]:]], axis=2)


def test_cachegen_layer_schedule():
    m = get_method("cachegen")
    assert [p["bits"] for p in m.per_layer_params(6, {})] == [4, 4, 3, 3, 2, 2]
    assert [p["bits"] for p in m.per_layer_params(5, {"bits": 8, "layer_groups": 3})] == [8, 8, 7, 6, 6]
    assert [p["bits"] for p in m.per_layer_params(3, {"bits": 1})] == [1, 1, 1]
    assert m.per_layer_params(2, {"use_delta": False})[1] == {"use_delta": False, "bits": 3}


# --- gear ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_gear_by_hand(backend):
    # One 32 x 32 block: x[t, c] = (t + c) mod 2, plus outliers x[5, 7] = 100, x[9, 3] = -50.
    # sparse_fraction 0.002: round(0.002 * 1024 / 2) = 1 largest and 1 smallest entry kept
    # exact: exactly the two outliers. Every inlier group (a channel's 32 tokens for keys, a
    # token's 32 channels for values) then spans [0, 1]: 2-bit step 1/3, codes 0 and 3, exact
    # but for the float16 step (3 x fp16(1/3) = 0.99951).
    # Quantization alone (sparse_fraction 0): channel 7 spans [0, 100], step 100/3, so its 16
    # ones read 0; channel 3 spans [-50, 1], step 17, so its 15 zeros read 1: error^2 = 31.
    x = ((np.arange(32)[:, None] + np.arange(32)[None, :]) % 2).astype(np.float32)
    x[5, 7], x[9, 3] = 100.0, -50.0
    k = arr(x[None, None])
    st = velox.gear_init(1, 1, 32, rank=0, sparse_fraction=0.002, backend=backend)
    st = velox.gear_update(st, k, k)
    got_k, got_v = (np.array(a)[0, 0] for a in velox.gear_get_kv(st))
    assert np.allclose(got_k, x, rtol=0, atol=2 ** -11) and np.allclose(got_v, x, rtol=0, atol=2 ** -11)
    assert sorted(np.array(st.keys_outliers).ravel().tolist()) == [-50.0, 100.0]
    assert sorted(np.array(st.keys_outlier_index).ravel().tolist()) == [5 * 32 + 7, 9 * 32 + 3]
    base = velox.gear_init(1, 1, 32, rank=0, sparse_fraction=0.0, backend=backend)
    base = velox.gear_update(base, k, k)
    err_k, err_v = (((np.array(a)[0, 0] - x) ** 2).sum() for a in velox.gear_get_kv(base))
    assert err_k == pytest.approx(31.0, abs=2e-3) and err_v == pytest.approx(31.0, abs=2e-3)


def test_gear_reduces_to_group_quantization():
    # rank 0 and no outliers: keys per channel (KIVI keys), values per token, groups of 32.
    x = gaussian((1, 2, 80, 32), 7)
    st = velox.gear_update(velox.gear_init(1, 2, 32, rank=0, sparse_fraction=0.0), arr(x), arr(-x))
    got_k, got_v = (np.array(a) for a in velox.gear_get_kv(st))
    want_k, _ = per_channel(x, 2, 32)
    q, s, z = quant.quantize(arr(-x[:, :, :64]), 2, 32)
    want_v = np.array(quant.dequantize(q, s, z, 2, 32, mx.float32))
    assert np.array_equal(got_k[:, :, :64], want_k) and np.array_equal(got_v[:, :, :64], want_v)
    assert np.array_equal(got_k[:, :, 64:], x[:, :, 64:])


def _gear_error(x, **kw):
    b, h, n, d = x.shape
    st = velox.gear_update(velox.gear_init(b, h, d, **kw), arr(x), arr(x))
    got = np.array(velox.gear_get_kv(st)[0])
    return float(((got - x) ** 2).sum()), st


@pytest.mark.parametrize("bits", BITS)
def test_gear_recovers_error_over_quantization_alone(bits):
    # Gaussian keys with planted outliers (0.5% of entries, 20 sigma) and a rank-2 drift
    # shared by the tokens of a block: the outliers stretch plain quantization's ranges.
    rng = np.random.default_rng(bits)
    x = gaussian((1, 2, 128, 32), bits)
    x += (rng.standard_normal((1, 2, 128, 2)) @ rng.standard_normal((1, 2, 2, 32))).astype(np.float32)
    mask = rng.random(x.shape) < 0.005
    x[mask] = (20 * np.sign(rng.standard_normal(mask.sum()))).astype(np.float32)
    base, _ = _gear_error(x, bits=bits, rank=0, sparse_fraction=0.0)
    sparse, _ = _gear_error(x, bits=bits, rank=0, sparse_fraction=0.02)
    lowrank, _ = _gear_error(x, bits=bits, rank=4, sparse_fraction=0.0, energy_threshold=1.0)
    full, st = _gear_error(x, bits=bits, rank=4, sparse_fraction=0.02, energy_threshold=1.0)
    # The seed's error_recovery_ratio, 1 - |X - GEAR(X)|^2 / |X - Q(X)|^2: measured .76 to
    # .86 over the widths here; each correction alone recovers less than both together.
    recovered = 1 - full / base
    assert full < min(sparse, lowrank) and max(sparse, lowrank) < base
    assert recovered > 0.7
    # The honest bound holds: quantization bound plus the size of the correction.
    bound = np.array(velox.methods.gear.gear_error_bound(st)[0])
    assert (np.abs(np.array(velox.gear_get_kv(st)[0]) - x) <= bound).all()


def test_gear_low_rank_recovers_a_low_rank_residual():
    # No outliers: on a block with a strong rank-1 structure the 2-bit residual is not white
    # and a rank-2 correction removes a real share of it (error non-increasing in rank).
    rng = np.random.default_rng(1)
    x = gaussian((1, 1, 256, 64), 2, std=0.3)
    x += (rng.standard_normal((1, 1, 256, 1)) * rng.standard_normal((1, 1, 1, 64))).astype(np.float32)
    errs = [_gear_error(x, rank=r, sparse_fraction=0.0, energy_threshold=1.0)[0] for r in (0, 1, 2, 8)]
    assert errs[0] > errs[1] > errs[2] > errs[3]
    assert errs[3] < 0.8 * errs[0]
    # energy_threshold trims components: a tiny threshold keeps only the first.
    one, _ = _gear_error(x, rank=8, sparse_fraction=0.0, energy_threshold=1e-6)
    assert one == pytest.approx(errs[1], rel=1e-6)


def test_gear_path_independence():
    x = gaussian((1, 2, 100, 32), 11)
    one = feed(velox.gear_init(1, 2, 32), velox.gear_update, arr(x), arr(-x))
    steps = feed(velox.gear_init(1, 2, 32), velox.gear_update, arr(x), arr(-x), [40, 1, 1, 1, 57])
    states_equal(one, steps)
    assert gear_mod.outlier_count(0.01, 32, 32) == 2 * round(5.12) == 10


# --- amc ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_amc_by_hand(backend):
    # d = 16: Mid keeps round(16 * 43 / 128) = round(5.375) = 5 channels, Low round(16 * 8 /
    # 128) = 1. Four tokens, every key channel equal to a_t: saliency a_t = .1, .5, .3, .2.
    # Tier sizes ceil(.2 * 4) = 1 High, ceil(.3 * 4) = 2 Mid, 1 Low: t1 High, t2 and t3 Mid,
    # t0 Low. Channel order, calibrated on this chunk by mean square: keys tie everywhere
    # (lower channel first: 0, 1, 2, ...); values 0, 255, 0, 255, ... put the odd channels
    # first (1, 3, 5, ...). Mid keeps key channels 0-4 and value channels 1, 3, 5, 7, 9 (all
    # 255, one group of 5 with group_size 8: step 0, exact); Low keeps key channel 0 and
    # value channel 1. Constant groups have step 0: every kept value is its float16 zero.
    a = np.array([0.1, 0.5, 0.3, 0.2], np.float32)
    k = np.repeat(a[:, None], 16, 1)[None, None]
    v = np.tile(np.array([0, 255] * 8, np.float32), (4, 1))[None, None]
    st = velox.amc_init(1, 1, 16, group_size=8, backend=backend)
    st = velox.amc_update(st, arr(k), arr(v))
    assert np.array(amc_mod.token_tiers(st)).tolist() == [[[2, 0, 1, 1]]]
    assert np.array(st.values_order)[0, 0, :5].tolist() == [1, 3, 5, 7, 9]
    got_k, got_v = (np.array(x)[0, 0] for x in velox.amc_get_kv(st))
    want_k, want_v = k[0, 0].copy(), v[0, 0].copy()
    want_k[[2, 3], 5:] = 0          # Mid: key channels 5.. dropped
    want_k[0, 1:] = 0               # Low: key channels 1.. dropped
    want_v[[2, 3], 11:] = 0         # Mid: value channels 11, 13, 15 dropped (evens are 0)
    want_v[0, 2:] = 0               # Low: only value channel 1 kept
    assert np.allclose(got_k, want_k, rtol=2 ** -11, atol=0) and np.array_equal(got_v, want_v)
    # Bytes: High 1 token x 16 x 4 x 2 + position 4; Mid 2 tokens x (2 words x 4 + float16
    # scale and zero, 2 + 2) x 2 kinds + 2 positions x 4; Low 1 x (1 word x 4 + 2 + 2) x 2
    # + 4; channel orders 2 x 16 (uint8); tau_high, tau_low, next_pos 4 each.
    assert velox.amc_bytes(st) == (128 + 4) + (2 * 12 * 2 + 8) + (8 * 2 + 4) + 32 + 12


def test_amc_tier_sizes_and_reductions():
    assert amc_mod.tier_sizes(10, 0.2, 0.3) == {"high": 2, "mid": 3, "low": 5}
    assert amc_mod.tier_sizes(1, 0.2, 0.3) == {"high": 1, "mid": 0, "low": 0}   # decode: exact
    assert amc_mod.tier_sizes(7, 0.0, 1.0) == {"high": 0, "mid": 7, "low": 0}
    assert amc_mod.tier_ranks(128) == {"high": 128, "mid": 43, "low": 8}
    assert amc_mod.tier_ranks(64) == {"high": 64, "mid": 22, "low": 4}
    x = gaussian((1, 2, 40, 16), 12)
    exact = velox.amc_update(velox.amc_init(1, 2, 16, k_high=1.0, k_mid=0.0), arr(x), arr(-x))
    assert np.array_equal(np.array(velox.amc_get_kv(exact)[0]), x)
    steps = feed(velox.amc_init(1, 2, 16), velox.amc_update, arr(x), arr(-x), [1] * 40)
    assert np.array_equal(np.array(velox.amc_get_kv(steps)[1]), -x)  # one token per chunk: High


def test_amc_error_statistics_per_tier():
    # Mid (8 bits) and Low (4 bits) on the kept channels: within half a step, mean squared
    # error ~ step^2 / 12; the dropped channels lose the whole value. Channels have growing
    # scales, so the calibrated order keeps the largest ones.
    d, g = 64, 32
    x = gaussian((1, 4, 200, d), 13) * np.linspace(0.2, 2.0, d, dtype=np.float32)
    st = velox.amc_update(velox.amc_init(1, 4, d, group_size=g), arr(x), arr(x))
    got = np.array(velox.amc_get_kv(st)[0])
    tiers = np.array(amc_mod.token_tiers(st))[0]
    orders = np.array(st.keys_order)[0]
    ranks = amc_mod.tier_ranks(d)
    assert (orders[:, :4] >= d - 8).all()  # the Low tier keeps some of the 8 widest channels
    for t, tier in ((1, "mid"), (2, "low")):
        bits, r = amc_mod.TIER_BITS[tier], ranks[tier]
        rows = np.concatenate([x[0, j][tiers[j] == t][:, orders[j, :r]] for j in range(4)])
        back = np.concatenate([got[0, j][tiers[j] == t][:, orders[j, :r]] for j in range(4)])
        dropped = np.concatenate([got[0, j][tiers[j] == t][:, orders[j, r:]] for j in range(4)])
        groups = [rows[:, i:i + g] for i in range(0, r, g)]
        step = np.concatenate([np.repeat((gr.max(1) - gr.min(1))[:, None] / (2 ** bits - 1),
                                         gr.shape[1], 1) for gr in groups], 1)
        assert (np.abs(rows - back) <= step / 2 * (1 + 1e-5) + 1e-7).all()
        # A group's minimum and maximum are exact: n - 2 of its n entries carry the noise.
        pred = sum(gr.shape[1] - 2 for gr in groups) / r
        assert 0.85 * pred < rms_ratio(rows, back, step) < 1.1 * pred
        assert not dropped.any()
    assert np.array_equal(got[0][tiers == 0], x[0][tiers == 0])
    # Salient tokens are the High ones: mean |k| of High above Mid above Low.
    sal = np.abs(x[0]).mean(-1)
    assert sal[tiers == 0].mean() > sal[tiers == 1].mean() > sal[tiers == 2].mean()


# --- bytes per token at default settings, beside fp16 ----------------------------------------

def _per_token(state, tokens, heads, d):
    measured = velox.nbytes(state)
    return measured, measured / tokens, velox.fp16_bytes(tokens, 1, heads, d) / tokens


def test_bytes_per_token_at_defaults():
    d, f16 = 128, mx.float16
    x = gaussian((1, 1, 1280, d), 20)
    # age_tiered, 1280 tokens: 40 groups; old: (1280 - 1024) // 32 = 8, old or mid:
    # (1280 - 128) // 32 = 36, so 28 mid and 4 recent. Per group and kind: codes
    # 128 x 32 x bits / 8, scales and zeros 128 x 2 x 2 = 512 (keys: per channel; values: 32
    # tokens x 4 channel groups x 2 x 2, the same):
    # old 8 x (1024 + 512), mid 28 x (2048 + 512), recent 4 x (4096 + 512), keys and values,
    # plus next_pos (4): 2 x 102400 + 4 = 204804 bytes: 160.0 per token (fp16: 512).
    st = velox.age_tiered_update(velox.age_tiered_init(1, 1, d, dtype=f16), arr(x, f16), arr(x, f16))
    measured, per_tok, fp16 = _per_token(st, 1280, 1, d)
    assert measured == 2 * (8 * 1536 + 28 * 2560 + 4 * 4608) + 4 == 204804
    assert fp16 == 512 and per_tok == pytest.approx(160.0, abs=0.01)

    # adakv, 4 heads, 64 tokens (2 groups): widths 2, 2, 3, 3 (mean 2.5). Keys: 2 heads x
    # 128 x 64 x 2/8 = 4096 and x 3/8 = 6144, scales and zeros 2 x (2 heads x 128 x 2 groups
    # x 2 bytes) per level = 2048 each; slot map 4 x 2 = 8; stats 4 x 2 x 4 = 32; values
    # exact 4 x 64 x 128 x 2 = 65536; next_pos 16: 79928 bytes, 312.2 per token and head.
    x4 = gaussian((1, 4, 64, d), 21)
    st = velox.adakv_update(velox.adakv_init(1, 4, d, dtype=f16), arr(x4, f16), arr(x4, f16))
    measured, per_tok, fp16 = _per_token(st, 64, 4, d)
    assert measured == 4096 + 2048 + 6144 + 2048 + 8 + 32 + 65536 + 16 == 79928
    assert per_tok / 4 == pytest.approx(312.22, abs=0.01) and fp16 / 4 == 512

    # gear, 64 tokens (2 blocks) per kind: codes 128 x 64 x 2/8 = 2048, scales and zeros
    # 2 x 128 x 2 x 2 = 1024 (values: 64 tokens x 4 groups x 2 x 2), left factors
    # 64 x 2 x 2 = 256, right 2 x 2 x 128 x 2 = 1024, outliers 2 x round(.01 x 4096 / 2) = 40
    # per block: 2 x 40 x (2 + 2) = 320: 4672 per kind, + next_pos 4 = 9348 (146.1 per token).
    x64 = x[:, :, :64]
    st = velox.gear_update(velox.gear_init(1, 1, d, dtype=f16), arr(x64, f16), arr(x64, f16))
    measured, per_tok, fp16 = _per_token(st, 64, 1, d)
    assert measured == 2 * (2048 + 1024 + 256 + 1024 + 320) + 4 == 9348
    assert per_tok == pytest.approx(146.06, abs=0.01)

    # amc, one 100-token chunk: 20 High (128 x 2 x 2 = 512 bytes + position 4), 30 Mid
    # (43 codes at 8 bits in 11 words = 44 bytes, 2 groups: scale and zero 8 bytes, per kind:
    # 104, + position 4), 50 Low (8 codes at 4 bits = 4 bytes, 1 group 4 bytes, per kind:
    # 16, + 4); channel orders 2 x 128; tau_high, tau_low, next_pos: 12.
    # 20 x 516 + 30 x 108 + 50 x 20 + 256 + 12 = 14828 (148.3 per token).
    x100 = x[:, :, :100]
    st = velox.amc_update(velox.amc_init(1, 1, d, dtype=f16), arr(x100, f16), arr(x100, f16))
    measured, per_tok, fp16 = _per_token(st, 100, 1, d)
    assert measured == 20 * 516 + 30 * 108 + 50 * 20 + 256 + 12 == 14828
    assert per_tok == pytest.approx(148.28, abs=0.01)

    # cachegen, 1280 tokens of a random walk: coded words (measured) + scales and zeros
    # 2 kinds x 128 x 40 groups x 2 x 2 + segment lengths 2 x 40 x 4 + packed flags 2 x 40
    # + models 2 x 128 x 2 + next_pos 4.
    walk = np.cumsum(gaussian((1, 1, 1280, d), 22, std=0.1), axis=2)
    st = velox.cachegen_update(velox.cachegen_init(1, 1, d, dtype=f16), arr(walk, f16), arr(walk, f16))
    coded = cachegen_mod.coded_nbytes(st)
    measured, per_tok, fp16 = _per_token(st, 1280, 1, d)
    assert measured == coded + 2 * 128 * 40 * 4 + 2 * 40 * 4 + 2 * 40 + 2 * 128 * 2 + 4
    packed = cachegen_mod.packed_nbytes(st)
    assert packed == 2 * 1280 * 128 * 4 // 8 and coded < 0.9 * packed  # measured: .83
    assert per_tok < 0.9 * (packed + measured - coded) / 1280 and fp16 == 512
