"""AMC: a hand-computed case on every backend, the tier sizes and their reductions, and the
error statistics per tier."""

import numpy as np
import pytest

import velox
from velox.methods import amc as amc_mod

from tests._helpers import BACKENDS, arr, feed, gaussian, rms_ratio


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
