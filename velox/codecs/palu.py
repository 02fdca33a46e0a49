"""Palu's latent codes: keys and values of a group of kv heads projected on a low-rank basis of
the group, the latent channels quantized per token at mixed precision (Chang et al., "Palu:
KV-Cache Compression with Low-Rank Projection", ICLR 2025, arXiv:2407.21118).

Groups: the ``h`` kv heads fall in ``G`` groups of ``g = h / G`` consecutive heads
(:func:`head_groups`: the largest divisor of ``h`` not above ``n_head_groups``); a token's rows
of a group's heads, side by side, are one row of ``e = g d`` features (:func:`to_groups`).

Projection: a row ``x`` of a group is held as its latent channels ``u = ((x - mean) @
basis.T) / sigma`` (``basis [r, e]``: orthonormal rows, by decreasing energy; ``sigma [r]``:
each channel's spread, so that every channel is quantized on its own scale) and rebuilt as
``(u sigma) @ basis + mean``. Keys may be projected before RoPE (``prerope``: the method
un-rotates each post-RoPE key by its position with the model's frequencies ``freqs`` first,
since a basis from the projection weights describes position-free keys).

Bases: from the model's weights (:func:`weight_bases`, the calibration: the SVD of each
group's key or value projection ``W [e, hidden]`` whitened by its inputs' covariance, Palu's
truncation-aware decomposition, centred; the left singular vectors are the basis, the latent
channels' standard deviations on the calibration inputs the spreads, the mean output the mean)
or from the rows of the first update (:func:`prefill_bases`, the seed's adaptation: a centred
PCA a batch row and group, on post-RoPE keys).

Latent codes (:func:`layout`, :func:`quantize`): the first ``round(hi_fraction r)`` channels
at ``hi_bit`` bits, the others at ``lo_bit`` (one segment when the two are equal); each
segment cut into groups of ``group_size`` channels (the last may be shorter), each group of a
token min/max affine codes (``velox.quant.affine_codes``: scale ``(max - min) / (2^b - 1)`` and
zero ``min`` in float16, bfloat16 for a bfloat16 cache); a token's codes one bit stream
(KVTC's, ``velox.codecs.kvtc``), ``ceil(total / 8)`` bytes. Error: ``|u - u^| <= scale / 2``
plus the side data's rounding, in the latent's units (times ``sigma`` in the row's).

Float32 arithmetic in the same order in the MLX functions and their NumPy twins.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, UInt
from . import shipped_calibration
from .kvtc import _pack, _pack_np, _unpack_np
from .svdq import energy_rank, principal_axes, unpack_codes

__all__ = ["PaluTables", "LatentCodes", "LatentRows", "Layout", "SHIPPED", "head_groups", "layout",
           "to_groups", "from_groups", "to_groups_np", "from_groups_np", "quantize", "dequantize",
           "quantize_np", "dequantize_np", "project", "rebuild", "project_np", "rebuild_np",
           "prefill_bases", "input_moments", "weight_bases", "calibrated_rank", "shipped_arrays"]

#: Calibrations shipped in ``velox.adapters/data``: name -> file.
SHIPPED = {"smollm2-135m-instruct": "palu_smollm2.npz"}
#: A channel's spread is at least this share of its group's largest: a direction the fit saw
#: (almost) no variance along keeps its latents within float16's range.
SPREAD_FLOOR = 1e-2


class PaluTables(NamedTuple):
    """The key and value bases of each (batch row, group), their means and spreads, the RoPE
    frequencies of position-free keys; the static ranks."""

    key_basis: Float[Array, "b c r e"]      # float32, rows orthonormal (or zero: dropped)
    key_mean: Float[Array, "b c e"]
    key_sigma: Float[Array, "b c r"]
    value_basis: Float[Array, "b c s e"]
    value_mean: Float[Array, "b c e"]
    value_sigma: Float[Array, "b c s"]
    freqs: Float[Array, "f"]                # [d / 2] RoPE angle a position (prerope keys)
    head_dim: int
    groups: int
    key_rank: int
    value_rank: int
    prerope: bool           # keys projected before RoPE (a basis from the weights)
    ready: bool             # bases installed; False: the placeholder of a state without them


class LatentCodes(NamedTuple):
    """A token's latent channels as one bit stream and a float16 scale and zero a group."""

    codes: UInt[Array, "b c n w"]           # uint8 [..., ceil(total / 8)]
    scales: Float[Array, "b c n m"]
    zeros: Float[Array, "b c n m"]


class LatentRows(NamedTuple):
    """Latent channels held unquantized (values with ``quantize_values`` off), in float16
    (bfloat16 for a bfloat16 cache)."""

    rows: Float[Array, "b c n r"]


class Layout(NamedTuple):
    """The static layout of ``r`` latent channels: their bits, the groups ``(start, stop,
    bits)``, the stream's bits."""

    bits: np.ndarray
    groups: tuple[tuple[int, int, int], ...]
    total: int


def head_groups(kv_heads: int, n_head_groups: int) -> int:
    """Groups of equal size: the largest divisor of ``kv_heads`` not above ``n_head_groups``."""
    return max(c for c in range(1, min(kv_heads, n_head_groups) + 1) if kv_heads % c == 0)


@functools.lru_cache(maxsize=256)
def layout(r: int, hi_fraction: float, hi_bit: int, lo_bit: int, group_size: int) -> Layout:
    """The first ``floor(hi_fraction r + 1/2)`` channels at ``hi_bit``, the rest at
    ``lo_bit`` (one segment when equal), each segment in groups of ``group_size``."""
    n_hi = min(r, max(0, int(np.floor(hi_fraction * r + 0.5))))
    segs = [(0, r, hi_bit)] if hi_bit == lo_bit else [(0, n_hi, hi_bit), (n_hi, r, lo_bit)]
    groups = tuple((a, min(a + group_size, stop), b) for start, stop, b in segs
                   for a in range(start, stop, group_size))
    bits = np.zeros(r, np.uint8)
    for a, z, b in groups:
        bits[a:z] = b
    return Layout(bits, groups, int(bits.astype(np.int64).sum()))


# ---- groups of heads ------------------------------------------------------------------------

def to_groups(x: mx.array, groups: int) -> mx.array:
    """``[b, h, n, d]`` -> ``[b, G, n, g d]``: each group's heads side by side."""
    b, h, n, d = x.shape
    g = h // groups
    return x.reshape(b, groups, g, n, d).transpose(0, 1, 3, 2, 4).reshape(b, groups, n, g * d)


def from_groups(y: mx.array, head_dim: int) -> mx.array:
    """Inverse of :func:`to_groups`."""
    b, c, n, e = y.shape
    g = e // head_dim
    return y.reshape(b, c, n, g, head_dim).transpose(0, 1, 3, 2, 4).reshape(b, c * g, n, head_dim)


def to_groups_np(x: np.ndarray, groups: int) -> np.ndarray:
    b, h, n, d = x.shape
    g = h // groups
    return x.reshape(b, groups, g, n, d).transpose(0, 1, 3, 2, 4).reshape(b, groups, n, g * d)


def from_groups_np(y: np.ndarray, head_dim: int) -> np.ndarray:
    b, c, n, e = y.shape
    g = e // head_dim
    return y.reshape(b, c, n, g, head_dim).transpose(0, 1, 3, 2, 4).reshape(b, c * g, n, head_dim)


# ---- projection -----------------------------------------------------------------------------

def project(basis: mx.array, mean: mx.array, sigma: mx.array, x: mx.array) -> mx.array:
    """Latent channels ``u [b, G, n, r]`` of grouped rows ``x [b, G, n, e]``."""
    y = (x.astype(mx.float32) - mean[..., None, :]) @ basis.swapaxes(-1, -2)
    return y / sigma[..., None, :]


def rebuild(basis: mx.array, mean: mx.array, sigma: mx.array, u: mx.array) -> mx.array:
    """Grouped rows ``[b, G, n, e]`` of latent channels ``u``."""
    return (u * sigma[..., None, :]) @ basis + mean[..., None, :]


def project_np(basis, mean, sigma, x: np.ndarray) -> np.ndarray:
    y = (np.asarray(x, np.float32) - np.asarray(mean)[..., None, :]) @ np.swapaxes(np.asarray(basis), -1, -2)
    return (y / np.asarray(sigma)[..., None, :]).astype(np.float32)


def rebuild_np(basis, mean, sigma, u: np.ndarray) -> np.ndarray:
    return ((u * np.asarray(sigma)[..., None, :]) @ np.asarray(basis) + np.asarray(mean)[..., None, :]).astype(np.float32)


# ---- latent codes ---------------------------------------------------------------------------

def quantize(u: mx.array, lay: Layout, side: mx.Dtype) -> LatentCodes:
    """Codes of latent channels ``u [..., r]`` (float32) in the layout ``lay``."""
    qs, scales, zeros = [], [], []
    for a, z, b in lay.groups:
        q, s, zero = quant.affine_codes(u[..., a:z], b, side)
        qs.append(q)
        scales.append(s)
        zeros.append(zero)
    lead = u.shape[:-1]
    if not qs:
        empty = mx.zeros((*lead, 0), side)
        return LatentCodes(mx.zeros((*lead, 0), mx.uint8), empty, empty)
    q = mx.concatenate(qs, axis=-1)
    return LatentCodes(_pack(q, mx.array(lay.bits), lay.total), mx.stack(scales, axis=-1),
                       mx.stack(zeros, axis=-1))


def dequantize(c: LatentCodes, lay: Layout) -> mx.array:
    """Latent channels ``[..., r]`` (float32) of codes ``c``: ``q scale + zero``."""
    r = len(lay.bits)
    if not lay.groups:
        return mx.zeros((*c.codes.shape[:-1], r), mx.float32)
    q = unpack_codes(c.codes, lay.bits, lay.total).astype(mx.float32)
    of = mx.array(_group_of(lay))  # each channel's group
    return q * mx.take(c.scales.astype(mx.float32), of, axis=-1) + mx.take(
        c.zeros.astype(mx.float32), of, axis=-1)


def _group_of(lay: Layout) -> np.ndarray:
    return np.repeat(np.arange(len(lay.groups)), [z - a for a, z, _ in lay.groups]).astype(np.int32)


def _affine_np(g: np.ndarray, bits: int, side: mx.Dtype):
    """NumPy twin of ``velox.quant.affine_codes`` (one group a last-axis row)."""
    levels = (1 << bits) - 1
    with np.errstate(invalid="ignore", over="ignore"):
        lo, hi = g.min(axis=-1), g.max(axis=-1)
        scales = ref.round_to(((hi - lo) / np.float32(levels)).astype(np.float32), side)
        zeros = ref.round_to(lo.astype(np.float32), side)
        s32, z32 = scales[..., None], zeros[..., None]
        safe = np.where(s32 > 0, s32, np.float32(1))
        q = np.clip(np.round((g - z32) / safe), 0, levels)
        q = np.where((s32 > 0) & ~np.isnan(q), q, 0)
    return q.astype(np.uint32), scales, zeros


def quantize_np(u: np.ndarray, lay: Layout, side: mx.Dtype) -> LatentCodes:
    """NumPy twin of :func:`quantize` (scales and zeros as float32 values of ``side``)."""
    u = np.asarray(u, np.float32)
    lead = u.shape[:-1]
    if not lay.groups:
        return LatentCodes(np.zeros((*lead, 0), np.uint8), np.zeros((*lead, 0), np.float32),
                           np.zeros((*lead, 0), np.float32))
    parts = [_affine_np(u[..., a:z], b, side) for a, z, b in lay.groups]
    q = np.concatenate([p[0] for p in parts], axis=-1)
    return LatentCodes(_pack_np(q, lay.bits, lay.total), np.stack([p[1] for p in parts], axis=-1),
                       np.stack([p[2] for p in parts], axis=-1))


def dequantize_np(c: LatentCodes, lay: Layout) -> np.ndarray:
    r = len(lay.bits)
    codes = np.asarray(c.codes)
    if not lay.groups:
        return np.zeros((*codes.shape[:-1], r), np.float32)
    q = _unpack_np(codes, lay.bits, lay.total, r).astype(np.float32)
    of = _group_of(lay)
    s = np.take(np.asarray(c.scales, np.float32), of, axis=-1)
    z = np.take(np.asarray(c.zeros, np.float32), of, axis=-1)
    return (q * s + z).astype(np.float32)


# ---- bases ----------------------------------------------------------------------------------

def prefill_bases(rows: mx.array, width: int, threshold: float, fixed: bool):
    """``(basis [..., width, e], mean [..., e], sigma [..., width])`` of grouped rows ``[...,
    n, e]``: the centred PCA of ``velox.codecs.svdq.principal_axes``, its first ``width``
    directions (spreads floored at :data:`SPREAD_FLOOR` of the largest); unless ``fixed``, the directions past each row's energy rank (the fewest
    holding ``threshold`` of the variance) zeroed, so their channels are dropped."""
    basis, mean, sigma, lam = principal_axes(rows)
    sigma = mx.maximum(sigma, SPREAD_FLOOR * sigma[..., :1])
    basis, sigma = basis[..., :width, :], sigma[..., :width]
    if not fixed:
        rank = energy_rank(lam, threshold, width)
        keep = mx.arange(width)[None] < rank[..., None]
        basis = basis * keep[..., None].astype(mx.float32)
    return basis, mean, sigma


def input_moments(inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(mean [hidden], covariance [hidden, hidden])`` of a layer's calibration inputs
    ``[tokens, hidden]`` (float64)."""
    x = np.asarray(inputs, np.float64)
    xm = x.mean(axis=0)
    xc = x - xm
    return xm, xc.T @ xc / max(len(x), 1)


def weight_bases(weight: np.ndarray, bias: np.ndarray | None, moments: tuple, kv_heads: int,
                 groups: int, whiten: bool = True):
    """One layer's bases of a projection ``weight [h d, hidden]`` (rows head by head) on its
    calibration inputs' ``moments`` (:func:`input_moments`): ``(basis [h, d, g d], spread [h,
    g d], mean [h, d])``, each head's rows of its group's basis (columns by decreasing
    energy), each latent channel's spread (its standard deviation over the inputs, repeated a
    head of the group), and the mean output ``W mean(x) + bias`` (the offset the latents are
    taken from).

    ``whiten``: the left singular vectors of ``W S`` with ``S S^T`` the inputs' covariance
    (Palu's truncation-aware decomposition, centred: a rank-r truncation keeps the most of
    the projection's output variance on those inputs), computed as the eigendecomposition of
    ``W cov(x) W^T`` in float64; else those of ``W`` itself (as if the inputs were white), the
    channels then ordered by their variance on the inputs."""
    w = np.asarray(weight, np.float64)
    xm, cov = moments
    d = w.shape[0] // kv_heads
    g = kv_heads // groups
    e = g * d
    basis = np.zeros((kv_heads, d, e), np.float32)
    spread = np.zeros((kv_heads, e), np.float32)
    for c in range(groups):  # a handful of groups, once a layer at calibration
        wg = w[c * e:(c + 1) * e]
        out = wg @ cov @ wg.T                                     # the outputs' covariance
        _, vec = np.linalg.eigh(out if whiten else wg @ wg.T)
        vec = vec[:, ::-1]
        sign = np.where(vec[np.abs(vec).argmax(axis=0), np.arange(e)] < 0, -1.0, 1.0)
        vec = vec * sign
        var = np.maximum(np.einsum("ir,ij,jr->r", vec, out, vec), 0)
        order = np.argsort(-var, kind="stable")                   # (whitened: already sorted)
        vec, var = vec[:, order], var[order]
        for j in range(g):
            basis[c * g + j] = vec[j * d:(j + 1) * d]
            spread[c * g + j] = np.sqrt(var)
    mean = w @ xm + (0 if bias is None else np.asarray(bias, np.float64))
    return basis, spread, mean.reshape(kv_heads, d).astype(np.float32)


def calibrated_rank(spread: np.ndarray, threshold: float, rank: int) -> int:
    """A layer's rank from its groups' spreads ``[G, e]``: ``rank`` when given, else the
    largest over the groups of the fewest leading channels holding ``threshold`` of the
    group's energy (the squares' sum), so every group keeps at least that share."""
    if rank:
        return int(rank)
    en = np.asarray(spread, np.float64) ** 2
    cum = np.cumsum(en, axis=-1)
    need = (cum < threshold * cum[..., -1:] * (1 - 1e-12)).sum(axis=-1) + 1
    return int(np.clip(need, 1, en.shape[-1]).max())


@functools.lru_cache(maxsize=4)
def shipped_arrays(name: str) -> tuple[dict, dict]:
    """``(arrays, info)`` of the shipped calibration ``name`` (:data:`SHIPPED`): ``key_basis``,
    ``value_basis [layers, h, d, g d]``, ``key_spread``, ``value_spread [layers, h, g d]``,
    ``key_mean``, ``value_mean [layers, h, d]``, ``freqs [layers, h, d / 2]``."""
    return shipped_calibration("Palu", SHIPPED, name)
