"""Byte accounting: what a state really holds, and the fp16 cost of the tokens it has seen."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

__all__ = ["state_nbytes", "fp16_bytes"]


def state_nbytes(state: Any) -> int:
    """Sum of ``nbytes`` over every array in a state record (nested records included)."""
    return int(sum(x.nbytes for _, x in tree_flatten(state) if isinstance(x, mx.array)))


def fp16_bytes(tokens: int, batch: int, kv_heads: int, head_dim: int) -> int:
    """Bytes an uncompressed fp16 cache needs for ``tokens`` keys and values per head."""
    return int(tokens) * batch * kv_heads * head_dim * 2 * 2
