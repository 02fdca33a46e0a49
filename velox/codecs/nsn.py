"""NSNQuant's codec: Normalize-Shift-Normalize, a Hadamard rotation and one universal codebook
of sub-vectors built from synthetic Gaussian samples (Son, Choi, Yoo, "NSNQuant: A Double
Normalization Approach for Calibration-Free Low-Bit Vector Quantization of KV Cache", arXiv
2505.18231), in MLX with NumPy twins (suffix ``_np``).

A chunk of ``R`` rows ``x [..., R, d]`` (one batch row and kv head) is coded as one unit
(:func:`encode_chunks`); side data is rounded to its stored dtype ``side`` before it is used,
so decoding inverts the transform up to float32 arithmetic:

1. Normalize: ``s1 = ||x_t|| / sqrt(d)`` a row, ``x1 = x / s1`` (norm ``sqrt(d)``; a row of
   ``s1 = 0`` or a non-finite ``s1`` gives ``x1 = 0``).
2. Shift: ``o = mean_t x1`` over the chunk's rows of finite ``s1`` (one ``[d]`` a chunk),
   ``x2 = x1 - o``.
3. Normalize: ``s2 = ||x2_t|| / sqrt(d)``, ``x3 = x2 / s2`` (norm ``sqrt(d)``).
4. Rotate: ``y = H x3``, ``H`` the normalized Hadamard matrix (:func:`rotation`): each
   coordinate of ``y`` is then close to a standard normal one.
5. Quantize: ``y`` cut into ``J = d / s`` sub-vectors of ``s`` coordinates; ``bits=1``: the
   index of the nearest centroid of the signed codebook (:func:`codebook`); ``bits=2``: the
   sign mask of the sub-vector (bit ``i`` set where ``y_i < 0``) and the index of the nearest
   centroid of ``|y_j|`` in the magnitude codebook (the positive orthant). A sub-vector's code
   is ``index | mask << log2(K)``, packed ``log2(K)`` (+ ``s``) bits a sub-vector
   (:func:`velox.codecs.pq.pack`).

Decoding: ``x_hat = s1 * (s2 * H^T c + o)``, ``c`` the centroids side by side (with their
signs at ``bits=2``). Every centroid has norm ``sqrt(s)``, so ``||c|| = sqrt(d)`` for every
token: the seed's renormalization of the looked-up token to ``sqrt(d)``, folded into the
codebook.

The codebook (:func:`codebook`): seeded spherical k-means (:func:`velox.codecs.pq.kmeans`) of
``SAMPLES_PER_CENTROID * K`` standard normal ``s``-vectors (their absolute values for the
magnitude codebook), each scaled to unit norm; centroids unit-norm, then scaled by
``sqrt(s)``. No model data: one codebook for every model, layer and head. Deterministic per
``(K, s, seed, magnitude)`` and cached.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..consts import cached_const
from . import pq
from .rotation import matmul_per_slice
from .vecinfer import rotation as _hadamard

__all__ = ["SAMPLES_PER_CENTROID", "ITERS", "NSNCodes", "codebook", "rotation", "tables",
           "code_bits", "nsn", "nsn_np", "denormalize", "denormalize_np", "encode_chunks",
           "encode_chunks_np", "decode_rotated", "decode_rotated_np", "decode_chunks",
           "decode_chunks_np"]

#: Synthetic samples a centroid (the codebook is fitted on ``SAMPLES_PER_CENTROID * K``).
SAMPLES_PER_CENTROID = 128
#: Lloyd rounds of the codebook's spherical k-means.
ITERS = 25


class NSNCodes(NamedTuple):
    """Coded chunks: per-token packed codes and scales, one channel mean a chunk."""

    codes: mx.array   # uint32 [b, h, n, w]: J codes of log2(K) (+ s) bits a token
    scales: mx.array  # side dtype [b, h, n, 2]: s1, s2
    means: mx.array   # side dtype [b, h, n / R, d]: o of each chunk


@lru_cache(maxsize=8)
def _codebook(size: int, sub_dim: int, seed: int, magnitude: bool) -> np.ndarray:
    rng = np.random.default_rng([seed, int(magnitude)])
    x = rng.standard_normal((SAMPLES_PER_CENTROID * size, sub_dim))
    if magnitude:
        x = np.abs(x)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    unit = np.array(pq.kmeans(x, size, iters=ITERS, seed=seed, spherical=True))
    out = (unit * np.float32(math.sqrt(sub_dim))).astype(np.float32)
    out.setflags(write=False)
    return out


def codebook(size: int, sub_dim: int, seed: int, magnitude: bool) -> np.ndarray:
    """The universal codebook ``[size, sub_dim]`` float32, centroids of norm ``sqrt(sub_dim)``:
    signed (``bits=1``) or in the positive orthant (``magnitude``, ``bits=2``). Read-only."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"codebook_size={size} must be a power of two")
    return _codebook(int(size), int(sub_dim), int(seed), bool(magnitude))


def rotation(d: int) -> np.ndarray:
    """``[d, d]`` float32: the normalized Sylvester Hadamard matrix (symmetric, orthogonal) for
    a power-of-two ``d``, else VecInfer's fixed Haar rotation (:func:`velox.codecs.vecinfer.rotation`)."""
    return _hadamard(d)


def tables(size: int, sub_dim: int, seed: int, bits: int, d: int) -> tuple[mx.array, mx.array]:
    """``(codebook, rotation)`` as shared MLX constants (one copy a process)."""
    magnitude = bits == 2
    cb = cached_const(("nsn-codebook", size, sub_dim, seed, magnitude),
                      lambda: codebook(size, sub_dim, seed, magnitude))
    rot = cached_const(("nsn-rotation", d), lambda: rotation(d))
    return cb, rot


def code_bits(size: int, sub_dim: int, bits: int) -> int:
    """Bits of one sub-vector's code: ``log2(size)``, plus the ``sub_dim`` sign bits at 2 bits."""
    return int(size).bit_length() - 1 + (sub_dim if bits == 2 else 0)


# --- the NSN transform ----------------------------------------------------------------------

def nsn(x: mx.array, side: mx.Dtype) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """``(x3, s1, o, s2)`` of chunks ``x [..., R, d]``: ``x3`` float32 ``[..., R, d]`` (norm
    ``sqrt(d)`` a row), ``s1``, ``s2`` ``[..., R, 1]`` and ``o`` ``[..., 1, d]`` in ``side``."""
    x = x.astype(mx.float32)
    root = math.sqrt(x.shape[-1])
    s1 = (mx.sqrt((x * x).sum(axis=-1, keepdims=True)) / root).astype(side)
    f1 = s1.astype(mx.float32)
    x1 = mx.where(f1 > 0, x / f1, 0.0)
    ok = mx.isfinite(f1)
    count = mx.maximum(ok.astype(mx.float32).sum(axis=-2, keepdims=True), 1.0)
    o = (mx.where(ok, x1, 0.0).sum(axis=-2, keepdims=True) / count).astype(side)
    x2 = x1 - o.astype(mx.float32)
    s2 = (mx.sqrt((x2 * x2).sum(axis=-1, keepdims=True)) / root).astype(side)
    f2 = s2.astype(mx.float32)
    return mx.where(f2 > 0, x2 / f2, 0.0), s1, o, s2


def nsn_np(x: np.ndarray, side: mx.Dtype) -> tuple[np.ndarray, ...]:
    """NumPy twin of :func:`nsn` (float32, side data rounded to ``side``)."""
    from ..reference import round_to

    x = np.asarray(x, np.float32)
    root = np.float32(math.sqrt(x.shape[-1]))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s1 = round_to(np.sqrt((x * x).sum(axis=-1, keepdims=True)) / root, side)
        x1 = np.where(s1 > 0, x / s1, np.float32(0))
        ok = np.isfinite(s1)
        count = np.maximum(ok.astype(np.float32).sum(axis=-2, keepdims=True), np.float32(1))
        o = round_to(np.where(ok, x1, np.float32(0)).sum(axis=-2, keepdims=True) / count, side)
        x2 = x1 - o
        s2 = round_to(np.sqrt((x2 * x2).sum(axis=-1, keepdims=True)) / root, side)
        x3 = np.where(s2 > 0, x2 / s2, np.float32(0))
    return x3.astype(np.float32), s1, o, s2


def denormalize(x3: mx.array, s1: mx.array, o: mx.array, s2: mx.array) -> mx.array:
    """Inverse of :func:`nsn`: ``s1 * (s2 * x3 + o)`` in float32."""
    f = lambda a: a.astype(mx.float32)  # noqa: E731
    return f(s1) * (f(s2) * f(x3) + f(o))


def denormalize_np(x3, s1, o, s2) -> np.ndarray:
    """NumPy twin of :func:`denormalize`."""
    f = lambda a: np.asarray(a, np.float32)  # noqa: E731
    with np.errstate(over="ignore", invalid="ignore"):
        return f(s1) * (f(s2) * f(x3) + f(o))


# --- codes ----------------------------------------------------------------------------------

def _codes(y, cb, bits: int, xp, assign):
    """Unpacked codes ``uint32 [..., J]`` of rotated rows ``y [b, h, n, d]``."""
    s = cb.shape[-1]
    sub = pq.split(y, s)
    if bits == 1:
        return assign(sub, cb)
    idx = assign(xp.abs(sub), cb)
    weights = (xp.ones((s,), dtype=xp.uint32) << xp.arange(s, dtype=xp.uint32))
    mask = ((sub < 0).astype(xp.uint32) * weights).sum(axis=-1).astype(xp.uint32)
    return idx | (mask << (cb.shape[0].bit_length() - 1))


def _centroids(code, cb, bits: int, xp, decode):
    """Rotated rows ``[b, h, n, d]`` float32 of unpacked codes ``[b, h, n, J]``."""
    k, s = cb.shape
    lk = k.bit_length() - 1
    c = decode(cb, code & xp.array(k - 1, dtype=xp.uint32))
    if bits == 1:
        return c
    b, h, n, j = code.shape
    shifts = xp.arange(s, dtype=xp.uint32)
    neg = ((code >> lk)[..., None] >> shifts) & xp.array(1, dtype=xp.uint32)  # [b, h, n, J, s]
    sign = 1.0 - 2.0 * neg.astype(xp.float32)
    return (c.reshape(b, h, n, j, s) * sign).reshape(b, h, n, j * s)


def encode_chunks(x: mx.array, chunk: int, cb: mx.array, rot: mx.array, bits: int,
                  side: mx.Dtype) -> NSNCodes:
    """Codes of rows ``x [b, h, f * chunk, d]``, ``f`` whole chunks of ``chunk`` rows."""
    b, h, n, d = x.shape
    x3, s1, o, s2 = nsn(x.reshape(b, h, n // chunk, chunk, d), side)
    y = matmul_per_slice(x3, rot.T).reshape(b, h, n, d)  # a product a chunk, as decoded
    code = _codes(y, cb, bits, mx, pq.assign)
    width = code_bits(cb.shape[0], cb.shape[1], bits)
    scales = mx.concatenate([s1, s2], axis=-1).reshape(b, h, n, 2)
    return NSNCodes(pq.pack(code, width), scales, o.reshape(b, h, n // chunk, d))


def encode_chunks_np(x: np.ndarray, chunk: int, cb: np.ndarray, rot: np.ndarray, bits: int,
                     side: mx.Dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of :func:`encode_chunks`: ``(codes, scales, means)`` as float32 / uint32
    NumPy arrays (scales and means hold values of ``side``)."""
    x = np.asarray(x, np.float32)
    b, h, n, d = x.shape
    x3, s1, o, s2 = nsn_np(x.reshape(b, h, n // chunk, chunk, d), side)
    y = x3.reshape(b, h, n, d) @ np.asarray(rot, np.float32).T
    cb = np.asarray(cb, np.float32)
    code = _codes(y, cb, bits, np, pq.assign_np)
    width = code_bits(cb.shape[0], cb.shape[1], bits)
    scales = np.concatenate([s1, s2], axis=-1).reshape(b, h, n, 2)
    return pq.pack_np(code, width), scales, o.reshape(b, h, n // chunk, d)


def decode_rotated(codes: mx.array, cb: mx.array, bits: int, d: int) -> mx.array:
    """The rotated NSN rows ``c`` ``[b, h, n, d]`` float32 of packed codes (``H x3``'s code)."""
    width = code_bits(cb.shape[0], cb.shape[1], bits)
    return _centroids(pq.unpack(codes, width, d // cb.shape[1]), cb, bits, mx, pq.decode)


def decode_rotated_np(codes: np.ndarray, cb: np.ndarray, bits: int, d: int) -> np.ndarray:
    """NumPy twin of :func:`decode_rotated`."""
    cb = np.asarray(cb, np.float32)
    width = code_bits(cb.shape[0], cb.shape[1], bits)
    return _centroids(pq.unpack_np(codes, width, d // cb.shape[1]), cb, bits, np, pq.decode_np)


def decode_chunks(c: NSNCodes, cb: mx.array, rot: mx.array, bits: int) -> mx.array:
    """Rows ``[b, h, n, d]`` float32 of coded chunks: ``s1 * (s2 * H^T c + o)``."""
    b, h, n, _ = c.scales.shape
    f, d = c.means.shape[2], c.means.shape[3]
    if n == 0:
        return mx.zeros((b, h, 0, d), mx.float32)
    r = n // f
    # a product a chunk: a chunk decodes to the same rows however many chunks follow it
    x3 = matmul_per_slice(decode_rotated(c.codes, cb, bits, d).reshape(b, h, f, r, d), rot)
    out = denormalize(x3, c.scales[..., :1].reshape(b, h, f, r, 1),
                      c.means[:, :, :, None], c.scales[..., 1:].reshape(b, h, f, r, 1))
    return out.reshape(b, h, n, d)


def decode_chunks_np(codes: np.ndarray, scales: np.ndarray, means: np.ndarray, cb: np.ndarray,
                     rot: np.ndarray, bits: int) -> np.ndarray:
    """NumPy twin of :func:`decode_chunks`."""
    scales = np.asarray(scales, np.float32)
    means = np.asarray(means, np.float32)
    b, h, n, _ = scales.shape
    f, d = means.shape[2], means.shape[3]
    if n == 0:
        return np.zeros((b, h, 0, d), np.float32)
    r = n // f
    x3 = decode_rotated_np(codes, cb, bits, d).reshape(b, h, f, r, d) @ np.asarray(rot, np.float32)
    out = denormalize_np(x3, scales[..., :1].reshape(b, h, f, r, 1),
                         means[:, :, :, None], scales[..., 1:].reshape(b, h, f, r, 1))
    return out.reshape(b, h, n, d)
