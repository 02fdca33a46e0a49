"""Properties shared by the quantizing methods: one chunk equal to token by token (KITTY,
KVQuant, SKVQ, ZipCache), error statistics against plain uniform quantization on planted
outliers (with KIVI-Sink), and bytes at the defaults against a hand count (these five per
group of tokens; AdaKV, age-tiered, GEAR, AMC and CacheGen for a whole state)."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.methods import cachegen as cachegen_mod

from tests._helpers import (BACKENDS, SUPPORTED, _data, _errors, _planted, arr, gaussian, same_state,
                            feed_in_chunks as feed)


CHUNKED = {
    "kitty": dict(),
    "kvquant": dict(outlier_fraction=0.05, n_sink=3),
    "skvq": dict(window=6, n_sink=2),
    "zipcache": dict(hi_fraction=0.0, group_size=8),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", sorted(CHUNKED))
def test_one_chunk_equals_token_by_token(key, backend):
    """Decisions depend on positions and each group's own tokens: one chunk == token by token."""
    m = velox.get_method(key)
    k, v = _data(1, 2, 70, 32, seed=4)
    a = m.update(m.init(1, 2, 32, backend=backend, **CHUNKED[key]), k, v)
    b = feed(m.update, m.init(1, 2, 32, backend=backend, **CHUNKED[key]), k, v, [1] * 70)
    assert same_state(a, b)


# --- error statistics on Gaussian data with planted outliers --------------------------

# Relative error on _planted() (every token quantized: no window, residual or sinks), as
# (mean |error|, max |error|) / std of the input, times 2**bits - 1 (the step count, which makes
# the figure roughly constant across bit-widths). Measured maxima over the supported bit-widths,
# keys and values: kivi_sink (0.70, 17.0), kvquant (0.70, 15.3), skvq (1.25, 24.4: per-token
# groups share one range across channels, the planted channels included), zipcache (0.99, 14.3),
# kitty (1.09, 17.5). The limits leave ~1.3x headroom.
LIMITS = {"kivi_sink": (0.9, 22), "kvquant": (0.9, 20), "skvq": (1.6, 32), "zipcache": (1.3, 19),
          "kitty": (1.4, 23)}
_UP = {1: 3, 2: 4, 3: 5, 4: 6, 5: 7, 6: 8, 7: 8, 8: 8}  # the high bit-width paired with each low one
SETTINGS = {
    "kivi_sink": lambda b: dict(bits=b, residual_length=0, n_sink_tokens=5),
    "kvquant": lambda b: dict(bits=b, n_sink=0),
    "skvq": lambda b: dict(bits_key=b, bits_value=b, window=0, n_sink=0),
    "zipcache": lambda b: dict(lo_bits=b, hi_bits=_UP[b]),
    "kitty": lambda b: dict(lo_bit=b, hi_bit=_UP[b]),
}


@pytest.mark.parametrize("key", sorted(SUPPORTED))
def test_error_statistics(key):
    k, v = _planted()
    mean_limit, max_limit = LIMITS[key]
    for bits in SUPPORTED[key]:
        steps = (1 << bits) - 1
        for err, x in zip(_errors(key, k, v, **SETTINGS[key](bits)), (k, v)):
            scale = float(np.array(x).std())
            assert err.mean() / scale * steps < mean_limit, (bits, err.mean() / scale)
            assert err.max() / scale * steps < max_limit, (bits, err.max() / scale)


# --- bytes per token at default settings, beside fp16 ----------------------------------

# Marginal bytes per group of 32 tokens at the defaults, fp16, head_dim 128 (fp16: 512 B/token).
HAND = {
    # keys 128 x 2 bits = 32 B, key scale + zero per channel per 32 tokens 2 x 2 B x 128 / 32 = 16,
    # values 32 B, value scale + zero per 32 channels 4 x 2 x 2 B = 16: 96 B/token.
    "kivi_sink": 96 * 32,
    # codes 3 bits: 48 B keys + 48 B values per token; key scale/zero 16 B/token; key outliers
    # ceil(.32) = 1 per channel per group: 128 x (2 B + 1 B index) per group; value scale/zero
    # 4 B/token; value outliers ceil(1.28) = 2 per token x 3 B; level tables 2 x 8 x 2 B per group.
    "kvquant": (48 + 48 + 16 + 4 + 6) * 32 + 128 * 3 + 2 * 8 * 2,
    # per token: key and value codes 32 + 32 B, scales + zeros 4 groups x 2 x 2 B each: 96 B/token.
    "skvq": 96 * 32,
    # per group: k = round(6.4) = 6 salient tokens at 4 bits, 26 at 2: key codes 6 x 64 + 26 x 32,
    # per-channel scale/zero of both sets 4 x 128 x 2 B, 6 salient indices; values alike (codes)
    # plus channel factors 128 x 2 B and per-token scale/zero 32 x 2 x 2 B.
    "zipcache": 2 * (6 * 64 + 26 * 32) + 4 * 128 * 2 + 6 + 128 * 2 + 32 * 4,
    # per token: 32 boosted channels x 4 bits + 96 x 2 bits = 40 B, key scale/zero 16 B, the
    # boosted indices 32 B per group (1 B/token), values 32 B + scale/zero 4 B: 93 B/token.
    "kitty": 93 * 32,
}


@pytest.mark.parametrize("key", sorted(HAND))
def test_bytes_per_token_at_defaults(key):
    m = velox.get_method(key)
    k, v = _data(1, 1, 512, 128, seed=10, dtype=mx.float16)
    st = m.update(m.init(1, 1, 128, dtype=mx.float16), k[:, :, :448], v[:, :, :448])
    before = m.nbytes(st)
    st = m.update(st, k[:, :, 448:480], v[:, :, 448:480])
    per_group = m.nbytes(st) - before
    assert per_group == HAND[key]
    fp16 = velox.fp16_bytes(32, 1, 1, 128)
    assert fp16 == 512 * 32 and per_group < fp16 / 3.5  # each stores under 2/7 of fp16


def _per_token(state, tokens, heads, d):
    measured = velox.nbytes(state)
    return measured, measured / tokens, velox.fp16_bytes(tokens, 1, heads, d) / tokens


def test_bytes_of_a_whole_state_at_defaults():
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
