"""Product quantization primitives: sub-vectors, nearest centroids, k-means, packed indices,
decoding and asymmetric-distance scores, in MLX with NumPy twins (suffix ``_np``).

A row ``x [..., d]`` is cut into ``J = d / s`` sub-vectors of ``s`` coordinates
(:func:`split`: ``[..., J, s]``); each sub-vector is held as the index of a centroid of a
codebook of ``K`` entries. A codebook is ``[K, s]`` (one for every sub-space and kv head),
``[h, K, s]`` (one a kv head, shared by its sub-spaces) or ``[h, J, K, s]`` (one a kv head and
sub-space); rows are ``[b, h, n, d]``, so a codebook's leading axis is the rows' head axis.

* :func:`assign` ``(sub [b, h, n, J, s], codebook, metric=None) -> uint32 [b, h, n, J]``: the
  nearest centroid, by ``||x - c||^2`` or, with a PSD ``metric`` ``M`` (``[s, s]``, or with
  the codebook's leading axes), ``(x - c)^T M (x - c)``; computed as ``c^T M c - 2 x^T M c``
  (the ``x^T M x`` term is the same for every centroid), ties to the lower index. Tokens go in
  blocks so that no more than :data:`BLOCK_ELEMENTS` distances are held at once.
* :func:`kmeans` ``(points [N, s], K, seed=...) -> [K, s]``: Lloyd's algorithm in MLX from
  ``K`` distinct points drawn by NumPy's ``default_rng(seed)`` (``init="sample"``) or by
  k-means++ (``init="kmeans++"``); an empty cluster takes the point farthest from its centroid
  (the farthest not yet taken, in order), so every centroid is some point's mean; deterministic
  per seed. :func:`kmeans_many` is the same algorithm for many point sets at once
  (``[G, N, s]``, one codebook a set), all in MLX (no value read back to the host, so it runs
  inside a compiled update), with weights that leave points out.
* :func:`pack` / :func:`unpack` ``(idx [..., J], bits)``: one little-endian bit stream a row
  into ``ceil(J * bits / 32)`` uint32 words at any width 1-24 (a 12-bit index takes 12 bits),
  the layout of :func:`velox.quant.pack` where that one packs.
* :func:`decode` ``(codebook, idx) -> [b, h, n, J * s]``: the centroids side by side.
* :func:`lookup_table` ``(q [b, h, m, d], codebook) -> [b, h, m, J, K]``: ``q_j . c_k`` for each
  query sub-vector and centroid; :func:`table_scores` ``(table, idx [b, h, n, J]) -> [b, h, m,
  n]``: ``sum_j table[j, idx_j]``, a gather-sum that reads indices only (the asymmetric
  distance of PQ): ``scores(q, idx) = q . decode(idx)`` up to float32 summation order.

Float32 throughout; the twins compute the same formulas (distances as a matrix product, so an
index can differ between MLX and NumPy only where two centroids are within float32 rounding of
equally near).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import mlx.core as mx
import numpy as np

from ..quant import _word_layout, pack_units

__all__ = ["BLOCK_ELEMENTS", "MAX_BITS", "split", "merge", "words", "assign", "assign_np",
           "kmeans", "kmeans_np_init", "kmeans_many", "sample_indices", "pack", "unpack", "pack_np", "unpack_np", "decode",
           "decode_np", "lookup_table", "lookup_table_np", "table_scores", "table_scores_np",
           "scores", "scores_np", "fold_batch", "unfold_batch"]

#: Distances held at once by :func:`assign` (float32: 32 MiB).
BLOCK_ELEMENTS = 1 << 20
#: Widest index :func:`pack` takes.
MAX_BITS = 24
#: A k-means seed: an int or a sequence of ints (NumPy's ``default_rng`` takes either).
Seed = Union[int, Sequence[int]]


def split(x, sub_dim: int):
    """Rows ``[..., d]`` as ``[..., d / sub_dim, sub_dim]`` (MLX or NumPy)."""
    d = x.shape[-1]
    if sub_dim < 1 or d % sub_dim:
        raise ValueError(f"sub_dim={sub_dim} must divide the row width {d}")
    return x.reshape(*x.shape[:-1], d // sub_dim, sub_dim)


def merge(y):
    """Sub-vectors ``[..., J, s]`` side by side: ``[..., J * s]``."""
    return y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])


def words(count: int, bits: int) -> int:
    """uint32 words of ``count`` indices of ``bits`` bits: ``ceil(count * bits / 32)``."""
    return -(-count * bits // 32)


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or int(bits) != bits or not 1 <= int(bits) <= MAX_BITS:
        raise ValueError(f"bits={bits!r} must be an integer in 1..{MAX_BITS}")
    return int(bits)


# --- codebook layouts -----------------------------------------------------------------------

def _canonical(cb, j: int):
    """A codebook as ``[Hc, Jc, K, s]`` (``Hc`` 1 or the heads, ``Jc`` 1 or ``j``)."""
    if cb.ndim == 2:
        return cb.reshape(1, 1, *cb.shape)
    if cb.ndim == 3:
        return cb.reshape(cb.shape[0], 1, *cb.shape[1:])
    if cb.ndim == 4:
        if cb.shape[1] not in (1, j):
            raise ValueError(f"a codebook of {cb.shape[1]} sub-spaces for rows of {j}")
        return cb
    raise ValueError(f"a codebook is [K, s], [h, K, s] or [h, J, K, s], got shape {cb.shape}")


def _canonical_metric(metric, cb4):
    """A metric as ``[Hc, Jc, s, s]`` matching the canonical codebook (broadcast)."""
    if metric.ndim == 2:
        return metric.reshape(1, 1, *metric.shape)
    if metric.ndim == 3:
        return metric.reshape(metric.shape[0], 1, *metric.shape[1:])
    return metric


# --- assignment -----------------------------------------------------------------------------

def _terms(cb4, metric4, xp):
    """``(A [Hc, Jc, s, K], c2 [Hc, Jc, 1, K])``: distance = ``c2 - 2 x @ A``."""
    if metric4 is None:
        mc = cb4
    else:
        mc = cb4 @ metric4  # rows c^T M (M symmetric)
    a = xp.swapaxes(mc, -1, -2)
    c2 = (mc * cb4).sum(axis=-1)[..., None, :]
    return a, c2


def _block(n: int, lead: int, k: int) -> int:
    return max(1, min(n, BLOCK_ELEMENTS // max(1, lead * k)))


def assign(sub: mx.array, codebook: mx.array, metric: mx.array | None = None) -> mx.array:
    """Nearest centroid of each sub-vector ``sub [b, h, n, J, s]``: ``uint32 [b, h, n, J]``."""
    b, h, n, j, s = sub.shape
    cb4 = _canonical(codebook.astype(mx.float32), j)
    m4 = None if metric is None else _canonical_metric(metric.astype(mx.float32), cb4)
    a, c2 = _terms(cb4, m4, mx)
    x = sub.astype(mx.float32).transpose(0, 1, 3, 2, 4)  # [b, h, J, n, s]
    if cb4.shape[1] == 1:  # one codebook for every sub-space: the sub-spaces as more rows
        x = x.reshape(b, h, 1, j * n, s)
    rows = x.shape[3]
    step = _block(rows, b * h * x.shape[2], cb4.shape[2])
    out = []
    for lo in range(0, rows, step):
        xb = x[:, :, :, lo:lo + step]
        if out:  # one block after another: the last block's distances are freed before these
            xb = mx.depends(xb, [out[-1]])
        dist = c2 - 2 * (xb @ a)  # [b, h, Jx, rows, K]
        out.append(mx.argmin(dist, axis=-1).astype(mx.uint32))
    idx = out[0] if len(out) == 1 else mx.concatenate(out, axis=3)
    return idx.reshape(b, h, j, n).transpose(0, 1, 3, 2)


def assign_np(sub: np.ndarray, codebook: np.ndarray, metric: np.ndarray | None = None) -> np.ndarray:
    """NumPy twin of :func:`assign`."""
    sub = np.asarray(sub, np.float32)
    b, h, n, j, s = sub.shape
    cb4 = _canonical(np.asarray(codebook, np.float32), j)
    m4 = None if metric is None else _canonical_metric(np.asarray(metric, np.float32), cb4)
    a, c2 = _terms(cb4, m4, np)
    x = sub.transpose(0, 1, 3, 2, 4)
    if cb4.shape[1] == 1:
        x = x.reshape(b, h, 1, j * n, s)
    rows = x.shape[3]
    step = _block(rows, b * h * x.shape[2], cb4.shape[2])
    out = []
    for lo in range(0, rows, step):
        dist = c2 - np.float32(2) * (x[:, :, :, lo:lo + step] @ a)
        out.append(np.argmin(dist, axis=-1).astype(np.uint32))
    idx = np.concatenate(out, axis=3) if out else np.zeros((b, h, x.shape[2], 0), np.uint32)
    return idx.reshape(b, h, j, n).transpose(0, 1, 3, 2)


# --- k-means --------------------------------------------------------------------------------

def kmeans_np_init(points: np.ndarray, k: int, seed: Seed, init: str = "sample") -> np.ndarray:
    """``k`` initial centroids (rows of ``points``), deterministic in ``seed`` (an int or a
    sequence of ints, as NumPy's ``default_rng`` takes it): ``"sample"``
    draws ``k`` distinct rows; ``"kmeans++"`` draws each next row with probability
    proportional to its squared distance to the nearest centroid drawn so far."""
    x = np.asarray(points, np.float64)
    rng = np.random.default_rng(seed)
    if init == "sample":
        return x[np.sort(rng.choice(len(x), size=k, replace=False))].astype(np.float32)
    if init != "kmeans++":
        raise ValueError(f"init={init!r} is 'sample' or 'kmeans++'")
    chosen = [int(rng.integers(len(x)))]
    d2 = ((x - x[chosen[0]]) ** 2).sum(axis=1)
    for _ in range(1, k):
        total = d2.sum()
        nxt = int(rng.choice(len(x), p=d2 / total)) if total > 0 else int(rng.integers(len(x)))
        chosen.append(nxt)
        d2 = np.minimum(d2, ((x - x[nxt]) ** 2).sum(axis=1))
    return x[chosen].astype(np.float32)


def kmeans(points, k: int, *, iters: int = 20, seed: Seed = 0, init: str = "sample",
           metric=None, spherical: bool = False) -> mx.array:
    """Lloyd's algorithm in MLX: ``k`` centroids ``[k, s]`` (float32) of ``points [N, s]``
    (``N >= k``), from :func:`kmeans_np_init`'s draw, ``iters`` rounds of assignment
    (:func:`assign`, under ``metric`` if given) and means; an empty cluster takes the point
    farthest from its centroid, each such point used once (deterministic). ``spherical``:
    each round's centroids are scaled to unit norm (spherical k-means: for unit-norm points
    and centroids the nearest centroid is the one of largest cosine)."""
    x = mx.array(np.asarray(points, np.float32))
    n, s = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k={k} centroids need 1 to {n} points")
    cb = mx.array(kmeans_np_init(np.array(x), k, seed, init))
    sub = x.reshape(1, 1, n, 1, s)
    for _ in range(iters):
        idx = assign(sub, cb, metric).reshape(n)
        sums = mx.zeros((k, s), mx.float32).at[idx].add(x)
        counts = mx.zeros((k,), mx.float32).at[idx].add(mx.ones((n,), mx.float32))
        new = sums / mx.maximum(counts, 1.0)[:, None]
        cnt = np.array(counts)
        if (cnt == 0).any():  # empty clusters: the points farthest from their centroids
            dist = np.array(((x - cb[idx]) ** 2).sum(axis=-1))
            far = np.argsort(-dist, kind="stable")[: int((cnt == 0).sum())]
            fill = np.array(new)
            fill[np.flatnonzero(cnt == 0)] = np.array(x)[far]
            new = mx.array(fill)
        if spherical:
            new = new / mx.maximum(mx.sqrt((new * new).sum(axis=-1, keepdims=True)), 1e-30)
        cb = new
    mx.eval(cb)
    return cb


def sample_indices(n: int, k: int, seed: Seed) -> np.ndarray:
    """The initial centroids' point indices of :func:`kmeans_many` (int32 ``[k]``): the ``k``
    distinct points :func:`kmeans_np_init` draws (``"sample"``, ascending) when ``n >= k``;
    otherwise every point, repeated in order (``i mod n``) up to ``k``."""
    if n < 1 or k < 1:
        raise ValueError(f"k={k} centroids of n={n} points: both must be positive")
    if n >= k:
        rng = np.random.default_rng(seed)
        return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32)
    return (np.arange(k) % n).astype(np.int32)


def kmeans_many(points: mx.array, k: int, *, iters: int, seed: Seed,
                weights: mx.array | None = None) -> mx.array:
    """Lloyd's algorithm on ``G`` point sets at once: ``[G, k, s]`` float32 centroids of
    ``points [G, N, s]``, each set's its own (:func:`kmeans` on each set: the same draw,
    :func:`sample_indices`, the same assignment, means and empty-cluster rule: an empty
    cluster takes the point farthest from its centroid, the farthest first, each point once).
    ``weights [G, N]`` (0 or 1) leaves the points of weight 0 out of the means and of the
    empty-cluster rule (their coordinates are taken as 0). With fewer points than ``k`` every
    point is a centroid (a set of distinct points is held exactly). Everything runs in MLX,
    nothing read back to the host (the draw depends on the shapes and ``seed`` only): the fit
    can run inside ``mx.compile``."""
    g, n, s = points.shape
    x = points.astype(mx.float32)
    w = mx.ones((g, n), mx.float32) if weights is None else weights.astype(mx.float32)
    x = mx.where(w[..., None] > 0, x, mx.zeros_like(x))
    cb = mx.take(x, mx.array(sample_indices(n, k, seed)), axis=1)  # [G, k, s]
    sub = x.reshape(1, g, n, 1, s)
    base = (mx.arange(g, dtype=mx.uint32) * k)[:, None]
    flat_x = x.reshape(g * n, s)
    for _ in range(iters):
        idx = assign(sub, cb).reshape(g, n)
        flat = (idx + base).reshape(g * n)
        sums = mx.zeros((g * k, s), mx.float32).at[flat].add(flat_x * w.reshape(g * n, 1))
        counts = mx.zeros((g * k,), mx.float32).at[flat].add(w.reshape(g * n)).reshape(g, k)
        new = sums.reshape(g, k, s) / mx.maximum(counts, 1.0)[..., None]
        # empty clusters, in order, take the points farthest from their (old) centroids
        dist = ((x - mx.take_along_axis(cb, idx.astype(mx.int32)[..., None], axis=1)) ** 2).sum(axis=-1)
        dist = mx.where(w > 0, dist, mx.array(-mx.inf, mx.float32))
        far = mx.argsort(-dist, axis=-1)                                     # [G, N]
        empty = counts == 0
        rank = mx.minimum(mx.maximum(mx.cumsum(empty.astype(mx.int32), axis=-1) - 1, 0), n - 1)
        pick = mx.take_along_axis(far, rank, axis=-1)                        # [G, k]
        fill = mx.take_along_axis(x, pick[..., None], axis=1)                # [G, k, s]
        cb = mx.where(empty[..., None], fill, new)
    return cb


# --- packing --------------------------------------------------------------------------------

def pack(idx: mx.array, bits: int) -> mx.array:
    """Indices ``[..., J]`` (< 2^bits) as ``uint32 [..., ceil(J * bits / 32)]``: one
    little-endian bit stream a row (index ``i`` in bits ``[i*bits, (i+1)*bits)``)."""
    bits = _check_bits(bits)
    lead, j = idx.shape[:-1], idx.shape[-1]
    pad = -j % 32
    c = idx.astype(mx.uint32)
    if pad:
        c = mx.concatenate([c, mx.zeros((*lead, pad), mx.uint32)], axis=-1)
    out = pack_units(c.reshape(*lead, (j + pad) // 32, 32), bits).reshape(*lead, (j + pad) // 32 * bits)
    return out[..., :words(j, bits)]


def unpack(packed: mx.array, bits: int, count: int) -> mx.array:
    """Inverse of :func:`pack`: ``uint32 [..., count]``."""
    bits = _check_bits(bits)
    lead = packed.shape[:-1]
    units = -(-count // 32)
    full = units * bits
    w = packed.astype(mx.uint32)
    if full > w.shape[-1]:
        w = mx.concatenate([w, mx.zeros((*lead, full - w.shape[-1]), mx.uint32)], axis=-1)
    w = w.reshape(*lead, units, bits)
    mask = mx.array((1 << bits) - 1, mx.uint32)
    codes = []
    for word, shift, spill in _word_layout(bits):
        c = w[..., word] >> shift
        if spill:
            c = c | (w[..., word + 1] << (32 - shift))
        codes.append(c & mask)
    return mx.stack(codes, axis=-1).reshape(*lead, units * 32)[..., :count]


def pack_np(idx: np.ndarray, bits: int) -> np.ndarray:
    """NumPy twin of :func:`pack`."""
    bits = _check_bits(bits)
    idx = np.asarray(idx, np.uint32)
    lead, j = idx.shape[:-1], idx.shape[-1]
    planes = (idx[..., None] >> np.arange(bits, dtype=np.uint32)) & 1
    stream = planes.reshape(*lead, j * bits)
    pad = -stream.shape[-1] % 32
    stream = np.concatenate([stream, np.zeros((*lead, pad), np.uint32)], axis=-1)
    stream = stream.reshape(*lead, -1, 32)
    return (stream << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint64).astype(np.uint32)


def unpack_np(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """NumPy twin of :func:`unpack`."""
    bits = _check_bits(bits)
    w = np.asarray(packed, np.uint32)
    lead = w.shape[:-1]
    stream = (w[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    stream = stream.reshape(*lead, -1)[..., :count * bits].reshape(*lead, count, bits)
    return (stream << np.arange(bits, dtype=np.uint32)).sum(axis=-1, dtype=np.uint64).astype(np.uint32)


# --- decoding and scores --------------------------------------------------------------------

def decode(codebook: mx.array, idx: mx.array) -> mx.array:
    """Centroids of ``idx [b, h, n, J]`` side by side: ``[b, h, n, J * s]`` float32."""
    b, h, n, j = idx.shape
    cb4 = _canonical(codebook.astype(mx.float32), j)
    hc, jc, k, s = cb4.shape
    # flat index into [Hc * Jc * K] entries: head, sub-space, centroid
    hoff = (mx.arange(h, dtype=mx.uint32) * (jc * k))[:, None, None] if hc > 1 else mx.array(0, mx.uint32)
    joff = (mx.arange(j, dtype=mx.uint32) * k) if jc > 1 else mx.array(0, mx.uint32)
    flat = idx.astype(mx.uint32) + joff + hoff
    return mx.take(cb4.reshape(hc * jc * k, s), flat, axis=0).reshape(b, h, n, j * s)


def decode_np(codebook: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`decode`."""
    idx = np.asarray(idx, np.int64)
    b, h, n, j = idx.shape
    cb4 = _canonical(np.asarray(codebook, np.float32), j)
    hc, jc, k, s = cb4.shape
    hsel = np.arange(h)[:, None, None] if hc > 1 else 0
    jsel = np.arange(j) if jc > 1 else 0
    return cb4[hsel, jsel, idx].reshape(b, h, n, j * s)


def lookup_table(q: mx.array, codebook: mx.array) -> mx.array:
    """``q_j . c`` for every query sub-vector and centroid: ``[b, h, m, J, K]`` float32 from
    queries ``[b, h, m, d]`` (``d = J * s``)."""
    b, h, m, d = q.shape
    s = codebook.shape[-1]
    cb4 = _canonical(codebook.astype(mx.float32), d // s)  # [Hc, Jc, K, s]
    qs = split(q.astype(mx.float32), s).transpose(0, 1, 3, 2, 4)  # [b, h, J, m, s]
    t = qs @ cb4.swapaxes(-1, -2)  # [b, h, J, m, K]
    return t.transpose(0, 1, 3, 2, 4)


def lookup_table_np(q: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`lookup_table`."""
    q = np.asarray(q, np.float32)
    b, h, m, d = q.shape
    s = codebook.shape[-1]
    cb4 = _canonical(np.asarray(codebook, np.float32), d // s)
    qs = split(q, s).transpose(0, 1, 3, 2, 4)
    return (qs @ np.swapaxes(cb4, -1, -2)).transpose(0, 1, 3, 2, 4)


def table_scores(table: mx.array, idx: mx.array) -> mx.array:
    """``sum_j table[b, h, m, j, idx[b, h, n, j]]``: ``[b, h, m, n]``, gathered in blocks of
    tokens so that no more than :data:`BLOCK_ELEMENTS` entries are held at once."""
    b, h, m, j, k = table.shape
    n = idx.shape[2]
    flat_t = table.reshape(b, h, m, j * k)
    flat_i = idx.astype(mx.uint32) + mx.arange(j, dtype=mx.uint32) * k  # [b, h, n, J]
    step = _block(n, b * h * m * j, 1)
    out = []
    for lo in range(0, max(n, 1), step):
        fi = flat_i[:, :, lo:lo + step].reshape(b, h, 1, -1)
        g = mx.take_along_axis(flat_t, mx.broadcast_to(fi, (b, h, m, fi.shape[-1])), axis=-1)
        out.append(g.reshape(b, h, m, -1, j).sum(axis=-1))
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)


def table_scores_np(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`table_scores`."""
    table = np.asarray(table, np.float32)
    b, h, m, j, k = table.shape
    idx = np.asarray(idx, np.int64)
    g = np.take_along_axis(table[:, :, :, None], idx[:, :, None, :, :, None], axis=-1)[..., 0]
    return g.sum(axis=-1, dtype=np.float32)


def scores(q: mx.array, codebook: mx.array, idx: mx.array) -> mx.array:
    """``q . decode(codebook, idx)`` read through the lookup table: ``[b, h, m, n]``."""
    return table_scores(lookup_table(q, codebook), idx)


def scores_np(q: np.ndarray, codebook: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`scores`."""
    return table_scores_np(lookup_table_np(q, codebook), idx)


# --- codebooks fitted a batch row and kv head -----------------------------------------------

def fold_batch(cb, x, ndim: int):
    """``(codebook, x)`` for this module's functions, whose codebook's leading axis is the
    rows' head axis: a codebook with a batch axis (``ndim`` axes, ``[b, h, ...]``, fitted a
    batch row and kv head at the prefill) folds the batch rows into the heads (``[b h, ...]``,
    ``x [1, b h, ...]``); any other as it is. MLX or NumPy."""
    if cb.ndim != ndim:
        return cb, x
    b, h = cb.shape[:2]
    return cb.reshape(b * h, *cb.shape[2:]), x.reshape(1, b * h, *x.shape[2:])


def unfold_batch(cb, y, shape, ndim: int):
    """Undo :func:`fold_batch` on a result ``y [1, b h, ...]``: ``[b, h, ...]`` (``shape``
    the rows' shape)."""
    return y if cb.ndim != ndim else y.reshape(*shape[:2], *y.shape[2:])
