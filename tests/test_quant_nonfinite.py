"""What one non-finite or overflowing input element does to every quantizer's cache.

One element (a NaN, an inf, or 1e6: beyond float16's 65504, where the float16 side data
overflows) is put into head 0 of batch row 0, at token 40 (old enough to be quantized at
every method's defaults) and channel 5, of keys or values; 320 tokens in one chunk, float32
cache. The test compares ``get_kv`` with a clean run and checks, per method, the measured
reach: which elements turn non-finite and which elements change at all. The reaches are
documented in docs/quantization.md and docs/results/quantization/README.md.

Reach names (``changed`` elements lie within):
    ``group``: the element's quantization group (keys: its channel over a group of 32 tokens;
        values: its token's 32-channel group or whole row, per method);
    ``block``: the 32-token block holding the element (every channel of the head);
    ``head``: its kv head (every token: calibration, ranking or saliency state is poisoned);
    ``row``: its batch row (several heads: a statistic summed over heads).
Other batch rows never change.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

import velox

B, H, N, D = 2, 2, 320, 64
T, C = 40, 5
BAD = {"nan": math.nan, "inf": math.inf, "big": 1e6}

# (reach, non-finite elements) per method, kind ("k"/"v") and bad value, as measured.
# A key element's group is 32 tokens x 1 channel; a value's, 1 token x 32 (or 64) channels.
G = "group"
EXPECT = {
    "kivi": {"k": (G, 32), "v": (G, 32)},
    "xquant": {"k": (G, 32), "v": (G, 32)},            # an anchor alone: KIVI's groups
    "age_tiered": {"k": (G, 32), "v": (G, 32)},
    "cachegen": {"k": (G, 32), "v": (G, 32)},
    "kitty": {"k": (G, 32), "v": (G, 64)},             # a value row is one group
    "adakv": {"k": (G, 32), "v": (G, 1), ("k", "nan"): ("row", 32)},  # NaN importance reranks
    "gear": {"k": ("block", 1), "v": ("block", 1)},    # outlier kept exact; SVD of the block
    "kvquant": {"k": ("block", 1), "v": ("block", 1)},  # outlier exact; one level table a group
    "skvq": {"k": ("head", 32), "v": ("head", 32)},    # token 40 is in the calibration window
    "amc": {"k": ("head", 1), "v": ("head", 1)},       # exact High row; first-chunk channel order
    "kivi_sink": {"k": ("row", 1), "v": (G, 32)},      # sink choice by norm summed over heads
    "zipcache": {"k": ("row", None), "v": ("block", None)},  # attention scores of every query
}
# Keys quantized per token (groups of channels), like values.
KEYS_PER_TOKEN = {"skvq"}
# Values quantized per channel along tokens, like keys (none now: every quantizer's values
# are per token).
VALUES_PER_CHANNEL: set = set()
# 1e6 is finite: methods that keep the element exact (an outlier or an exact row) hold it.
FINITE_BIG = {"gear", "kvquant", "amc"}


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, H, N, D)).astype(np.float32),
            rng.standard_normal((B, H, N, D)).astype(np.float32))


def _run(key, k, v):
    st = velox.init(key, B, H, D, dtype=mx.float32)
    st = velox.update(st, mx.array(k), mx.array(v))
    return tuple(np.array(x.astype(mx.float32)) for x in velox.get_kv(st))


def _within(reach: str, kind: str, key: str, mask: np.ndarray) -> bool:
    """Whether ``mask [B, H, N, D]`` lies within ``reach`` of the bad element."""
    allowed = np.zeros(mask.shape, bool)
    if reach == "row":
        allowed[0] = True
    elif reach == "head":
        allowed[0, 0] = True
    elif reach == "block":
        allowed[0, 0, 32:64] = True
        if key == "kvquant":  # one sink token shifts KVQuant's groups by one position
            allowed[0, 0, 33:65] = True
    elif (kind == "k" and key not in KEYS_PER_TOKEN) or (kind == "v" and key in VALUES_PER_CHANNEL):
        allowed[0, 0, 32:64, C] = True
    else:
        allowed[0, 0, T] = True
    return not (mask & ~allowed).any()


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("key", sorted(EXPECT))
def test_one_bad_element(key, kind, bad):
    k, v = _data()
    clean = _run(key, k, v)
    x = k if kind == "k" else v
    x[0, 0, T, C] = BAD[bad]
    got = _run(key, k, v)
    reach, nonfinite = EXPECT[key].get((kind, bad), EXPECT[key][kind])
    if bad == "big" and key in FINITE_BIG:
        nonfinite = 0
    changed = np.zeros(got[0].shape, bool)
    for g, c in zip(got, clean):
        changed |= (g != c) | ~np.isfinite(g)
    bad_mask = sum(~np.isfinite(g) for g in got).astype(bool)
    assert not changed[1].any(), "another batch row changed"
    assert _within(reach, kind, key, changed), f"changes reach beyond the {reach}"
    if nonfinite is not None:
        assert int(bad_mask.sum()) == nonfinite
    if nonfinite:  # the non-finite elements are the element's own group
        assert _within(G, kind, key, bad_mask)
        # a group's reach is exactly the group when it turns non-finite
        if reach == G:
            assert int(changed.sum()) == nonfinite
