"""The cache of shared constants (index arrays, masks), bounded in bytes.

Constants built in NumPy and handed to MLX once: compiled updates read them rather than run
a chain of primitives at every call. The cache holds at most :data:`CONST_BYTES`, so a cache
that grows a token a step never keeps one array per length alive. ``velox.evict`` (its index
arrays and protection masks) and ``velox.attention`` (its chunk masks) share it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx
import numpy as np

__all__ = ["CONST_BYTES", "cached_const"]

CONST_BYTES = 1 << 20  # bytes the constant cache may hold (1 MiB)
_CONSTS: OrderedDict[tuple, mx.array] = OrderedDict()
_CONST_HELD = [0]


def cached_const(key: tuple, build: Callable[[], np.ndarray]) -> mx.array:
    """``mx.array(build())``, cached by ``key`` (least recently used first out).

    The cache holds at most :data:`CONST_BYTES`; larger arrays are built but not kept. A
    decode step at a full cache asks for the same few shapes every step and hits; a cache
    that grows asks for a new length every step, and the bound keeps those from piling up.
    The arrays are shared: read them, do not assign into them.
    """
    hit = _CONSTS.get(key)
    if hit is not None:
        _CONSTS.move_to_end(key)
        return hit
    arr = mx.array(build())
    if arr.nbytes <= CONST_BYTES:
        _CONSTS[key] = arr
        _CONST_HELD[0] += arr.nbytes
        while _CONST_HELD[0] > CONST_BYTES:
            _CONST_HELD[0] -= _CONSTS.popitem(last=False)[1].nbytes
    return arr
