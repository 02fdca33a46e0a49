"""TurboQuant's rotated Lloyd-Max codecs: ``"turboquant_mse"`` and ``"turboquant_rvq"``.

TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874) rotates each row by a random
orthogonal matrix ``R`` (:mod:`velox.codecs.rotation`): the coordinates of ``R x / ||x||`` are
then nearly independent, each ~ N(0, 1/d). Scaled to unit variance they are quantized one by
one with the Lloyd-Max codebook of the standard Gaussian law (:mod:`velox.codecs.lloyd`).

``turboquant_mse`` (params ``bits`` 1-8, default 2; ``seed``, default 42):

* encode: ``r = ||x||`` (float32, stored float16), ``y = (R x) * sqrt(d) / r`` (unit-variance
  coordinates; ``y = 0`` for a zero row), ``idx_j`` = the Lloyd-Max cell of ``y_j``
  (:func:`velox.codecs.lloyd.cell`), packed ``bits`` per coordinate with
  :func:`velox.quant.pack`. ``pack`` needs a multiple of ``32 / bits`` values (``bits`` in
  1, 2, 4, 8) or of 32 (other bits): each row's ``d`` indices are padded with zero indices up
  to ``padded = ceil(d / unit) * unit`` (``unit = 32 // bits`` if ``bits`` divides 32, else
  32); the padding is dropped on unpacking. Bytes per row: ``padded * bits / 8 + 2``
  (``d * bits / 8 + 2`` for ``d`` a multiple of 32).
* decode: ``R^T c[idx] * r / sqrt(d)`` (``c`` the centroids); a zero row decodes to 0.
* scores: the query is rotated once, ``q_rot = q @ R.T``, and
  ``score = sum_j q_rot_j * c[idx_j] * r / sqrt(d)``: centroid lookups in the rotated domain,
  no inverse rotation of the keys.

``turboquant_rvq`` (same params) adds a second stage in the rotated, unit-variance domain: the
stage-1 residual ``e = y - c1[idx1]`` is normalised by its own per-row RMS, ``z = e / rms(e)``,
and quantized with the Laplacian Lloyd-Max codebook (unit variance) at ``bits``: ``idx2``. The
stored scale is not the RMS but the least-squares gain of the chosen centroids,
``g = <e, c2[idx2]> / ||c2[idx2]||^2`` (float16). Why per row and this gain: the residual's
size varies from row to row (a fixed scale would mis-scale the Laplacian codebook), and with
the least-squares gain ``||e - g c2||^2 = ||e||^2 - <e, c2>^2 / ||c2||^2 <= ||e||^2`` for every
row, so stage 2 never increases a row's error (``g >= 0`` since the codebook is symmetric with a
boundary at 0, and any stored ``g' in [0, 2 g]`` keeps the bound: float16 rounding does).
Decode: ``R^T (c1[idx1] + g c2[idx2]) * r / sqrt(d)``. Bytes per row:
``2 * padded * bits / 8 + 2 + 2`` (two packed index streams, the float16 norm and gain).

Helpers for codecs built on the MSE stage (e.g. TurboQuant_prod, MSE at ``b - 1`` bits plus a
QJL sketch of the residual); each has a NumPy twin with the suffix ``_np``:

* :func:`mse_tables` ``(head_dim, bits, seed) -> TurboQuantTables``;
* :func:`mse_encode` ``(tables, rows [b, h, n, d]) -> MseCodes(idx, norm)``;
* :func:`mse_decode` ``(tables, codes) -> [b, h, n, d]`` (original domain);
* :func:`mse_rotated` ``(tables, codes) -> [b, h, n, d]``: the decoded rows in the rotated
  domain, ``c[idx] * r / sqrt(d)`` (``mse_decode = unrotate(mse_rotated)``);
* :func:`mse_scores` ``(tables, q, codes) -> [b, h, m, n]`` and :func:`mse_scores_rotated`
  ``(tables, q_rot, codes)`` for a query already rotated (``q_rot = rotate(q, tables.rotation)``);
* :func:`mse_weighted` ``(tables, w, codes) -> [b, h, m, d]``: ``w @ mse_decode(tables, codes)``
  for weights ``w [b, h, m, n]`` (attention over rows held by this codec, e.g. values), summed
  in the rotated domain, ``sum_j w_j * r_j / sqrt(d) * c[idx_j]``, and rotated back once: one
  ``[m, d] x [d, d]`` product instead of the ``[n, d] x [d, d]`` of decoding every row.

Float32 arithmetic, in the same order in both twins; codes can differ between MLX and NumPy only
where the matmul and sum orders round differently: a coordinate within float32 rounding of a cell
boundary (stage 2 of rvq divides the small residual by its RMS, so there "within rounding" is
~1e-4 of a unit), or a norm or gain on a float16 rounding tie (one float16 step).
Norms are float16 (relative rounding 2^-11, far below the 8-bit distortion); rows of norm above
65504 overflow it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from ..reference import pack_codes, unpack_codes
from . import Codec, register_codec
from .lloyd import cell, codebook
from .rotation import matmul_per_slice, random_rotation

__all__ = ["TurboQuantTables", "RvqTables", "MseCodes", "RvqCodes", "padded_dim",
           "mse_tables", "mse_encode", "mse_decode", "mse_rotated", "mse_scores",
           "mse_scores_rotated", "mse_weighted", "mse_weighted_np", "mse_encode_np",
           "mse_decode_np", "mse_rotated_np",
           "mse_scores_np", "mse_scores_rotated_np", "rvq_tables", "rvq_encode", "rvq_decode",
           "rvq_rotated", "rvq_scores", "rvq_encode_np", "rvq_decode_np", "rvq_rotated_np",
           "rvq_scores_np", "TURBOQUANT_MSE", "TURBOQUANT_RVQ"]

DEFAULT_BITS = 2
DEFAULT_SEED = 42


class TurboQuantTables(NamedTuple):
    rotation: mx.array    # [d, d] float32 orthogonal, rows rotate as x @ rotation.T
    centroids: mx.array   # [2^bits] float32, Gaussian Lloyd-Max
    boundaries: mx.array  # [2^bits - 1] float32
    bits: int
    head_dim: int
    padded: int           # indices per row after zero padding (pack granularity)


class RvqTables(NamedTuple):
    rotation: mx.array
    centroids: mx.array       # stage 1, Gaussian Lloyd-Max
    boundaries: mx.array
    res_centroids: mx.array   # stage 2, Laplacian Lloyd-Max (unit variance)
    res_boundaries: mx.array
    bits: int
    head_dim: int
    padded: int


class MseCodes(NamedTuple):
    idx: mx.array   # [b, h, n, padded * bits / 32] uint32
    norm: mx.array  # [b, h, n] float16, ||x||


class RvqCodes(NamedTuple):
    idx: mx.array       # [b, h, n, w] uint32, stage 1
    res_idx: mx.array   # [b, h, n, w] uint32, stage 2
    norm: mx.array      # [b, h, n] float16, ||x||
    gain: mx.array      # [b, h, n] float16, least-squares scale of the stage-2 centroids


def padded_dim(head_dim: int, bits: int) -> int:
    """``head_dim`` rounded up to what :func:`velox.quant.pack` packs at ``bits``."""
    unit = 32 // bits if 32 % bits == 0 else 32
    return -(-head_dim // unit) * unit


def _bits(bits) -> int:
    if isinstance(bits, bool) or int(bits) != bits or not 1 <= int(bits) <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    return int(bits)


def _head_dim(head_dim) -> int:
    if int(head_dim) != head_dim or int(head_dim) < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    return int(head_dim)


def mse_tables(head_dim: int, bits: int, seed: int = DEFAULT_SEED) -> TurboQuantTables:
    d, bits = _head_dim(head_dim), _bits(bits)
    c, t = codebook("gaussian", bits)
    return TurboQuantTables(mx.array(random_rotation(d, seed)), mx.array(c), mx.array(t), bits, d,
                            padded_dim(d, bits))


def rvq_tables(head_dim: int, bits: int, seed: int = DEFAULT_SEED) -> RvqTables:
    base = mse_tables(head_dim, bits, seed)
    c, t = codebook("laplacian", base.bits)
    return RvqTables(base.rotation, base.centroids, base.boundaries, mx.array(c), mx.array(t),
                     base.bits, base.head_dim, base.padded)


def _params(params: dict) -> tuple[int, int]:
    return _bits(params.get("bits", DEFAULT_BITS)), int(params.get("seed", DEFAULT_SEED))


def _mse_tables_p(head_dim: int, params: dict) -> TurboQuantTables:
    return mse_tables(head_dim, *_params(params))


def _rvq_tables_p(head_dim: int, params: dict) -> RvqTables:
    return rvq_tables(head_dim, *_params(params))


def _check_rows(t, shape) -> None:
    if len(shape) != 4 or shape[-1] != t.head_dim:
        raise ValueError(f"rows must be [b, h, n, {t.head_dim}], got {tuple(shape)}")


# --- MLX ------------------------------------------------------------------------------------

def _unit(t, rows: mx.array) -> tuple[mx.array, mx.array]:
    """Rotated unit-variance coordinates ``y [b, h, n, d]`` and norms ``r [b, h, n]`` (float32)."""
    _check_rows(t, rows.shape)
    x = rows.astype(mx.float32)
    r = mx.sqrt(mx.sum(x * x, axis=-1))
    inv = mx.where(r > 0, mx.array(math.sqrt(t.head_dim), mx.float32) / r, mx.array(0.0, mx.float32))
    # one product per (batch row, head): a row's cells do not depend on what is stacked with it
    return matmul_per_slice(x, t.rotation.T) * inv[..., None], r


def _pack(t, idx: mx.array) -> mx.array:
    pad = t.padded - t.head_dim
    if pad:
        idx = mx.concatenate([idx, mx.zeros((*idx.shape[:-1], pad), mx.uint32)], axis=-1)
    return quant.pack(idx, t.bits)


def _unpack(t, words: mx.array) -> mx.array:
    return quant.unpack(words, t.bits)[..., :t.head_dim]


def _scale(t, norm: mx.array) -> mx.array:
    return norm.astype(mx.float32) * mx.array(1.0 / math.sqrt(t.head_dim), mx.float32)


def mse_encode(t: TurboQuantTables, rows: mx.array) -> MseCodes:
    y, r = _unit(t, rows)
    return MseCodes(_pack(t, cell(y, t.boundaries, t.bits)), r.astype(mx.float16))


def _unit_values(t, codes: MseCodes) -> mx.array:
    return mx.take(t.centroids, _unpack(t, codes.idx))


def mse_rotated(t: TurboQuantTables, codes: MseCodes) -> mx.array:
    return _unit_values(t, codes) * _scale(t, codes.norm)[..., None]


def mse_decode(t: TurboQuantTables, codes: MseCodes) -> mx.array:
    return mse_rotated(t, codes) @ t.rotation


def mse_scores_rotated(t: TurboQuantTables, q_rot: mx.array, codes: MseCodes) -> mx.array:
    vals = _unit_values(t, codes)
    return (q_rot.astype(mx.float32) @ vals.swapaxes(-1, -2)) * _scale(t, codes.norm)[..., None, :]


def mse_scores(t: TurboQuantTables, q: mx.array, codes: MseCodes) -> mx.array:
    return mse_scores_rotated(t, q.astype(mx.float32) @ t.rotation.T, codes)


def mse_weighted(t: TurboQuantTables, w: mx.array, codes: MseCodes) -> mx.array:
    # each weight folded into its row's scale, the sum taken against the unit centroids
    scaled = w.astype(mx.float32) * _scale(t, codes.norm)[..., None, :]
    return (scaled @ _unit_values(t, codes)) @ t.rotation


def rvq_encode(t: RvqTables, rows: mx.array) -> RvqCodes:
    y, r = _unit(t, rows)
    idx1 = cell(y, t.boundaries, t.bits)
    e = y - mx.take(t.centroids, idx1)
    rms = mx.sqrt(mx.mean(e * e, axis=-1))
    z = e * mx.where(rms > 0, 1.0 / rms, mx.array(0.0, mx.float32))[..., None]
    idx2 = cell(z, t.res_boundaries, t.bits)
    c2 = mx.take(t.res_centroids, idx2)
    gain = mx.sum(e * c2, axis=-1) / mx.sum(c2 * c2, axis=-1)
    return RvqCodes(_pack(t, idx1), _pack(t, idx2), r.astype(mx.float16), gain.astype(mx.float16))


def _rvq_unit_values(t: RvqTables, codes: RvqCodes) -> mx.array:
    c1 = mx.take(t.centroids, _unpack(t, codes.idx))
    c2 = mx.take(t.res_centroids, _unpack(t, codes.res_idx))
    return c1 + codes.gain.astype(mx.float32)[..., None] * c2


def rvq_rotated(t: RvqTables, codes: RvqCodes) -> mx.array:
    return _rvq_unit_values(t, codes) * _scale(t, codes.norm)[..., None]


def rvq_decode(t: RvqTables, codes: RvqCodes) -> mx.array:
    return rvq_rotated(t, codes) @ t.rotation


def rvq_scores(t: RvqTables, q: mx.array, codes: RvqCodes) -> mx.array:
    vals = _rvq_unit_values(t, codes)
    q_rot = q.astype(mx.float32) @ t.rotation.T
    return (q_rot @ vals.swapaxes(-1, -2)) * _scale(t, codes.norm)[..., None, :]


# --- NumPy twins (the executable spec) -------------------------------------------------------

_F32 = np.float32


def _unit_np(t, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    _check_rows(t, rows.shape)
    x = np.asarray(rows, dtype=_F32)
    r = np.sqrt(np.sum(x * x, axis=-1))
    with np.errstate(divide="ignore"):
        inv = np.where(r > 0, _F32(math.sqrt(t.head_dim)) / r, _F32(0.0)).astype(_F32)
    return ((x @ np.asarray(t.rotation).T) * inv[..., None]).astype(_F32), r


def _pack_np(t, idx: np.ndarray) -> np.ndarray:
    idx = idx.astype(np.uint32)
    pad = t.padded - t.head_dim
    if pad:
        idx = np.concatenate([idx, np.zeros((*idx.shape[:-1], pad), np.uint32)], axis=-1)
    if idx.size == 0:
        return np.zeros((*idx.shape[:-1], t.padded * t.bits // 32), np.uint32)
    return pack_codes(idx, t.bits)


def _unpack_np(t, words: np.ndarray) -> np.ndarray:
    words = np.asarray(words, np.uint32)
    if words.size == 0:
        return np.zeros((*words.shape[:-1], t.head_dim), np.uint32)
    return unpack_codes(words, t.bits)[..., :t.head_dim]


def _scale_np(t, norm: np.ndarray) -> np.ndarray:
    return np.asarray(norm).astype(_F32) * _F32(1.0 / math.sqrt(t.head_dim))


def mse_encode_np(t: TurboQuantTables, rows: np.ndarray) -> MseCodes:
    y, r = _unit_np(t, rows)
    return MseCodes(_pack_np(t, cell(y, np.asarray(t.boundaries), t.bits)), r.astype(np.float16))


def _unit_values_np(t, codes: MseCodes) -> np.ndarray:
    return np.asarray(t.centroids)[_unpack_np(t, codes.idx)]


def mse_rotated_np(t: TurboQuantTables, codes: MseCodes) -> np.ndarray:
    return _unit_values_np(t, codes) * _scale_np(t, codes.norm)[..., None]


def mse_decode_np(t: TurboQuantTables, codes: MseCodes) -> np.ndarray:
    return mse_rotated_np(t, codes) @ np.asarray(t.rotation)


def mse_scores_rotated_np(t: TurboQuantTables, q_rot: np.ndarray, codes: MseCodes) -> np.ndarray:
    vals = _unit_values_np(t, codes)
    return ((np.asarray(q_rot, _F32) @ np.swapaxes(vals, -1, -2))
            * _scale_np(t, codes.norm)[..., None, :])


def mse_scores_np(t: TurboQuantTables, q: np.ndarray, codes: MseCodes) -> np.ndarray:
    return mse_scores_rotated_np(t, np.asarray(q, _F32) @ np.asarray(t.rotation).T, codes)


def mse_weighted_np(t: TurboQuantTables, w: np.ndarray, codes: MseCodes) -> np.ndarray:
    scaled = np.asarray(w, _F32) * _scale_np(t, codes.norm)[..., None, :]
    return (scaled @ _unit_values_np(t, codes)) @ np.asarray(t.rotation)


def rvq_encode_np(t: RvqTables, rows: np.ndarray) -> RvqCodes:
    y, r = _unit_np(t, rows)
    idx1 = cell(y, np.asarray(t.boundaries), t.bits)
    e = y - np.asarray(t.centroids)[idx1]
    rms = np.sqrt(np.mean(e * e, axis=-1))
    with np.errstate(divide="ignore"):
        z = e * np.where(rms > 0, _F32(1.0) / rms, _F32(0.0)).astype(_F32)[..., None]
    idx2 = cell(z, np.asarray(t.res_boundaries), t.bits)
    c2 = np.asarray(t.res_centroids)[idx2]
    gain = np.sum(e * c2, axis=-1) / np.sum(c2 * c2, axis=-1)
    return RvqCodes(_pack_np(t, idx1), _pack_np(t, idx2), r.astype(np.float16),
                    gain.astype(np.float16))


def _rvq_unit_values_np(t: RvqTables, codes: RvqCodes) -> np.ndarray:
    c1 = np.asarray(t.centroids)[_unpack_np(t, codes.idx)]
    c2 = np.asarray(t.res_centroids)[_unpack_np(t, codes.res_idx)]
    return c1 + np.asarray(codes.gain).astype(_F32)[..., None] * c2


def rvq_rotated_np(t: RvqTables, codes: RvqCodes) -> np.ndarray:
    return _rvq_unit_values_np(t, codes) * _scale_np(t, codes.norm)[..., None]


def rvq_decode_np(t: RvqTables, codes: RvqCodes) -> np.ndarray:
    return rvq_rotated_np(t, codes) @ np.asarray(t.rotation)


def rvq_scores_np(t: RvqTables, q: np.ndarray, codes: RvqCodes) -> np.ndarray:
    vals = _rvq_unit_values_np(t, codes)
    q_rot = np.asarray(q, _F32) @ np.asarray(t.rotation).T
    return (q_rot @ np.swapaxes(vals, -1, -2)) * _scale_np(t, codes.norm)[..., None, :]


TURBOQUANT_MSE = register_codec(Codec(
    name="turboquant_mse", tables=_mse_tables_p, encode=mse_encode, decode=mse_decode,
    scores=mse_scores, encode_np=mse_encode_np, decode_np=mse_decode_np, scores_np=mse_scores_np,
    params=("bits", "seed"),
    error=("E||x - x_hat||^2 <= (sqrt(3) pi / 2) 4^-bits ||x||^2 over the random rotation (the "
           "Gaussian Lloyd-Max distortion is 0.363, 0.118, 0.0345, 0.0095 ||x||^2 at 1-4 bits); "
           "the score q . x_hat is biased toward 0 at low bits."),
))

TURBOQUANT_RVQ = register_codec(Codec(
    name="turboquant_rvq", tables=_rvq_tables_p, encode=rvq_encode, decode=rvq_decode,
    scores=rvq_scores, encode_np=rvq_encode_np, decode_np=rvq_decode_np, scores_np=rvq_scores_np,
    params=("bits", "seed"),
    error=("Per row, in the rotated unit-variance domain, stage 2 never increases the stage-1 "
           "squared error (least-squares gain), so E||x - x_hat||^2 <= (sqrt(3) pi / 2) "
           "4^-bits ||x||^2 (up to the float16 norm); scores are biased toward 0."),
))
