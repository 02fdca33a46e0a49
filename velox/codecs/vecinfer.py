"""VecInfer's codecs: smoothed, Hadamard-rotated keys and plain values held as product-quantized
indices (Yao et al., "VecInfer: Efficient LLM Inference with Low-Bit KV Cache via
Outlier-Suppressed Vector Quantization", arXiv 2510.06175).

``"vecinfer_keys"`` (params ``sub_dim``, ``bits``, ``codebook``, ``seed``, ``kv_heads``,
``layer``):

* encode: each channel divided by its smoothing factor ``lambda`` (``[h, d]``, calibrated:
  ``lambda_i = sqrt(max |K_i|)`` over calibration keys; ones for a random codebook), rotated by
  the normalized Sylvester Hadamard matrix ``H / sqrt(d)`` (orthogonal and symmetric; a fixed
  Haar rotation where ``d`` is not a power of two: :func:`rotation`), cut into
  ``d / sub_dim`` sub-vectors, each held as the index of its nearest centroid
  (:func:`velox.codecs.pq.assign`) of a ``2^bits``-entry codebook (``[h, K, sub_dim]``, one a
  kv head, shared by its sub-spaces), packed ``bits`` a sub-vector (:func:`velox.codecs.pq.pack`).
* decode: ``lambda * (H^T / sqrt(d)) c[idx]``.
* scores: the query is multiplied by ``lambda`` and rotated once (``(lambda q) . (k / lambda) =
  q . k``), then read through the lookup table of its sub-vectors against the codebook, one
  gather-sum over the indices (:func:`velox.codecs.pq.scores`): no key is rebuilt.

``"vecinfer_values"`` (params ``sub_dim``, ``bits``, ``codebook``, ``seed``, ``kv_heads``,
``layer``): the same product quantization of the raw values (no smoothing, no rotation: the
paper's transforms suppress the keys' outliers).

The codebook comes from calibration: ``codebook="smollm2-135m-instruct"`` reads layer
``layer`` of the artifact shipped in ``velox.adapters/data`` (:data:`SHIPPED`), which fits only
that model's kv heads and head_dim (the tables say ``calibrated = False`` otherwise, and the
method refuses to encode); :func:`tables_from_arrays` builds tables from any fit
(``velox calibrate --method vecinfer``); ``codebook="prefill"`` (data-free) fits them to the
rows of the first update that holds tokens, one fit a batch row and kv head
(:func:`prefill_tables`: the calibration's rule run on the prompt itself, smoothing factors
included, Lloyd's k-means in MLX from ``seed``, :data:`PREFILL_ITERS` rounds); the tables then
have a batch axis (``smooth [b, h, d]``, ``codebook [b, h, K, s]``; :func:`prefill_placeholder`
before the fit). ``codebook="random"`` draws ``K`` standard normal centroids from ``seed``
(tests only). Codebooks are held in float16 (their bytes count where a state holds them),
smoothing factors in float32.

Bits per element: ``bits / sub_dim`` exactly (12 / 4 = 3 for keys, 8 / 8 = 1 for values at the
defaults), no side data a token.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .._typing import Array, Float, UInt
from . import Codec, register_codec, shipped_calibration
from . import pq
from .rotation import hadamard, is_power_of_two, matmul_per_slice, random_rotation

__all__ = ["VecInferTables", "VQCodes", "SHIPPED", "PREFILL_ITERS", "rotation", "shipped_arrays",
           "smoothing", "tables_from_arrays", "prefill_placeholder", "prefill_tables",
           "key_tables", "value_tables", "KEYS", "VALUES"]

#: Calibrations shipped in ``velox.adapters/data``: name -> file.
SHIPPED = {"smollm2-135m-instruct": "vecinfer_smollm2.npz"}
#: Lloyd rounds of a codebook fitted at the prefill (``codebook="prefill"``), as many as the
#: shipped SmolLM2 fit took.
PREFILL_ITERS = 6


class VecInferTables(NamedTuple):
    # a batch axis only where fitted at the prefill, one fit a batch row and kv head ("*bh":
    # velox.ragged cuts such an array by row; the others are shared by the rows)
    smooth: Float[Array, "*bh d"]      # [h, d] or [b, h, d] float32 (keys; divided by it), [0] (values)
    rotation: Float[Array, "r r"]      # [d, d] float32 normalized Hadamard (keys) or [0, 0] (values)
    codebook: Float[Array, "*bh k s"]  # [K, s], [h, K, s] or [b, h, K, s] float16
    head_dim: int
    sub_dim: int
    bits: int
    calibrated: bool     # False: the shipped calibration does not fit (the method refuses)


class VQCodes(NamedTuple):
    idx: UInt[Array, "b h n w"]  # w = ceil(d / sub_dim * bits / 32) uint32 words


def smoothing(keys: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """VecInfer's smoothing factors of calibration keys ``[t, h, d]``: ``sqrt(max_t |K|)`` per
    kv head and channel, ``[h, d]`` float32 (floored so no channel divides by 0)."""
    k = np.abs(np.asarray(keys, np.float64)).max(axis=0)
    return np.sqrt(np.maximum(k, floor)).astype(np.float32)


@lru_cache(maxsize=4)
def shipped_arrays(name: str) -> tuple[dict, dict]:
    """``(arrays, info)`` of the shipped calibration ``name`` (:data:`SHIPPED`): ``smooth
    [layers, h, d]``, ``key_codebook [layers, h, K, s]``, ``value_codebook [layers, h, K, s]``."""
    return shipped_calibration("VecInfer", SHIPPED, name)


def rotation(d: int) -> np.ndarray:
    """The keys' rotation ``[d, d]`` float32: the normalized Sylvester Hadamard matrix for a
    power-of-two ``d``, else the Haar rotation of ``velox.codecs.rotation.random_rotation(d,
    0)`` (the same for every model and seed)."""
    if is_power_of_two(d):
        return (hadamard(d) / math.sqrt(d)).astype(np.float32)
    return random_rotation(d, 0)


def _head_dim(head_dim: int, sub_dim: int) -> int:
    d = int(head_dim)
    if sub_dim < 1 or d % sub_dim:
        raise ValueError(f"sub_dim={sub_dim} must divide head_dim={d}")
    return d


def tables_from_arrays(head_dim: int, sub_dim: int, bits: int, codebook, smooth=None, *,
                       rotate: bool, calibrated: bool = True) -> VecInferTables:
    """Tables from a codebook ``[K, s]`` or ``[h, K, s]`` (``K = 2^bits``, ``s = sub_dim``)
    and, for keys (``rotate``), smoothing factors ``[h, d]`` or ``[d]`` (``None``: ones)."""
    d = _head_dim(head_dim, sub_dim)
    cb = np.asarray(codebook, np.float32)
    if cb.ndim not in (2, 3) or cb.shape[-2:] != (1 << bits, sub_dim):
        raise ValueError(f"codebook of shape {cb.shape} is not [{1 << bits}, {sub_dim}] nor "
                         f"[kv_heads, {1 << bits}, {sub_dim}] (bits={bits}, sub_dim={sub_dim})")
    if rotate:
        sm = np.ones(d, np.float32) if smooth is None else np.asarray(smooth, np.float32)
        if sm.shape[-1] != d or sm.ndim not in (1, 2) or not np.all(sm > 0):
            raise ValueError(f"smoothing factors of shape {sm.shape} must be {d} positive "
                             "numbers (a kv head)")
        rot = rotation(d)
    else:
        sm, rot = np.zeros(0, np.float32), np.zeros((0, 0), np.float32)
    return VecInferTables(mx.array(sm), mx.array(rot), mx.array(cb.astype(np.float16)), d,
                          sub_dim, bits, calibrated)


def _tables(head_dim: int, params: dict, side: str) -> VecInferTables:
    sub_dim, bits = int(params.get("sub_dim", 4)), int(params.get("bits", 12))
    which = params.get("codebook", "random")
    rotate = side == "key"
    if which == "prefill":  # shared zeros until the method fits them (prefill_placeholder)
        return tables_from_arrays(head_dim, sub_dim, bits, np.zeros((1 << bits, sub_dim)),
                                  rotate=rotate)
    if which == "random":
        rng = np.random.default_rng([int(params.get("seed", 0)), 0 if rotate else 1])
        cb = rng.standard_normal((1 << bits, sub_dim)).astype(np.float32)
        return tables_from_arrays(head_dim, sub_dim, bits, cb, rotate=rotate)
    arrays, info = shipped_arrays(which)
    layer, h = int(params.get("layer", -1)), int(params.get("kv_heads", -1))
    cb = arrays[f"{side}_codebook"]
    fits = (0 <= layer < cb.shape[0] and h == cb.shape[1] and int(head_dim) == info["head_dim"]
            and cb.shape[-2:] == (1 << bits, sub_dim))
    if not fits:  # a placeholder the method refuses to encode with (check_calibrated)
        return tables_from_arrays(head_dim, sub_dim, bits, np.zeros((1 << bits, sub_dim)),
                                  rotate=rotate, calibrated=False)
    return tables_from_arrays(head_dim, sub_dim, bits, cb[layer],
                              arrays["smooth"][layer] if rotate else None, rotate=rotate)


def prefill_placeholder(t: VecInferTables, batch: int, kv_heads: int) -> VecInferTables:
    """The tables of a ``codebook="prefill"`` state before its fit: ``t``'s arrays in the
    fitted shapes (``smooth [b, h, d]`` ones for keys, ``codebook [b, h, K, s]`` zeros), so
    that a state's arrays keep their shapes when :func:`prefill_tables` replaces them."""
    lead = (batch, kv_heads)
    sm = t.smooth if not t.smooth.size else mx.ones((*lead, t.head_dim), mx.float32)
    cb = mx.zeros((*lead, 1 << t.bits, t.sub_dim), mx.float16)
    return t._replace(smooth=sm, codebook=cb)


def prefill_tables(t: VecInferTables, rows: mx.array, seed) -> VecInferTables:
    """``t`` fitted to ``rows [b, h, n, d]`` (``n > 0``), one fit a batch row and kv head, by
    the calibration's rule (``velox.adapters.artifacts.fit_vecinfer``) on these rows alone:
    key tables (``t`` has a rotation) take the smoothing factors ``sqrt(max_n |k|)`` per
    channel (:func:`smoothing`) and fit the smoothed, rotated sub-vectors; value tables fit the
    raw ones. The codebook is Lloyd's k-means of the row's sub-vectors
    (:func:`velox.codecs.pq.kmeans_many`, :data:`PREFILL_ITERS` rounds, the initial centroids
    drawn from ``seed``), clipped to float16's range; a token with a non-finite element takes
    no part (nor in the smoothing factors). One MLX function for both backends, nothing read
    back to the host."""
    b, h, n, d = rows.shape
    x = rows.astype(mx.float32)
    finite = mx.all(mx.isfinite(x), axis=-1)                                    # [b, h, n]
    x = mx.where(finite[..., None], x, mx.zeros_like(x))
    sm = t.smooth
    if t.rotation.size:
        peak = mx.max(mx.abs(x), axis=2)                                         # [b, h, d]
        sm = mx.sqrt(mx.maximum(peak, 1e-6))
        x = matmul_per_slice(x / sm[:, :, None, :], t.rotation.T)
    j = d // t.sub_dim
    pts = x.reshape(b * h, n * j, t.sub_dim)
    w = mx.broadcast_to(finite[..., None], (b, h, n, j)).reshape(b * h, n * j)
    cb = pq.kmeans_many(pts, 1 << t.bits, iters=PREFILL_ITERS, seed=seed, weights=w)
    f16 = float(np.finfo(np.float16).max)
    cb = mx.clip(cb, -f16, f16).astype(mx.float16).reshape(b, h, 1 << t.bits, t.sub_dim)
    return t._replace(smooth=sm, codebook=cb, calibrated=True)


def key_tables(head_dim: int, params: dict) -> VecInferTables:
    return _tables(head_dim, params, "key")


def value_tables(head_dim: int, params: dict) -> VecInferTables:
    return _tables(head_dim, params, "value")


def _per_head(v):
    """Smoothing factors ``[d]``, ``[h, d]`` or ``[b, h, d]`` against rows ``[b, h, n, d]``."""
    return v if v.ndim == 1 else v[..., None, :]


def _check(t: VecInferTables, shape) -> None:
    if len(shape) != 4 or shape[-1] != t.head_dim:
        raise ValueError(f"rows must be [b, h, n, {t.head_dim}], got {tuple(shape)}")
    for a, lead in ((t.smooth, t.smooth.ndim - 1), (t.codebook, t.codebook.ndim - 2)):
        if a.size and lead and tuple(a.shape[:lead]) != tuple(shape[2 - lead:2]):
            what = "kv heads" if lead == 1 else "batch rows and kv heads"
            raise ValueError(f"the tables hold {tuple(a.shape[:lead])} {what}; rows of shape "
                             f"{tuple(shape)} do not")


def _rows_of(cb, x):
    """``pq.fold_batch`` for this codec's codebooks (fitted a batch row and kv head:
    ``[b, h, K, s]``)."""
    return pq.fold_batch(cb, x, 4)


def _unfold(cb, y, shape):
    return pq.unfold_batch(cb, y, shape, 4)


# --- MLX ------------------------------------------------------------------------------------

def _transformed(t: VecInferTables, x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    if t.smooth.size:
        x = x / _per_head(t.smooth)
    if t.rotation.size:
        x = matmul_per_slice(x, t.rotation.T)
    return x


def encode(t: VecInferTables, rows: mx.array) -> VQCodes:
    _check(t, rows.shape)
    cb, sub = _rows_of(t.codebook, pq.split(_transformed(t, rows), t.sub_dim))
    idx = _unfold(t.codebook, pq.assign(sub, cb), rows.shape)
    return VQCodes(pq.pack(idx, t.bits))


def _indices(t: VecInferTables, codes: VQCodes) -> mx.array:
    return pq.unpack(codes.idx, t.bits, t.head_dim // t.sub_dim)


def decode(t: VecInferTables, codes: VQCodes) -> mx.array:
    idx = _indices(t, codes)
    cb, fi = _rows_of(t.codebook, idx)
    y = _unfold(t.codebook, pq.decode(cb, fi), idx.shape)
    if t.rotation.size:
        y = y @ t.rotation
    if t.smooth.size:
        y = y * _per_head(t.smooth)
    return y


def scores(t: VecInferTables, queries: mx.array, codes: VQCodes) -> mx.array:
    q = queries.astype(mx.float32)
    if t.smooth.size:
        q = q * _per_head(t.smooth)
    if t.rotation.size:
        q = q @ t.rotation.T
    cb, fq = _rows_of(t.codebook, q)
    _, fi = _rows_of(t.codebook, _indices(t, codes))
    return _unfold(t.codebook, pq.scores(fq, cb, fi), q.shape)


# --- NumPy twins ----------------------------------------------------------------------------

def _np(t: VecInferTables):
    return (np.asarray(t.smooth, np.float32), np.asarray(t.rotation, np.float32),
            np.asarray(t.codebook).astype(np.float32))


def encode_np(t: VecInferTables, rows: np.ndarray) -> VQCodes:
    x = np.asarray(rows, np.float32)
    _check(t, x.shape)
    sm, rot, cb = _np(t)
    if sm.size:
        x = x / _per_head(sm)
    if rot.size:
        x = x @ rot.T
    fcb, sub = _rows_of(cb, pq.split(x, t.sub_dim))
    idx = _unfold(cb, pq.assign_np(sub, fcb), x.shape)
    return VQCodes(pq.pack_np(idx, t.bits))


def decode_np(t: VecInferTables, codes: VQCodes) -> np.ndarray:
    sm, rot, cb = _np(t)
    idx = pq.unpack_np(np.asarray(codes.idx), t.bits, t.head_dim // t.sub_dim)
    fcb, fi = _rows_of(cb, idx)
    y = _unfold(cb, pq.decode_np(fcb, fi), idx.shape)
    if rot.size:
        y = y @ rot
    if sm.size:
        y = y * _per_head(sm)
    return y


def scores_np(t: VecInferTables, queries: np.ndarray, codes: VQCodes) -> np.ndarray:
    sm, rot, cb = _np(t)
    q = np.asarray(queries, np.float32)
    if sm.size:
        q = q * _per_head(sm)
    if rot.size:
        q = q @ rot.T
    idx = pq.unpack_np(np.asarray(codes.idx), t.bits, t.head_dim // t.sub_dim)
    fcb, fq = _rows_of(cb, q)
    _, fi = _rows_of(cb, idx)
    return _unfold(cb, pq.scores_np(fq, fcb, fi), q.shape)


def head_tables(t: VecInferTables, i: int, j: int) -> VecInferTables:
    """Batch row ``i``, kv head ``j``'s tables: of tables fitted a row and head at the prefill
    (``[b, h, ...]``) those of ``[i, j]`` (leading ``[1, 1]``), of tables holding one a kv head
    kv head ``j``'s (its smoothing factors ``[1, d]`` and codebook ``[1, K, s]``); shared
    ones as they are."""
    def one(x, base):  # base: the array's own axes
        x = np.asarray(x)
        lead = x.ndim - base
        return x[i:i + 1, j:j + 1] if lead == 2 else x[j:j + 1] if lead == 1 else x
    return t._replace(smooth=one(t.smooth, 1), codebook=one(t.codebook, 2))


_ERROR = ("no bound: each sub-vector is replaced by its nearest centroid (exact when the codebook "
          "holds it); scores are q . decode(k) read from the lookup table")
_PARAMS = ("sub_dim", "bits", "codebook", "seed", "kv_heads", "layer")

KEYS = register_codec(Codec(
    name="vecinfer_keys", tables=key_tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np, params=_PARAMS, error=_ERROR,
    head=head_tables))

VALUES = register_codec(Codec(
    name="vecinfer_values", tables=value_tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np, params=_PARAMS, error=_ERROR,
    head=head_tables))
