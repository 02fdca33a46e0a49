"""CacheGen: a hand-computed case on every backend, exact entropy-coding round trips, codes
below fixed width on smooth data, fixed-width segments read without host decoding, mixed
segments, path independence and the layer schedule."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import entropy, nuq, quant
from velox.methods import cachegen as cachegen_mod
from velox.registry import get_method

from tests._helpers import BACKENDS, arr, feed, gaussian, per_channel, rms_ratio, states_equal


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
