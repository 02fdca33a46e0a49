"""A total order on float scores as unique int64 keys (MLX and NumPy twins).

:func:`order_key` maps each score of the last axis to an int64 that orders like the pair
``(score, index)``: the float32 bits made monotone (a negative float's magnitude bits
flipped, so ``-inf < ... < -0.0 < +0.0 < ... < +inf`` and subnormals in their place), times
the row length, plus the index. Keys are unique within a row, so a sort, an argpartition or a
threshold on them selects the same entries on every backend, with no tie left to the
algorithm.

Tie rule: of equal scores, **the higher index gets the larger key** (along a token axis: the
newer token ranks higher), as eviction's selections break ties. ``ties="older"`` gives the
lower index the larger key instead; it is kept only where a selection documents that rule
(``velox.nuq``'s top-k: the lower index wins; AMC's channel order: the lower channel first).

NaN must not reach the keys: a NaN's bits order above ``+inf`` (or, with the sign bit set,
below ``-inf``), so callers map non-finite scores first (``velox.evict.ranked``) or rank
values that cannot be NaN. Scores are taken as float32 (wider floats are rounded first).
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import numpy as np

from ._typing import Array, Float, Int

__all__ = ["order_key", "order_key_np"]

Ties = Literal["newer", "older"]


def _check(ties: str) -> None:
    if ties not in ("newer", "older"):
        raise ValueError(f"ties={ties!r}: expected 'newer' (the higher index wins) or 'older'")


def order_key(scores: Float[Array, "*batch n"], ties: Ties = "newer") -> Int[Array, "*batch n"]:
    """Unique int64 keys ordered like ``(score, index)`` along the last axis (see the module)."""
    _check(ties)
    bits = mx.view(scores.astype(mx.float32), mx.int32)
    mono = mx.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(mx.int64)
    n = scores.shape[-1]
    index = mx.arange(n, dtype=mx.int64) if ties == "newer" else mx.arange(n - 1, -1, -1, dtype=mx.int64)
    return mono * n + index


def order_key_np(scores: np.ndarray, ties: Ties = "newer") -> np.ndarray:
    """NumPy twin of :func:`order_key` (the same keys)."""
    _check(ties)
    bits = np.ascontiguousarray(scores, np.float32).view(np.int32)
    mono = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(np.int64)
    n = bits.shape[-1]
    index = np.arange(n, dtype=np.int64) if ties == "newer" else np.arange(n - 1, -1, -1, dtype=np.int64)
    return mono * n + index
