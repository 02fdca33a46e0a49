"""Random orthogonal rotations of head vectors, a deterministic function of ``(d, seed)``.

:func:`random_rotation` returns a ``[d, d]`` float32 orthogonal matrix ``R``:

* ``d`` a power of two: the randomized Walsh-Hadamard rotation ``R = H D / sqrt(d)``, with
  ``H`` the Sylvester Hadamard matrix (entries +-1) and ``D`` a diagonal of random signs
  (``R[i, j] = H[i, j] * s[j] / sqrt(d)``), so ``R x = H (s * x) / sqrt(d)``;
* any other ``d``: the Q factor of the QR decomposition of a standard Gaussian matrix, its
  columns' signs fixed by the signs of R's diagonal (Haar-distributed).

The random draws come from ``np.random.default_rng(seed)``, the same on every machine; the
matrix is built in float64 and returned as float32. The dense matrix is the reference: the
codecs multiply by it (``d x d`` per row).

:func:`matmul_per_slice` multiplies each ``[n, k]`` slice of an MLX array (one batch row and
head) by a shared matrix as a product of its own, so that a row's result does not depend on
how many other batch rows or heads are stacked with it (a BLAS rounds one large product
differently from a small one: OpenBLAS does). The encoders use it where a rounding decides a
code (a rotated coordinate's cell, a sketch's sign).

Convention: rows are row vectors, ``rotate(x, R) = x @ R.T`` (each row ``x`` becomes ``R x``)
and ``unrotate(y, R) = y @ R`` (``R^T y``); both work on NumPy and on MLX arrays.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

__all__ = ["is_power_of_two", "hadamard", "random_rotation", "rotate", "unrotate",
           "matmul_per_slice"]


def is_power_of_two(d: int) -> bool:
    return d >= 1 and d & (d - 1) == 0


def hadamard(d: int) -> np.ndarray:
    """The Sylvester Hadamard matrix of order ``d`` (a power of two), entries +-1, float64."""
    if not is_power_of_two(d):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.lru_cache(maxsize=64)
def _rotation(d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if is_power_of_two(d):
        signs = rng.integers(0, 2, size=d) * 2 - 1
        r = hadamard(d) * signs[None, :] / np.sqrt(d)
    else:
        q, upper = np.linalg.qr(rng.standard_normal((d, d)))
        r = q * np.where(np.diag(upper) < 0, -1.0, 1.0)[None, :]
    out = r.astype(np.float32)
    out.setflags(write=False)
    return out


def random_rotation(d: int, seed: int) -> np.ndarray:
    """An orthogonal ``[d, d]`` float32 matrix, deterministic in ``(d, seed)`` (a fresh copy)."""
    if int(d) < 1:
        raise ValueError(f"rotation dimension must be positive, got {d}")
    return _rotation(int(d), int(seed)).copy()


def rotate(x, r):
    """Each row ``x`` (last axis) as ``R x``: ``x @ R.T`` (NumPy or MLX)."""
    return x @ r.T


def unrotate(y, r):
    """Each row ``y`` as ``R^T y``: ``y @ R``, the inverse of :func:`rotate`."""
    return y @ r


def matmul_per_slice(x, w):
    """``x @ w`` for ``x`` ``[..., n, k]`` (MLX) and ``w`` ``[k, m]``, computed as one product
    per ``[n, k]`` slice of ``x``'s leading axes: ``w`` is broadcast over them, so the backend
    runs a batched product rather than folding every slice into one ``[.. * n, k]`` matrix.
    A slice's result is then the same whatever the leading axes hold (a batch row alone or
    stacked with others, one head or all of them)."""
    if x.ndim <= 2:
        return x @ w
    return x @ mx.broadcast_to(w, x.shape[:-2] + w.shape)
