"""The shape of a state: ``(batch, kv_heads, head_dim, dtype)`` of the array it stores its
rows in (a method's ``dims``, ``velox.registry.register``). ``velox.registry`` re-exports
:func:`dims_of` and :data:`State`; ``velox.evict`` and ``velox.ragged`` read shapes here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

State = tuple  # every state record is a typing.NamedTuple

__all__ = ["State", "dims_of", "method_dims"]


def _keys_dims(state: State) -> tuple[int, int, int, mx.Dtype]:
    b, h, _, d = state.keys.shape
    return b, h, d, state.keys.dtype


def method_dims(m: Any, state: State) -> tuple[int, int, int, mx.Dtype]:
    """``(batch, kv_heads, head_dim, dtype)`` of a state of method ``m``: its ``dims``
    function where it has one, else the shape and dtype of the state's ``keys [b, h, n, d]``."""
    return (m.dims or _keys_dims)(state)


def dims_of(field: str) -> Callable[[Any], tuple[int, int, int, mx.Dtype]]:
    """A ``dims`` function (``register(..., dims=...)``) for states whose array ``field`` is
    ``[b, h, n, d]``: it returns ``(batch, kv_heads, head_dim, dtype)`` of that array."""
    def dims(state) -> tuple[int, int, int, mx.Dtype]:
        rows = getattr(state, field)
        b, h, _, d = rows.shape
        return b, h, d, rows.dtype
    dims.__doc__ = f"``(batch, kv_heads, head_dim, dtype)`` of the state's ``{field} [b, h, n, d]``."
    return dims
