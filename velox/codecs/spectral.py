"""SpectralQuant: a calibrated spectral rotation, a scalar quantizer of every rotated coordinate,
and QJL error correction on the signal coordinates only (Dynamis Labs, "3% Is All You Need:
Breaking TurboQuant's Compression Limit via Spectral Structure"; no arXiv id).

Keys of a layer concentrate in a few directions: the participation ratio of their covariance's
eigenvalues, ``(sum l)^2 / sum l^2`` (:func:`participation_ratio`), is about 4 of 128. A row
``x`` is rotated into a basis whose first ``d_eff`` coordinates are those directions:
``y = x @ rotation.T`` (``rotation``'s rows are the basis, the convention of
``velox.codecs.rotation``), with ``rotation`` from calibration (:func:`pca_rotation`: the
covariance's eigenvectors by decreasing eigenvalue) or, when ``params["rotation"]`` is absent or
``None``, the data-oblivious ``velox.codecs.rotation.random_rotation(d, seed)``.

Per-head calibration: kv heads of one layer have different key spectra, so a calibrated
``rotation`` is ``[h, d, d]`` and ``scales`` ``[h, d]`` (:func:`calibrate_heads`: one fit per kv
head), and head ``i`` of rows ``[b, h, n, d]`` is coded in its own basis with its own spreads
(``y = x @ rotation.swapaxes(-1, -2)`` broadcasts the head axis). A ``[d, d]`` rotation and
``[d]`` spreads (the uncalibrated fallback, or one basis given for every head) are shared by all
heads. The tables keep no batch or token axis either way; the rows' head count must be the
tables' ``h`` (a ``ValueError`` otherwise).

1. Scalar stage, every coordinate: with the row's norm ``||x||`` (stored in float16) and a
   per-coordinate spread ``s_j`` (``params["scales"]``, ``sum s_j^2 = 1``; absent: ``1/sqrt(d)``
   for every ``j``, the isotropic law of a randomly rotated row), ``u_j = y_j / (||x|| s_j)`` is
   roughly N(0, 1) and takes the Lloyd-Max code of the unit Gaussian (``velox.codecs.lloyd``):
   ``y^_j = ||x|| s_j c[code_j]``. The first ``d_eff`` (signal) coordinates take
   ``signal_bits``-bit codes, the others ``bits``-bit codes (non-uniform allocation;
   ``signal_bits = 0``, the default, is ``bits`` for every coordinate: one codebook, the same
   codes and bytes as without the parameter). With the isotropic spreads this is
   exactly the ``turboquant_mse`` codec's arithmetic in the given basis (the same codes, the same
   decode). A calibrated basis needs its spreads: one norm for coordinates of very unequal
   variance would saturate the top ones. :func:`calibrate`
   gives both the PCA rotation and the spreads ``s_j`` of calibration keys.
2. QJL stage (``apply_qjl``), the first ``d_eff`` coordinates only: the residual
   ``r = y[:d_eff] - y^[:d_eff]`` is held as ``sign(S r)`` (``m`` bits, ``S [m, d_eff]`` i.i.d.
   N(0, 1) drawn from ``seed``) and ``||r||`` (float16), and the signal coordinates are corrected
   by the unbiased QJL estimate of ``r``, ``sqrt(pi/2) / m * ||r|| * S^T sign(S r)``. ``jl_dim``
   is ``m``; 0 means ``m = d_eff`` (one sign bit a signal coordinate: the correction costs
   ``d_eff`` bits and a float16 a row). The other coordinates are never touched by it.

Float32 arithmetic in the same order in the MLX functions and their NumPy twins: the same codes
from the same rotated rows (from the same rows, codes differ only where the two rotation matmuls
round a coordinate across a cell boundary). Norms are float16; rows of norm above 65504 overflow.

A row holds ``ceil((d_eff * signal_bits + (d - d_eff) * bits) / 8)`` bytes of packed codes (one
little-endian bit stream: the signal coordinates' codes first; ``ceil(d * bits / 8)`` with equal
bits) and a float16 norm, plus, with QJL, ``ceil(m / 8)`` bytes of signs and a float16 residual
norm (``bytes_per_row``).

Scores rotate the query once and take its dot product with the keys rebuilt in the rotated basis
(a centroid lookup times the row's norm and spread, no unrotation of the keys), plus the QJL
term ``sqrt(pi/2) / m * ||r|| * <S q[:d_eff], sign(S r)>`` computed from the signs.

Error: the QJL term is an unbiased estimate of the signal residual's contribution, with
variance at most ``(pi/2) ||q[:d_eff]||^2 ||r||^2 / m``; the remaining coordinates carry the
scalar stage's Lloyd-Max error.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import Codec, register_codec
from .lloyd import cell, codebook
from .polar import pack_codes, pack_codes_np, unpack_codes, unpack_codes_np
from .rotation import matmul_per_slice, random_rotation

__all__ = ["SpectralTables", "SpectralCodes", "tables", "encode", "decode", "scores",
           "encode_np", "decode_np", "scores_np", "pca_rotation", "participation_ratio",
           "calibrate", "calibrate_heads", "bytes_per_row", "CODEC"]


class SpectralTables(NamedTuple):
    """The rotation (rows the basis), spreads, the Gaussian codebook, the QJL sketch, widths."""

    rotation: mx.array       # [d, d] shared or [h, d, d] per kv head; y = x @ rotation.T
    scales: mx.array         # [d] or [h, d]: spread s_j of each rotated coordinate (sum s_j^2 = 1)
    gains: mx.array          # [d] or [h, d]: 1 / (sqrt(d) s_j), exactly 1 for the isotropic default
    centroids: mx.array      # [2^bits]
    boundaries: mx.array     # [2^bits - 1]
    signal_centroids: mx.array   # [2^signal_bits]; [0] with equal bits (centroids serve all)
    signal_boundaries: mx.array  # [2^signal_bits - 1]; [0] with equal bits
    sketch: mx.array         # [m, d_eff] (m = 0 rows without QJL)
    head_dim: int
    bits: int
    signal_bits: int         # bits of the first d_eff coordinates (bits when not set)
    d_eff: int
    jl_dim: int              # m; 0 when apply_qjl is off
    apply_qjl: bool


class SpectralCodes(NamedTuple):
    """Packed scalar codes, the row norm, the QJL signs and residual norm (empty without QJL)."""

    codes: mx.array          # uint8 [b, h, n, ceil((d_eff sbits + (d - d_eff) bits) / 8)]
    norms: mx.array          # float16 [b, h, n]
    signs: mx.array          # uint8 [b, h, n, ceil(m / 8)]
    rnorms: mx.array         # float16 [b, h, n, 1] (with QJL) or [b, h, n, 0]


def pca_rotation(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PCA of calibration ``keys [t, d]``: ``(rotation [d, d] float32, eigenvalues [d]
    float64)``, the rows of ``rotation`` the covariance's eigenvectors by decreasing
    eigenvalue (``y = x @ rotation.T`` puts the top principal direction first)."""
    k = np.asarray(keys, np.float64).reshape(-1, np.shape(keys)[-1])
    k = k - k.mean(axis=0)
    cov = k.T @ k / max(len(k), 1)
    lam, vec = np.linalg.eigh(cov)
    order = np.argsort(lam)[::-1]
    return vec[:, order].T.astype(np.float32), np.clip(lam[order], 0.0, None)


def participation_ratio(eigenvalues) -> float:
    """``(sum l)^2 / sum l^2``: the effective number of dimensions, in ``[1, d]`` (``d`` for an
    isotropic spectrum, 1 for rank one; scale-invariant)."""
    lam = np.asarray(eigenvalues, np.float64)
    den = float(np.sum(lam * lam))
    return float(np.sum(lam)) ** 2 / den if den > 0 else 0.0


def calibrate(keys: np.ndarray, floor: float = 1e-4) -> dict:
    """``{"rotation", "scales", "d_eff"}`` from calibration keys ``[t, d]``: the PCA rotation,
    each rotated coordinate's root mean square as a fraction of the rows' (floored at ``floor``
    times the largest, then renormalized to ``sum s_j^2 = 1``), and the participation ratio
    rounded (at least 1)."""
    k = np.asarray(keys, np.float64).reshape(-1, np.shape(keys)[-1])
    rot, lam = pca_rotation(k)
    ms = np.mean((k @ rot.astype(np.float64).T) ** 2, axis=0)
    s = np.sqrt(ms / max(ms.sum(), 1e-300))
    s = np.maximum(s, floor * s.max()) if s.max() > 0 else np.full_like(s, 1.0)
    s = s / np.sqrt(np.sum(s * s))
    return {"rotation": rot, "scales": s.astype(np.float32),
            "d_eff": max(1, int(round(participation_ratio(lam))))}


def calibrate_heads(keys: np.ndarray, floor: float = 1e-4) -> dict:
    """One :func:`calibrate` per kv head of keys ``[t, h, d]`` (never pooling heads):
    ``{"rotation" [h, d, d], "scales" [h, d], "eigenvalues" [h, d], "participation_ratio"
    [h]}``, head ``i``'s basis and spreads from its own keys only."""
    k = np.asarray(keys, np.float64)
    if k.ndim != 3:
        raise ValueError(f"keys must be [tokens, kv_heads, head_dim], got shape {k.shape}")
    fits = [calibrate(k[:, i], floor) for i in range(k.shape[1])]
    lams = [pca_rotation(k[:, i])[1] for i in range(k.shape[1])]
    return {"rotation": np.stack([f["rotation"] for f in fits]),
            "scales": np.stack([f["scales"] for f in fits]),
            "eigenvalues": np.stack(lams).astype(np.float32),
            "participation_ratio": np.array([participation_ratio(v) for v in lams], np.float32)}


def tables(head_dim: int, params: dict) -> SpectralTables:
    d = head_dim
    bits = int(params.get("bits", 2))
    d_eff = int(params.get("d_eff", 4))
    apply_qjl = bool(params.get("apply_qjl", True))
    jl = int(params.get("jl_dim", 0))
    seed = int(params.get("seed", 42))
    if not 1 <= bits <= 8:
        raise ValueError(f"bits={bits} must lie in 1..8")
    if not 0 <= d_eff <= d:
        raise ValueError(f"d_eff={d_eff} must lie in 0..head_dim={d}")
    sbits = _signal_bits(params)
    if jl < 0:
        raise ValueError(f"jl_dim={jl} must be >= 0 (0 means d_eff)")
    rot = params.get("rotation")
    rot = random_rotation(d, seed) if rot is None else np.asarray(rot, np.float32)
    if rot.ndim not in (2, 3) or rot.shape[-2:] != (d, d):
        raise ValueError(f"rotation of shape {rot.shape} is not [{d}, {d}] nor [heads, {d}, {d}]")
    sc = params.get("scales")
    if sc is None:
        sc, gains = np.full(d, 1 / math.sqrt(d), np.float32), np.ones(d, np.float32)
    else:
        sc = np.asarray(sc, np.float64)
        if sc.ndim not in (1, 2) or sc.shape[-1] != d or not np.all(sc > 0):
            raise ValueError(f"scales of shape {sc.shape} must be {d} positive spreads (a head)")
        gains = (1 / (math.sqrt(d) * sc)).astype(np.float32)
        sc = sc.astype(np.float32)
    if rot.ndim == 3 and sc.ndim == 2 and rot.shape[0] != sc.shape[0]:
        raise ValueError(f"rotation holds {rot.shape[0]} heads, scales {sc.shape[0]}")
    m = (jl or d_eff) if apply_qjl and d_eff > 0 else 0
    sketch = np.random.default_rng([seed, 1]).standard_normal((m, d_eff)).astype(np.float32)
    c, b = codebook("gaussian", bits)
    sc_c, sc_b = codebook("gaussian", sbits) if sbits != bits else (np.zeros(0), np.zeros(0))
    f = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731
    return SpectralTables(f(rot), f(sc), f(gains), f(c), f(b), f(sc_c), f(sc_b), f(sketch), d,
                          bits, sbits, d_eff, m, m > 0)


def _signal_bits(params: dict) -> int:
    """The signal coordinates' bits: ``params["signal_bits"]``, 0 (or absent) meaning ``bits``
    (also with no signal coordinate, ``d_eff = 0``)."""
    bits, d_eff = int(params.get("bits", 2)), int(params.get("d_eff", 4))
    sbits = int(params.get("signal_bits", 0))
    if not 0 <= sbits <= 8:
        raise ValueError(f"signal_bits={sbits} must lie in 0..8 (0: the same as bits={bits})")
    return sbits if sbits and d_eff else bits


def _parts(t: SpectralTables) -> list[tuple[int, int, int, object, object]]:
    """``(start, stop, bits, centroids, boundaries)`` of each run of rotated coordinates coded
    with one codebook, in bit-stream order: all ``d`` at ``bits`` with equal bits, else the
    ``d_eff`` signal coordinates at ``signal_bits`` and then the rest (an empty run left out)."""
    d, k = t.head_dim, t.d_eff
    if t.signal_centroids.shape[0] == 0:
        return [(0, d, t.bits, t.centroids, t.boundaries)]
    parts = [(0, k, t.signal_bits, t.signal_centroids, t.signal_boundaries),
             (k, d, t.bits, t.centroids, t.boundaries)]
    return [p for p in parts if p[1] > p[0]]


def bytes_per_row(head_dim: int, params: dict) -> int:
    """Bytes :func:`encode` holds a row."""
    bits, d_eff = int(params.get("bits", 2)), int(params.get("d_eff", 4))
    sbits = _signal_bits(params)
    m = (int(params.get("jl_dim", 0)) or d_eff) if params.get("apply_qjl", True) and d_eff else 0
    code_bits = d_eff * sbits + (head_dim - d_eff) * bits
    return -(-code_bits // 8) + 2 + (-(-m // 8) + 2 if m else 0)


def _qjl_scale(t: SpectralTables) -> float:
    return math.sqrt(math.pi / 2) / t.jl_dim


def _basis_t(rotation):
    """``rotation`` transposed on its last two axes (``[d, d]`` or ``[h, d, d]``): rows times it
    are the rotated rows, head ``i`` by head ``i``'s basis."""
    return rotation.T if rotation.ndim == 2 else rotation.swapaxes(-1, -2)


def _per_head(v):
    """Spreads or gains ``[d]`` as they are, ``[h, d]`` as ``[h, 1, d]`` (against ``[b, h, n,
    d]``)."""
    return v if v.ndim == 1 else v[:, None, :]


def _check_heads(t: SpectralTables, shape) -> None:
    """Per-head tables fit only rows ``[..., h, n, d]`` of their head count ``h``."""
    for name, a in (("rotation", t.rotation), ("scales", t.scales)):
        if a.ndim == (3 if name == "rotation" else 2) and (
                len(shape) < 3 or shape[-3] != a.shape[0]):
            raise ValueError(f"the tables' {name} holds {a.shape[0]} kv heads; rows of shape "
                             f"{tuple(shape)} do not have {a.shape[0]} heads")


# ---- MLX -----------------------------------------------------------------------------------

def _scalar_rotated(t: SpectralTables, y: mx.array, r: mx.array):
    """Codes of rotated rows ``y`` of norms ``r`` (float32 ``[...]``) and ``y^`` (from the
    float16 norm): ``u = y * sqrt(d) / r * gain``, TurboQuant's unit coordinates when the
    spreads are isotropic."""
    zero = mx.array(0.0, mx.float32)
    inv = mx.where(r > 0, mx.array(math.sqrt(t.head_dim), mx.float32) / r, zero)
    u = (y * inv[..., None]) * _per_head(t.gains)
    codes = [cell(u[..., a:z], bnd, w) for a, z, w, _, bnd in _parts(t)]
    n16 = r.astype(mx.float16)
    return codes, _lookup(t, codes, n16), n16


def _lookup(t: SpectralTables, codes: list[mx.array], norms: mx.array) -> mx.array:
    """The scalar stage's rotated rows from each run's codes and the float16 norms."""
    cents = [mx.take(cen, c) for c, (_, _, _, cen, _) in zip(codes, _parts(t))]
    cents = cents[0] if len(cents) == 1 else mx.concatenate(cents, axis=-1)
    return cents * (norms.astype(mx.float32)[..., None] * _per_head(t.scales))


def _unpacked(t: SpectralTables, codes: SpectralCodes) -> mx.array:
    parts = _parts(t)
    c = unpack_codes(codes.codes, [z - a for a, z, *_ in parts], [p[2] for p in parts])
    return _lookup(t, c, codes.norms)


def _encode_rotated(t: SpectralTables, y: mx.array, r: mx.array) -> SpectralCodes:
    codes, yh, n16 = _scalar_rotated(t, y, r)
    lead = y.shape[:-1]
    if t.apply_qjl:
        e = y[..., :t.d_eff] - yh[..., :t.d_eff]
        bits = (_per_slice(e, t.sketch.T) > 0).astype(mx.uint32)
        signs = pack_codes([bits], [1])
        rn = mx.sqrt((e * e).sum(axis=-1, keepdims=True)).astype(mx.float16)
    else:
        signs, rn = mx.zeros((*lead, 0), mx.uint8), mx.zeros((*lead, 0), mx.float16)
    return SpectralCodes(pack_codes(codes, [p[2] for p in _parts(t)]), n16, signs, rn)


def _per_slice(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w`` with a shared ``[k, m]`` matrix as one product per batch row and head
    (``rotation.matmul_per_slice``: a row's codes do not depend on what is stacked with it);
    a per-head ``[h, k, m]`` matrix already multiplies each head on its own."""
    return matmul_per_slice(x, w) if w.ndim == 2 else x @ w


def _signs(t: SpectralTables, codes: SpectralCodes) -> mx.array:
    (bits,) = unpack_codes(codes.signs, [t.jl_dim], [1])
    return 2 * bits.astype(mx.float32) - 1


def _decode_rotated(t: SpectralTables, codes: SpectralCodes) -> mx.array:
    yh = _unpacked(t, codes)
    if not t.apply_qjl:
        return yh
    fix = (_signs(t, codes) @ t.sketch) * (_qjl_scale(t) * codes.rnorms.astype(mx.float32))
    return mx.concatenate([yh[..., :t.d_eff] + fix, yh[..., t.d_eff:]], axis=-1)


def encode(t: SpectralTables, rows: mx.array) -> SpectralCodes:
    _check_heads(t, rows.shape)
    x = rows.astype(mx.float32)
    return _encode_rotated(t, _per_slice(x, _basis_t(t.rotation)), mx.sqrt(mx.sum(x * x, axis=-1)))


def decode(t: SpectralTables, codes: SpectralCodes) -> mx.array:
    _check_heads(t, (*codes.norms.shape, 0))
    return _decode_rotated(t, codes) @ t.rotation


def scores(t: SpectralTables, queries: mx.array, codes: SpectralCodes) -> mx.array:
    """The rotated query against the scalar stage's keys in the rotated basis, plus the QJL
    term from the signs."""
    _check_heads(t, (*codes.norms.shape, 0))
    q = queries.astype(mx.float32) @ _basis_t(t.rotation)
    s = q @ _unpacked(t, codes).swapaxes(-1, -2)
    if t.apply_qjl:
        sq = q[..., :t.d_eff] @ t.sketch.T
        rn = codes.rnorms.astype(mx.float32)[..., 0]
        s = s + (sq @ _signs(t, codes).swapaxes(-1, -2)) * (_qjl_scale(t) * rn)[:, :, None, :]
    return s


# ---- NumPy twins ---------------------------------------------------------------------------

def _scalar_rotated_np(t: SpectralTables, y: np.ndarray, r: np.ndarray):
    with np.errstate(divide="ignore"):
        inv = np.where(r > 0, np.float32(math.sqrt(t.head_dim)) / r, np.float32(0.0))
    u = (y * inv.astype(np.float32)[..., None]) * _per_head(t.gains)
    codes = [cell(u[..., a:z], bnd, w) for a, z, w, _, bnd in _parts(t)]
    n16 = r.astype(np.float16)
    return codes, _lookup_np(t, codes, n16), n16


def _lookup_np(t: SpectralTables, codes: list, norms) -> np.ndarray:
    """NumPy twin of :func:`_lookup` (``norms`` NumPy or MLX float16)."""
    cents = [cen[c] for c, (_, _, _, cen, _) in zip(codes, _parts(t))]
    cents = cents[0] if len(cents) == 1 else np.concatenate(cents, axis=-1)
    return cents * (np.asarray(norms).astype(np.float32)[..., None] * _per_head(t.scales))


def _encode_rotated_np(t: SpectralTables, y: np.ndarray, r: np.ndarray) -> SpectralCodes:
    codes, yh, n16 = _scalar_rotated_np(t, y, r)
    lead = y.shape[:-1]
    if t.apply_qjl:
        e = y[..., :t.d_eff] - yh[..., :t.d_eff]
        signs = pack_codes_np([(e @ t.sketch.T > 0).astype(np.uint32)], [1])
        rn = np.sqrt((e * e).sum(axis=-1, keepdims=True)).astype(np.float16)
    else:
        signs, rn = np.zeros((*lead, 0), np.uint8), np.zeros((*lead, 0), np.float16)
    return SpectralCodes(pack_codes_np(codes, [p[2] for p in _parts(t)]), n16, signs, rn)


def _signs_np(t: SpectralTables, codes: SpectralCodes) -> np.ndarray:
    (bits,) = unpack_codes_np(np.asarray(codes.signs), [t.jl_dim], [1])
    return 2 * bits.astype(np.float32) - 1


def _scalar_decode_np(t: SpectralTables, codes: SpectralCodes) -> np.ndarray:
    parts = _parts(t)
    c = unpack_codes_np(np.asarray(codes.codes), [z - a for a, z, *_ in parts],
                        [p[2] for p in parts])
    return _lookup_np(t, c, codes.norms)


def _decode_rotated_np(t: SpectralTables, codes: SpectralCodes) -> np.ndarray:
    yh = _scalar_decode_np(t, codes)
    if not t.apply_qjl:
        return yh
    scale = np.float32(_qjl_scale(t)) * np.asarray(codes.rnorms).astype(np.float32)
    fix = (_signs_np(t, codes) @ t.sketch) * scale
    return np.concatenate([yh[..., :t.d_eff] + fix, yh[..., t.d_eff:]], axis=-1)


def encode_np(t: SpectralTables, rows: np.ndarray) -> SpectralCodes:
    """NumPy twin of :func:`encode` (float32 throughout)."""
    x = np.asarray(rows, np.float32)
    _check_heads(t, x.shape)
    return _encode_rotated_np(t, x @ _basis_t(t.rotation), np.sqrt(np.sum(x * x, axis=-1)))


def decode_np(t: SpectralTables, codes: SpectralCodes) -> np.ndarray:
    _check_heads(t, (*np.shape(codes.norms), 0))
    return _decode_rotated_np(t, codes) @ t.rotation


def scores_np(t: SpectralTables, queries: np.ndarray, codes: SpectralCodes) -> np.ndarray:
    _check_heads(t, (*np.shape(codes.norms), 0))
    q = np.asarray(queries, np.float32) @ _basis_t(t.rotation)
    s = q @ np.swapaxes(_scalar_decode_np(t, codes), -1, -2)
    if t.apply_qjl:
        sq = q[..., :t.d_eff] @ t.sketch.T
        rn = np.asarray(codes.rnorms).astype(np.float32)[..., 0]
        scale = np.float32(_qjl_scale(t)) * rn
        s = s + (sq @ np.swapaxes(_signs_np(t, codes), -1, -2)) * scale[:, :, None, :]
    return s


CODEC = register_codec(Codec(
    name="spectral", tables=tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np,
    params=("bits", "signal_bits", "d_eff", "apply_qjl", "jl_dim", "seed", "rotation", "scales"),
    error="the QJL term is unbiased for the signal residual's share of q.k with variance <= "
          "(pi/2)||q[:d_eff]||^2||r||^2/m; the other coordinates carry the Gaussian Lloyd-Max "
          "scalar error of their spread (E (y_j - y^_j)^2 = distortion(bits) ||x||^2 s_j^2 for "
          "Gaussian coordinates; distortion(signal_bits) on the signal coordinates)"))
