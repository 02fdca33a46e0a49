"""velox.ordering: the int64 keys order like (value, index), the same in MLX and NumPy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from velox.ordering import order_key, order_key_np

_TINY = float(np.finfo(np.float32).smallest_subnormal)
# Values that tie often and sit on the order's edges: signed zeros, subnormals, infinities.
_EDGES = [0.0, -0.0, _TINY, -_TINY, 3 * _TINY, float(np.finfo(np.float32).tiny), -1.0, 1.0,
          float(np.finfo(np.float32).max), -float(np.finfo(np.float32).max), np.inf, -np.inf]
_values = st.one_of(st.sampled_from(_EDGES),
                    st.floats(width=32, allow_nan=False, allow_subnormal=True))
_rows = arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 40)), elements=_values)


def _lexsort(x: np.ndarray, ties: str) -> np.ndarray:
    """Ascending (value, index) order of each row by lexsort; -0.0 below +0.0."""
    i = np.broadcast_to(np.arange(x.shape[-1]), x.shape)
    sign = np.signbit(x) & (x == 0)  # -0.0 ranks below +0.0
    value = x.astype(np.float64)
    index = i if ties == "newer" else -i
    return np.stack([np.lexsort((index[r], ~sign[r], value[r])) for r in range(x.shape[0])])


@pytest.mark.parametrize("ties", ["newer", "older"])
@given(x=_rows)
def test_sorting_by_the_key_is_a_lexsort(x, ties):
    key = order_key_np(x, ties=ties)
    assert key.dtype == np.int64
    assert np.array_equal(np.argsort(key, axis=-1), _lexsort(x, ties))
    assert all(len(set(row)) == len(row) for row in key)  # unique within a row


@pytest.mark.parametrize("ties", ["newer", "older"])
@given(x=_rows)
def test_mlx_and_numpy_keys_agree(x, ties):
    got = order_key(mx.array(x), ties=ties)
    assert got.dtype == mx.int64
    assert np.array_equal(np.array(got), order_key_np(x, ties=ties))


def test_tie_rules():
    x = np.array([[2.0, 2.0, 1.0, 2.0]], np.float32)
    assert list(np.argsort(-order_key_np(x))[0]) == [3, 1, 0, 2]            # newer first
    assert list(np.argsort(-order_key_np(x, ties="older"))[0]) == [0, 1, 3, 2]  # older first


def test_wider_floats_rank_as_float32():
    x = np.array([1.0, 1.0 + 1e-12, 0.5])
    assert np.array_equal(order_key_np(x), order_key_np(x.astype(np.float32)))
    assert np.array_equal(np.array(order_key(mx.array(x.astype(np.float16)))),
                          order_key_np(x.astype(np.float16)))


def test_an_unknown_tie_rule_raises(no_shape_checks):
    for key, x in ((order_key_np, np.zeros(3, np.float32)), (order_key, mx.zeros(3))):
        with pytest.raises(ValueError, match="ties='lower'"):
            key(x, ties="lower")
