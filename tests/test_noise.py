"""velox.noise: the mixer's MLX and NumPy twins give the same bits, the draws the same values."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from velox import noise
from velox.methods import cam, keyformer

_u32 = st.integers(0, 2**32 - 1)


@given(x=st.lists(_u32, min_size=1, max_size=64))
def test_mix_twins_agree(x):
    a = np.array(x + [0, 1, 2**31, 2**32 - 1], np.uint32)
    got = noise.mix(mx.array(a))
    assert got.dtype == mx.uint32
    assert np.array_equal(np.array(got), noise.mix_np(a))


@given(seed=_u32, a=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=32), paired=st.booleans())
def test_hash_uniform_twins_agree_exactly(seed, a, paired):
    a = np.array(a, np.int64)
    b = a[::-1].copy() if paired else None
    got = noise.hash_uniform(seed, mx.array(a.astype(np.int32)),
                             None if b is None else mx.array(b.astype(np.int32)))
    want = noise.hash_uniform_np(seed, a, b)
    assert got.dtype == mx.float32 and want.dtype == np.float64
    assert np.array_equal(np.array(got).astype(np.float64), want)  # float32 holds them exactly
    assert ((want > 0) & (want < 1)).all()


def test_the_methods_draw_from_velox_noise():
    assert keyformer.hash_uniform is noise.hash_uniform
    assert keyformer.hash_uniform_np is noise.hash_uniform_np
    assert cam.hash_uniform is noise.hash_uniform and cam.hash_uniform_np is noise.hash_uniform_np
