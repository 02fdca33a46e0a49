"""PolarQuant: keys as recursive polar angles of randomly rotated blocks (Han, Kacham, Karbasi,
Mirrokni, Zandieh, arXiv 2502.02617).

A row ``x`` of ``d`` channels is rotated, ``y = x @ rotation.T`` (``random_rotation(d, seed)``
of ``velox.codecs.rotation``: a randomized Hadamard matrix for power-of-two ``d``), which makes
its coordinates nearly i.i.d. Gaussian. ``y`` splits into blocks of ``block`` coordinates (a
power of two dividing ``d``), and each block goes through ``L = log2(block)`` levels of the polar
transform:

* level 1 pairs the coordinates ``(y[2i], y[2i+1])`` into a radius and an angle in
  ``[0, 2 pi)``; the angle is quantized uniformly at ``level1_bits`` bits;
* level ``l >= 2`` pairs the radii ``(r[2i], r[2i+1])`` of level ``l - 1`` into a radius and an
  angle ``psi = atan(r[2i+1] / r[2i])`` in ``[0, pi/2]``, whose density for Gaussian ``y`` is
  known: proportional to ``sin(2 psi) ** (2 ** (l - 1) - 1)``, tightly concentrated around
  ``pi/4`` at high levels. It is quantized at ``bits`` bits with the Lloyd-Max codebook of that
  density (computed numerically on a grid of 2^16 points, once per level and width,
  :func:`angle_codebook`);
* the block's last radius is stored in float16: no per-block scale or zero.

A block of ``block`` coordinates holds ``block / 2`` level-1 angles, ``block / 2 - 1`` higher
angles and one radius, so a row holds ``ceil((d/2 * level1_bits + (d/2 - d/block) * bits) / 8)``
bytes of angle codes (one bit stream a row, :func:`pack_codes`) plus ``2 * d / block`` bytes of
radii: the paper's configuration (block 16, 4/2/2/2 bits) is 3.875 bits a coordinate.

The codes are chosen without computing an angle: ``psi > boundary`` is
``r[2i+1] * cos(boundary) > r[2i] * sin(boundary)`` (level 1: the point is first folded into the
upper half-plane), products and comparisons only, so the MLX functions and their NumPy twins
give the same codes from the same rotated rows (from the same rows, codes differ only where the
two rotation matmuls round a coordinate across a boundary). Radii are float16 (relative rounding
2^-11); blocks of norm above 65504 overflow them. Decoding multiplies the stored radius down the
tree by the cosines and sines of the centroids, then unrotates.

Scores decode, then take dot products: the query is rotated once and meets the keys rebuilt in
the rotated basis (the tree of cosine and sine products, ``d`` multiplications a key and level),
so the keys are never unrotated; no query-centroid lookup table is used.

Error: every angle lies within half its codebook cell of its centroid and the radius is stored to
float16, so each decoded block's norm is its stored radius and the direction error is bounded by the sum of the
levels' half cell widths along each coordinate's path.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import Codec, register_codec
from .rotation import random_rotation

__all__ = ["PolarTables", "PolarCodes", "tables", "encode", "decode", "scores", "encode_np",
           "decode_np", "scores_np", "angle_codebook", "lloyd_max", "pack_codes",
           "unpack_codes", "pack_codes_np", "unpack_codes_np", "bytes_per_row", "CODEC"]

_GRID = 1 << 16


def lloyd_max(grid: np.ndarray, density: np.ndarray, levels: int, iters: int = 20000,
              tol: float = 1e-10) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max quantizer of the density sampled at the sorted points ``grid`` (float64):
    ``(centroids [levels], boundaries [levels - 1])``, boundaries the centroids' midpoints,
    centroids the density's mean in their cell (at most ``iters`` steps, until no centroid
    moves by ``tol``)."""
    w = np.asarray(density, np.float64)
    g = np.asarray(grid, np.float64)
    # the samples' cells: edges halfway between points; mass and moment piecewise linear in them
    edges = np.concatenate([[1.5 * g[0] - 0.5 * g[1]], (g[:-1] + g[1:]) / 2,
                            [1.5 * g[-1] - 0.5 * g[-2]]])
    mass = np.concatenate([[0.0], np.cumsum(w)])
    moment = np.concatenate([[0.0], np.cumsum(w * g)])
    # start at the compander's points (centroid density prop. to density^(1/3), asymptotically
    # optimal), so that few Lloyd steps remain
    comp = np.cumsum(np.cbrt(w))
    c = np.interp((np.arange(levels) + 0.5) / levels, comp / comp[-1], g)
    for _ in range(iters):
        b = np.concatenate([[edges[0]], (c[:-1] + c[1:]) / 2, [edges[-1]]])
        m, s = np.diff(np.interp(b, edges, mass)), np.diff(np.interp(b, edges, moment))
        new = np.where(m > 0, s / np.where(m > 0, m, 1.0), c)
        done = np.max(np.abs(new - c)) < tol
        c = new
        if done:
            break
    return c, (c[:-1] + c[1:]) / 2


@functools.lru_cache(maxsize=None)
def angle_codebook(level: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``bits``-bit codebook ``(centroids, boundaries)`` (float64 radians) of level
    ``level``'s angles: uniform cells of ``[0, 2 pi)`` at level 1, Lloyd-Max on ``[0, pi/2]``
    for the density ``sin(2 psi) ** (2 ** (level - 1) - 1)`` above."""
    k = 1 << bits
    if level == 1:
        step = 2 * math.pi / k
        return (np.arange(k) + 0.5) * step, np.arange(1, k) * step
    g = (np.arange(_GRID) + 0.5) * (math.pi / 2 / _GRID)
    power = (1 << (level - 1)) - 1
    logw = power * np.log(np.sin(2 * g))
    c, b = lloyd_max(g, np.exp(logw - logw.max()), k)
    return c, b


class PolarTables(NamedTuple):
    """The rotation, each level's codebook as cosines and sines, and the widths."""

    rotation: mx.array       # [d, d], y = x @ rotation.T (velox.codecs.rotation)
    l1_bcos: mx.array        # [2^level1_bits / 2 - 1] level-1 boundaries below pi
    l1_bsin: mx.array
    l1_ccos: mx.array        # [2^level1_bits] level-1 centroids
    l1_csin: mx.array
    up_bcos: mx.array        # [L - 1, 2^bits - 1] boundaries of levels 2..L
    up_bsin: mx.array
    up_ccos: mx.array        # [L - 1, 2^bits] centroids of levels 2..L
    up_csin: mx.array
    head_dim: int
    block: int
    levels: int
    bits: int
    level1_bits: int


class PolarCodes(NamedTuple):
    """Each row's angle codes (one bit stream, bytes) and its blocks' final radii."""

    angles: mx.array         # uint8 [b, h, n, bytes_per_row - 2 * d / block]
    radii: mx.array          # float16 [b, h, n, d / block]


def tables(head_dim: int, params: dict) -> PolarTables:
    bits = int(params.get("bits", 2))
    l1 = int(params.get("level1_bits", 4))
    block = int(params.get("block", 16))
    seed = int(params.get("seed", 42))
    if not 1 <= bits <= 8 or not 1 <= l1 <= 8:
        raise ValueError(f"bits={bits} and level1_bits={l1} must lie in 1..8")
    if block < 2 or block & (block - 1):
        raise ValueError(f"block={block} is not a power of two >= 2")
    if head_dim % block:
        raise ValueError(f"block={block} does not divide head_dim={head_dim}")
    levels = block.bit_length() - 1
    c1, b1 = angle_codebook(1, l1)
    b1 = b1[: (1 << l1) // 2 - 1]
    ups = [angle_codebook(lv, bits) for lv in range(2, levels + 1)]
    k = 1 << bits
    uc = np.array([c for c, _ in ups], np.float64).reshape(levels - 1, k)
    ub = np.array([b for _, b in ups], np.float64).reshape(levels - 1, k - 1)
    f = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731
    return PolarTables(f(random_rotation(head_dim, seed)), f(np.cos(b1)), f(np.sin(b1)),
                       f(np.cos(c1)), f(np.sin(c1)), f(np.cos(ub)), f(np.sin(ub)),
                       f(np.cos(uc)), f(np.sin(uc)),
                       head_dim, block, levels, bits, l1)


def _widths(t: PolarTables) -> list[tuple[int, int]]:
    """``(count, bits)`` of each level's angles in a row, level 1 first."""
    d = t.head_dim
    return [(d // 2, t.level1_bits)] + [(d >> lv, t.bits) for lv in range(2, t.levels + 1)]


def bytes_per_row(head_dim: int, params: dict) -> int:
    """Bytes :func:`encode` holds a row: the packed angle codes and the float16 radii."""
    bits, l1, block = (int(params.get("bits", 2)), int(params.get("level1_bits", 4)),
                       int(params.get("block", 16)))
    angle_bits = head_dim // 2 * l1 + (head_dim // 2 - head_dim // block) * bits
    return -(-angle_bits // 8) + 2 * (head_dim // block)


# ---- bit streams ---------------------------------------------------------------------------

def pack_codes(codes: list[mx.array], widths: list[int]) -> mx.array:
    """Codes ``[..., c_i]`` of ``widths[i]`` bits each, one little-endian bit stream a row, into
    ``uint8 [..., ceil(sum c_i * w_i / 8)]`` (zero padded)."""
    lead = codes[0].shape[:-1]
    parts = []
    for c, w in zip(codes, widths):
        sh = mx.arange(w, dtype=mx.uint32)
        parts.append(((c.astype(mx.uint32)[..., None] >> sh) & 1).reshape(*lead, c.shape[-1] * w))
    bits = mx.concatenate(parts, axis=-1)
    pad = -bits.shape[-1] % 8
    if pad:
        bits = mx.concatenate([bits, mx.zeros((*lead, pad), mx.uint32)], axis=-1)
    bits = bits.reshape(*lead, bits.shape[-1] // 8, 8)
    return (bits << mx.arange(8, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint8)


def unpack_codes(stream: mx.array, counts: list[int], widths: list[int]) -> list[mx.array]:
    """Inverse of :func:`pack_codes`: ``uint32 [..., c_i]`` codes."""
    lead = stream.shape[:-1]
    bits = (stream.astype(mx.uint32)[..., None] >> mx.arange(8, dtype=mx.uint32)) & 1
    bits = bits.reshape(*lead, stream.shape[-1] * 8)
    out, off = [], 0
    for c, w in zip(counts, widths):
        seg = bits[..., off:off + c * w].reshape(*lead, c, w)
        out.append((seg << mx.arange(w, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32))
        off += c * w
    return out


def pack_codes_np(codes: list[np.ndarray], widths: list[int]) -> np.ndarray:
    """NumPy twin of :func:`pack_codes`."""
    lead = codes[0].shape[:-1]
    parts = [((np.asarray(c, np.uint32)[..., None] >> np.arange(w, dtype=np.uint32)) & 1)
             .reshape(*lead, c.shape[-1] * w) for c, w in zip(codes, widths)]
    bits = np.concatenate(parts, axis=-1)
    pad = -bits.shape[-1] % 8
    bits = np.concatenate([bits, np.zeros((*lead, pad), np.uint32)], axis=-1)
    bits = bits.reshape(*lead, bits.shape[-1] // 8, 8)
    return (bits << np.arange(8, dtype=np.uint32)).sum(axis=-1).astype(np.uint8)


def unpack_codes_np(stream: np.ndarray, counts: list[int], widths: list[int]) -> list[np.ndarray]:
    """NumPy twin of :func:`unpack_codes`."""
    stream = np.asarray(stream)
    lead = stream.shape[:-1]
    bits = ((stream.astype(np.uint32)[..., None] >> np.arange(8, dtype=np.uint32)) & 1)
    bits = bits.reshape(*lead, stream.shape[-1] * 8)
    out, off = [], 0
    for c, w in zip(counts, widths):
        seg = bits[..., off:off + c * w].reshape(*lead, c, w)
        out.append((seg << np.arange(w, dtype=np.uint32)).sum(axis=-1).astype(np.uint32))
        off += c * w
    return out


# ---- MLX -----------------------------------------------------------------------------------

def _angle_codes(t: PolarTables, y: mx.array) -> tuple[list[mx.array], mx.array]:
    """Rotated rows ``y [..., d]`` float32 to each level's codes and the blocks' radii."""
    x0, x1 = y[..., 0::2], y[..., 1::2]
    lower = (x1 < 0) | ((x1 == 0) & (x0 < 0))       # angle in [pi, 2 pi): fold by pi
    p, q = mx.where(lower, -x0, x0), mx.where(lower, -x1, x1)
    c1 = (q[..., None] * t.l1_bcos > p[..., None] * t.l1_bsin).astype(mx.uint32).sum(axis=-1)
    codes = [c1 + lower.astype(mx.uint32) * ((1 << t.level1_bits) // 2)]
    r = mx.sqrt(x0 * x0 + x1 * x1)
    for lv in range(2, t.levels + 1):
        a, b = r[..., 0::2], r[..., 1::2]
        bc, bs = t.up_bcos[lv - 2], t.up_bsin[lv - 2]
        codes.append((b[..., None] * bc > a[..., None] * bs).astype(mx.uint32).sum(axis=-1))
        r = mx.sqrt(a * a + b * b)
    return codes, r


def _interleave(a: mx.array, b: mx.array) -> mx.array:
    return mx.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


def _decode_rotated(t: PolarTables, codes: PolarCodes) -> mx.array:
    counts, widths = zip(*_widths(t))
    lv_codes = unpack_codes(codes.angles, list(counts), list(widths))
    r = codes.radii.astype(mx.float32)
    for lv in range(t.levels, 1, -1):
        c = lv_codes[lv - 1]
        r = _interleave(r * mx.take(t.up_ccos[lv - 2], c), r * mx.take(t.up_csin[lv - 2], c))
    c = lv_codes[0]
    return _interleave(r * mx.take(t.l1_ccos, c), r * mx.take(t.l1_csin, c))


def encode(t: PolarTables, rows: mx.array) -> PolarCodes:
    y = rows.astype(mx.float32) @ t.rotation.T
    codes, r = _angle_codes(t, y)
    return PolarCodes(pack_codes(codes, [w for _, w in _widths(t)]), r.astype(mx.float16))


def decode(t: PolarTables, codes: PolarCodes) -> mx.array:
    return _decode_rotated(t, codes) @ t.rotation


def scores(t: PolarTables, queries: mx.array, codes: PolarCodes) -> mx.array:
    """``q . k``: the query rotated once against the keys rebuilt in the rotated basis."""
    q = queries.astype(mx.float32) @ t.rotation.T
    return q @ _decode_rotated(t, codes).swapaxes(-1, -2)


# ---- NumPy twins ---------------------------------------------------------------------------

def _angle_codes_np(t: PolarTables, y: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    x0, x1 = y[..., 0::2], y[..., 1::2]
    lower = (x1 < 0) | ((x1 == 0) & (x0 < 0))
    p, q = np.where(lower, -x0, x0), np.where(lower, -x1, x1)
    c1 = (q[..., None] * t.l1_bcos > p[..., None] * t.l1_bsin).sum(axis=-1, dtype=np.uint32)
    codes = [c1 + lower.astype(np.uint32) * np.uint32((1 << t.level1_bits) // 2)]
    r = np.sqrt(x0 * x0 + x1 * x1)
    for lv in range(2, t.levels + 1):
        a, b = r[..., 0::2], r[..., 1::2]
        bc, bs = t.up_bcos[lv - 2], t.up_bsin[lv - 2]
        codes.append((b[..., None] * bc > a[..., None] * bs).sum(axis=-1, dtype=np.uint32))
        r = np.sqrt(a * a + b * b)
    return codes, r


def _interleave_np(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


def _decode_rotated_np(t: PolarTables, codes: PolarCodes) -> np.ndarray:
    counts, widths = zip(*_widths(t))
    lv_codes = unpack_codes_np(np.asarray(codes.angles), list(counts), list(widths))
    r = np.asarray(codes.radii).astype(np.float32)
    for lv in range(t.levels, 1, -1):
        c = lv_codes[lv - 1]
        r = _interleave_np(r * t.up_ccos[lv - 2][c], r * t.up_csin[lv - 2][c])
    c = lv_codes[0]
    return _interleave_np(r * t.l1_ccos[c], r * t.l1_csin[c])


def encode_np(t: PolarTables, rows: np.ndarray) -> PolarCodes:
    """NumPy twin of :func:`encode` (float32 throughout)."""
    y = np.asarray(rows, np.float32) @ t.rotation.T
    codes, r = _angle_codes_np(t, y)
    return PolarCodes(pack_codes_np(codes, [w for _, w in _widths(t)]), r.astype(np.float16))


def decode_np(t: PolarTables, codes: PolarCodes) -> np.ndarray:
    return _decode_rotated_np(t, codes) @ t.rotation


def scores_np(t: PolarTables, queries: np.ndarray, codes: PolarCodes) -> np.ndarray:
    q = np.asarray(queries, np.float32) @ t.rotation.T
    return q @ np.swapaxes(_decode_rotated_np(t, codes), -1, -2)


CODEC = register_codec(Codec(
    name="polar", tables=tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np,
    params=("bits", "level1_bits", "block", "seed"),
    error="||decode(x)|| equals the float16 block radii; every angle lies within half its "
          "level's codebook cell, so the direction error is bounded by the sum of the half cell "
          "widths along each coordinate's path (no per-block scale or zero)"))
