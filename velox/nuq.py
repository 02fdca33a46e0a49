"""Shared mechanics of the mixed-precision and non-uniform quantizers (MLX and NumPy twins).

* Deterministic reductions: :func:`tree_sum` adds pairwise in a fixed order, so the MLX and
  NumPy backends produce bit-identical float32 statistics, and a statistic that drives a
  discrete choice (a top-k, an argmin, a Lloyd level) never differs between backends.
* Rank selection: :func:`top_k_mask` / :func:`top_k_indices` pick the ``k`` largest entries
  with a total order (ties: the lower index wins), through the unique integer keys of
  ``velox.ordering`` (``ties="older"``).
* Affine codes: :func:`affine` is ``velox.quant.quantize`` without the packing (one group per
  last-axis row, optional clip factor, float16 side data), so callers pack codes along any axis.
* Non-uniform levels: :func:`lloyd` fits ``2**bits`` levels in ``[0, 1]`` to normalized points
  by Lloyd iterations from the uniform grid; :func:`nearest` assigns each point its nearest
  level; :func:`level_bound` is the half-gap bound of that assignment.

Every ``np_*`` function is the NumPy twin of the MLX function of the same name, written with
the same float32 operations in the same order.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from . import ordering, quant
from . import reference as ref
from ._typing import Array, Bool, Float, Int, UInt

__all__ = ["round_count", "ceil_count", "index_dtype", "tree_sum", "np_tree_sum", "order_key",
           "np_order_key", "top_k_mask", "np_top_k_mask", "top_k_indices", "np_top_k_indices",
           "affine", "np_affine", "np_round", "np_pack", "affine_bound",
           "lloyd", "np_lloyd", "nearest", "np_nearest", "level_bound", "levels_error_bound",
           "uniform_levels"]

_U32 = 2.0 ** -24


def round_count(fraction: float, n: int) -> int:
    """``fraction * n`` rounded half up (the number of items a fraction selects)."""
    return int(math.floor(fraction * n + 0.5))


def ceil_count(fraction: float, n: int) -> int:
    """At least ``fraction`` of ``n`` items: ``ceil(fraction * n)`` (float noise ignored)."""
    return int(math.ceil(fraction * n - 1e-9))


def index_dtype(n: int) -> mx.Dtype:
    """The smallest unsigned integer type that indexes ``n`` items."""
    return mx.uint8 if n <= 256 else mx.uint16 if n <= 65536 else mx.uint32


# --- deterministic reductions and ranks --------------------------------------------------

def tree_sum(x: Float[Array, "*batch n"]) -> Float[Array, "*batch"]:
    """Float32 sum over the last axis in a fixed pairwise order (zero-padded to a power of 2)."""
    x = x.astype(mx.float32)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = mx.concatenate([x, mx.zeros(x.shape[:-1] + (p - n,), mx.float32)], axis=-1)
    while p > 1:
        p //= 2
        x = x[..., :p] + x[..., p:]
    return x[..., 0]


def np_tree_sum(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (p - n,), np.float32)], axis=-1)
    while p > 1:
        p //= 2
        x = x[..., :p] + x[..., p:]
    return x[..., 0]


def order_key(x: Float[Array, "*batch n"]) -> Int[Array, "*batch n"]:
    """Unique int64 keys ordered like ``x`` along the last axis; equal values: lower index larger
    (``velox.ordering.order_key`` with ``ties="older"``)."""
    return ordering.order_key(x, ties="older")


def np_order_key(x: np.ndarray) -> np.ndarray:
    return ordering.order_key_np(x, ties="older")


def top_k_mask(x: Float[Array, "*batch n"], k: int) -> Bool[Array, "*batch n"]:
    """``True`` at the ``k`` largest entries of each row (ties: the lower index wins)."""
    n = x.shape[-1]
    if k <= 0:
        return mx.zeros(x.shape, mx.bool_)
    if k >= n:
        return mx.ones(x.shape, mx.bool_)
    key = order_key(x)
    kth = mx.sort(key, axis=-1)[..., n - k:n - k + 1]
    return key >= kth


def np_top_k_mask(x: np.ndarray, k: int) -> np.ndarray:
    n = x.shape[-1]
    if k <= 0:
        return np.zeros(x.shape, bool)
    if k >= n:
        return np.ones(x.shape, bool)
    key = np_order_key(x)
    return key >= np.sort(key, axis=-1)[..., n - k:n - k + 1]


def top_k_indices(x: Float[Array, "*batch n"], k: int,
                  mask: mx.array | None = None) -> tuple[Int[Array, "*batch k"], Int[Array, "*batch n"]]:
    """Ascending indices of the ``k`` largest entries, and the permutation they start.

    Returns ``(top, perm)``: ``perm`` lists the selected indices ascending, then the others
    ascending; ``top = perm[..., :k]``. ``mask``: ``top_k_mask(x, k)`` when already known.
    """
    n = x.shape[-1]
    i = mx.arange(n, dtype=mx.int32)
    mask = top_k_mask(x, k) if mask is None else mask
    perm = mx.argsort(mx.where(mask, i, n + i), axis=-1).astype(mx.int32)
    return perm[..., :k], perm


def np_top_k_indices(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[-1]
    i = np.arange(n)
    perm = np.argsort(np.where(np_top_k_mask(x, k), i, n + i), axis=-1)
    return perm[..., :k], perm


# --- affine (min/max) codes --------------------------------------------------------------

def affine(x: Float[Array, "*batch m"], bits: int, dtype: mx.Dtype, alpha: mx.array | None = None):
    """Min/max codes of each last-axis row: ``(codes uint32 [..., m], scales, zeros)``.

    ``velox.quant.affine_codes`` (``velox.quant.quantize`` with one group per row and no
    packing); scales and zeros are stored in ``velox.quant.side_dtype(dtype)``. With
    ``alpha`` the range is clipped to ``[alpha * min, alpha * max]`` and values outside
    saturate.
    """
    return quant.affine_codes(x, bits, quant.side_dtype(dtype), alpha)


def np_round(x: np.ndarray | np.generic, dtype: mx.Dtype) -> np.ndarray:
    """Round float32 values to ``dtype`` and back (the stored precision of side data)."""
    x = np.asarray(x, np.float32)
    return ref.round_to(x, dtype).reshape(x.shape)


def np_affine(x: np.ndarray, bits: int, dtype: mx.Dtype, alpha: np.ndarray | np.generic | None = None):
    dtype = quant.side_dtype(dtype)
    levels = (1 << bits) - 1
    g = np.asarray(x, np.float32)
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    if alpha is not None:
        lo = (lo * alpha).astype(np.float32)
        hi = (hi * alpha).astype(np.float32)
    scales = np_round((hi - lo) / np.float32(levels), dtype)
    zeros = np_round(lo, dtype)
    s32, z32 = scales[..., None], zeros[..., None]
    safe = np.where(s32 > 0, s32, np.float32(1.0))
    with np.errstate(invalid="ignore"):
        q = np.clip(np.round((g - z32) / safe), 0, levels)
    return np.where((s32 > 0) & ~np.isnan(q), q, 0).astype(np.uint32), scales, zeros


def np_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """``velox.reference.pack_codes`` (the NumPy twin of ``velox.quant.pack``), empty-safe."""
    if codes.size == 0:
        return np.zeros(codes.shape[:-1] + (codes.shape[-1] * bits // 32,), np.uint32)
    return ref.pack_codes(codes.astype(np.uint32), bits)


def affine_bound(scales: Float[Array, "*batch"], zeros: Float[Array, "*batch"], bits: int,
                 alpha: mx.array | None = None) -> Float[Array, "*batch"]:
    """Bound on ``|x - x_hat|`` for a row of :func:`affine`: ``velox.quant.error_bound``,
    plus, for a clipped range, the saturation excess ``(1/alpha - 1) * max(|lo|, |hi|)``."""
    bound = quant.error_bound(scales, zeros, bits, 1)
    if alpha is None:
        return bound
    s = scales.astype(mx.float32)
    z = zeros.astype(mx.float32)
    edge = mx.maximum(mx.abs(z), mx.abs(z + ((1 << bits) - 1) * s))
    slack = 1 + 4 * quant.unit_roundoff(scales.dtype) + 8 * _U32
    return bound + (1 / alpha - 1) * edge * slack


# --- non-uniform levels ------------------------------------------------------------------

def uniform_levels(n_levels: int) -> Float[Array, "n"]:
    """``i / (n - 1)``: the uniform grid Lloyd iterations start from."""
    return mx.arange(n_levels, dtype=mx.float32) / (n_levels - 1)


def nearest(u: Float[Array, "*batch n"], levels: Float[Array, "*batch l"]) -> UInt[Array, "*batch n"]:
    """Index of the nearest of the ascending ``levels`` (a midpoint goes to the lower level)."""
    lv = levels.astype(mx.float32)
    mids = (lv[..., :-1] + lv[..., 1:]) * 0.5
    return (u[..., :, None] > mids[..., None, :]).astype(mx.uint32).sum(axis=-1)


def np_nearest(u: np.ndarray, levels: np.ndarray) -> np.ndarray:
    lv = np.asarray(levels, np.float32)
    mids = (lv[..., :-1] + lv[..., 1:]) * np.float32(0.5)
    return (np.asarray(u, np.float32)[..., :, None] > mids[..., None, :]).sum(axis=-1).astype(np.uint32)


_FIX = 2.0 ** 30  # fixed-point scale of the Lloyd sums (exact in int64, in any order)


def lloyd(u: Float[Array, "*batch n"], valid: Bool[Array, "*batch n"], n_levels: int, iters: int,
          dtype: mx.Dtype) -> Float[Array, "*batch l"]:
    """Lloyd-Max levels for the valid points ``u`` (normalized to ``[0, 1]``) of each row.

    Starts from the uniform grid; each iteration assigns every point its nearest level (a
    midpoint goes to the lower level) and moves each level to the mean of its points (a level
    without points stays). The points are sorted once, so a level's points are a run between
    two counts, and its sum a difference of prefix sums, taken in 2**-30 fixed point (int64:
    exact, hence identical in every backend). Returns the levels rounded to ``dtype`` (their
    stored precision), as float32, ascending.
    """
    n = u.shape[-1]
    lv = mx.broadcast_to(uniform_levels(n_levels), u.shape[:-1] + (n_levels,))
    srt = mx.sort(mx.where(valid, u.astype(mx.float32), mx.inf), axis=-1)     # invalid last
    n_valid = valid.astype(mx.int32).sum(axis=-1, keepdims=True)
    fixed = mx.where(mx.arange(n) < n_valid, mx.round(srt * _FIX), 0.0).astype(mx.int64)
    zero = mx.zeros(fixed.shape[:-1] + (1,), mx.int64)
    prefix = mx.concatenate([zero, mx.cumsum(fixed, axis=-1)], axis=-1)
    for _ in range(iters):
        mids = (lv[..., :-1] + lv[..., 1:]) * 0.5
        ends = mx.concatenate([mx.zeros_like(n_valid), _count_le(srt, mids), n_valid], axis=-1)
        total = (mx.take_along_axis(prefix, ends[..., 1:], axis=-1)
                 - mx.take_along_axis(prefix, ends[..., :-1], axis=-1))
        count = ends[..., 1:] - ends[..., :-1]
        mean = total.astype(mx.float32) / mx.maximum(count, 1).astype(mx.float32) / _FIX
        lv = mx.where(count > 0, mean, lv)
    return lv.astype(dtype).astype(mx.float32)


def _count_le(srt: mx.array, vals: mx.array) -> mx.array:
    """``[..., m]``: how many entries of each ascending row ``srt [..., n]`` are ``<= vals``
    (a binary search, ``log2(n)`` gathers)."""
    n = srt.shape[-1]
    pos = mx.zeros(vals.shape, mx.int32)
    step = 1 << (n.bit_length() - 1) if n else 0
    while step:
        cand = pos + step
        probe = mx.take_along_axis(srt, mx.minimum(cand, n) - 1, axis=-1)
        pos = mx.where((cand <= n) & (probe <= vals), cand, pos)
        step //= 2
    return pos


def np_lloyd(u: np.ndarray, valid: np.ndarray, n_levels: int, iters: int, dtype: mx.Dtype) -> np.ndarray:
    """:func:`lloyd` of one row ``u [n]``."""
    u = np.asarray(u, np.float32)
    lv = np.arange(n_levels, dtype=np.float32) / np.float32(n_levels - 1)
    lv = np.broadcast_to(lv, u.shape[:-1] + (n_levels,)).copy()
    pts = np.sort(u[valid])                                     # the valid points, ascending
    prefix = np.concatenate([[0], np.cumsum(np.round(pts * np.float32(_FIX)).astype(np.int64))])
    for _ in range(iters):
        mids = (lv[:-1] + lv[1:]) * np.float32(0.5)
        ends = np.concatenate([[0], np.searchsorted(pts, mids, side="right"), [len(pts)]])
        for j in range(n_levels):                               # level j: points ends[j]..ends[j+1]-1
            count = ends[j + 1] - ends[j]
            if count:
                total = np.float32(prefix[ends[j + 1]] - prefix[ends[j]])
                lv[j] = total / np.float32(count) / np.float32(_FIX)
    return np_round(lv, dtype)


def level_bound(levels: Float[Array, "*batch l"]) -> Float[Array, "*batch l"]:
    """Per level: the farthest a point in ``[0, 1]`` assigned to it can lie from it.

    Half the gap to each neighbouring level, and for the end levels the distance to 0 and 1.
    """
    lv = levels.astype(mx.float32)
    gap = (lv[..., 1:] - lv[..., :-1]) * 0.5
    below = mx.concatenate([mx.maximum(lv[..., :1], 0.0), gap], axis=-1)
    above = mx.concatenate([gap, mx.maximum(1.0 - lv[..., -1:], 0.0)], axis=-1)
    return mx.maximum(below, above)


def levels_error_bound(codes: UInt[Array, "*batch n"], levels: Float[Array, "*batch l"],
                       scales: mx.array, zeros: mx.array) -> Float[Array, "*batch n"]:
    """Bound on ``|x - (zero + scale * levels[code])|`` for points normalized to ``[0, 1]``.

    ``scale`` times the level's :func:`level_bound`, plus dtype rounding: the stored zero and
    scale (the normalized point may leave ``[0, 1]`` by their rounding) and the final
    reconstruction in the cache dtype (as in ``velox.quant.error_bound``).
    """
    u = quant.unit_roundoff(scales.dtype)
    s = scales.astype(mx.float32)
    z = mx.abs(zeros.astype(mx.float32))
    top = z + s
    half = mx.take_along_axis(level_bound(levels), codes.astype(mx.int32), axis=-1)
    return s * half + u * (2 * z + 2 * s) + u * top + 8 * _U32 * top
