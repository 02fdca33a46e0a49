"""Counter-based uniform noise: a deterministic hash of ``(seed, a[, b])`` (MLX and NumPy twins).

The mixer is lowbias32 (C. Wellons), a 32-bit integer hash; nested on ``(seed, a, b)``,
``mix(mix(mix(seed) ^ a) ^ b)``, it is a counter-based generator: every draw depends on its
integers alone (positions, say), not on the batch layout, the chunking or the order of the
draws. The top 23 bits of the hash give a float in ``(0, 1)``, ``(h >> 9 + 0.5) * 2**-23``,
never 0 or 1 (so ``-log(-log(u))`` is finite).

:func:`hash_uniform` and :func:`hash_uniform_np` return the same values (float32 and
float64, the float32 values exactly); :func:`mix_np` is the mixer in NumPy, for callers
that precompute ``mix(seed)`` (the CUDA kernels, which draw the same noise on the device).
Used by Keyformer's Gumbel noise and CaM's merge gate.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = ["mix", "mix_np", "hash_uniform", "hash_uniform_np"]

_M1, _M2 = 0x7FEB352D, 0x846CA68B


def mix(x: mx.array) -> mx.array:
    """lowbias32 of each ``uint32`` element."""
    x = x ^ (x >> 16)
    x = x * mx.array(_M1, mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(_M2, mx.uint32)
    return x ^ (x >> 16)


def mix_np(x: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`mix` (``uint32`` in, ``uint32`` out; products wrap)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(_M1)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(_M2)
        return x ^ (x >> np.uint32(16))


def hash_uniform(seed: int, a: mx.array, b: mx.array | None = None) -> mx.array:
    """Uniform floats in (0, 1), a deterministic function of ``(seed, a[, b])`` elementwise."""
    h = mix(mix(mx.array(seed, mx.uint32)) ^ a.astype(mx.uint32))
    if b is not None:
        h = mix(h ^ b.astype(mx.uint32))
    return ((h >> 9).astype(mx.float32) + 0.5) * (2.0 ** -23)


def hash_uniform_np(seed: int, a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`hash_uniform` (the same values, as float64)."""
    h = mix_np(mix_np(np.atleast_1d(np.uint32(seed))) ^ np.asarray(a).astype(np.uint32))
    if b is not None:
        h = mix_np(h ^ np.asarray(b).astype(np.uint32))
    return ((h >> np.uint32(9)).astype(np.float64) + 0.5) * 2.0 ** -23
