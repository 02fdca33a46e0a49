"""QJL: keys as 1-bit signs of a Gaussian sketch plus their norm.

A key ``k`` is held as ``sign(S k)`` (``m`` bits) and ``||k||``, with ``S [m, d]`` i.i.d.
``N(0, 1)``. The query is projected but not quantized; the asymmetric estimate

    <q, k> ~= sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>

is unbiased with variance ``((pi/2) ||q||^2 ||k||^2 - <q, k>^2) / m <= (pi/2) ||q||^2 ||k||^2 / m``.

* Signs: bit ``j`` of a token is 1 when ``(S k)_j > 0`` (a zero projection counts as -1; it
  happens with probability 0 unless ``k = 0``, whose norm 0 makes every estimate 0). Bits are
  packed 32 to a uint32 word along the last axis, coordinate ``j`` in bit ``j % 32`` of word
  ``j // 32``. When ``m`` is not a multiple of 32 the words are padded with zero bits and the
  sketch with zero rows, so padding adds nothing to scores or decodes; a token holds
  ``4 * ceil(m / 32)`` bytes of signs (``m / 8`` when 32 divides ``m``) plus a float16 norm.
* Decode is the estimator's implied reconstruction ``sqrt(pi/2) / m * ||k|| * S^T sign(S k)``:
  an unbiased estimate of ``k`` over the sketch, not an exact decode.
* Scores project the query once (``S q``) and take the signed sum over the packed bits one bit
  plane at a time (32 planes), never unpacking a float row per key.
* Any ``head_dim``; ``jl_dim`` (``m``) 0 means ``m = head_dim``.

References:
    Zandieh, Daliri, Han. "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero
    Overhead", arXiv 2406.03482 (AAAI 2025).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .._typing import Array, Float, UInt
from ..quant import pack, unpack
from . import Codec, register_codec
from .rotation import matmul_per_slice

__all__ = ["QJLTables", "QJLCodes", "tables", "encode", "decode", "scores", "encode_np",
           "decode_np", "scores_np", "sketch_dim", "sketch_tables", "CODEC"]

WORD = 32


class QJLTables(NamedTuple):
    """``sketch [ceil(m/32)*32, d]``: ``S`` (rows ``m`` on are zero padding); ``jl_dim``: ``m``."""

    sketch: Float[Array, "p d"]
    jl_dim: int


class QJLCodes(NamedTuple):
    """``signs``: packed sign bits of ``S k``; ``norms``: ``||k||`` in float16."""

    signs: UInt[Array, "b h n w"]
    norms: Float[Array, "b h n"]


def sketch_dim(head_dim: int, jl_dim: int) -> int:
    """``m``: ``jl_dim``, or ``head_dim`` for 0."""
    if head_dim < 1:
        raise ValueError(f"head_dim={head_dim} must be >= 1")
    if jl_dim < 0:
        raise ValueError(f"jl_dim={jl_dim} must be >= 0 (0 means head_dim)")
    return jl_dim or head_dim


def sketch_tables(head_dim: int, jl_dim: int, seed: int) -> QJLTables:
    """The sketch of ``m = sketch_dim(head_dim, jl_dim)`` rows drawn from ``seed``, zero-padded
    to a multiple of 32 rows."""
    m = sketch_dim(head_dim, jl_dim)
    s = np.random.default_rng(seed).standard_normal((m, head_dim)).astype(np.float32)
    pad = -m % WORD
    s = np.concatenate([s, np.zeros((pad, head_dim), np.float32)])
    return QJLTables(mx.array(s), m)


def tables(head_dim: int, params: dict) -> QJLTables:
    """Params ``jl_dim`` (``m``; 0 means ``head_dim``) and ``seed``."""
    return sketch_tables(head_dim, int(params.get("jl_dim", 0)), int(params.get("seed", 42)))


def _scale(t) -> float:
    return math.sqrt(math.pi / 2) / t.jl_dim


def encode(t: QJLTables, rows: Float[Array, "b h n d"]) -> QJLCodes:
    x = rows.astype(mx.float32)
    # one product per (batch row, head): a sign does not depend on what is stacked with the row
    bits = (matmul_per_slice(x, t.sketch.T) > 0).astype(mx.uint32)
    norms = mx.sqrt((x * x).sum(axis=-1))
    return QJLCodes(pack(bits, 1), norms.astype(mx.float16))


def decode(t: QJLTables, codes: QJLCodes) -> Float[Array, "b h n d"]:
    signs = 2 * unpack(codes.signs, 1).astype(mx.float32) - 1
    return (signs @ t.sketch) * (_scale(t) * codes.norms.astype(mx.float32))[..., None]


def scores(t: QJLTables, queries: Float[Array, "b h m d"], codes: QJLCodes) -> Float[Array, "b h m n"]:
    sq = matmul_per_slice(queries.astype(mx.float32), t.sketch.T)  # as in encode
    planes = sq.reshape(*sq.shape[:-1], -1, WORD)
    words = codes.signs
    ones = None
    for j in range(WORD):
        bit = ((words >> j) & 1).astype(mx.float32)
        part = planes[..., j] @ bit.swapaxes(-1, -2)
        ones = part if ones is None else ones + part
    signed = 2 * ones - sq.sum(axis=-1, keepdims=True)
    return signed * (_scale(t) * codes.norms.astype(mx.float32))[:, :, None, :]


def _unpack_np(words: np.ndarray) -> np.ndarray:
    bits = (words[..., None] >> np.arange(WORD, dtype=np.uint32)) & 1
    return bits.reshape(*words.shape[:-1], words.shape[-1] * WORD)


def encode_np(t: QJLTables, rows: np.ndarray) -> QJLCodes:
    x = np.asarray(rows, np.float32)
    bits = (x @ t.sketch.T > 0).astype(np.uint32)
    words = (bits.reshape(*bits.shape[:-1], -1, WORD) << np.arange(WORD, dtype=np.uint32)).sum(
        axis=-1, dtype=np.uint32)
    norms = np.sqrt((x * x).sum(axis=-1))
    return QJLCodes(words, norms.astype(np.float16))


def decode_np(t: QJLTables, codes: QJLCodes) -> np.ndarray:
    signs = 2 * _unpack_np(codes.signs).astype(np.float32) - 1
    return (signs @ t.sketch) * (np.float32(_scale(t)) * codes.norms.astype(np.float32))[..., None]


def scores_np(t: QJLTables, queries: np.ndarray, codes: QJLCodes) -> np.ndarray:
    m = t.jl_dim
    sq = np.asarray(queries, np.float32) @ t.sketch[:m].T
    signs = 2 * _unpack_np(codes.signs)[..., :m].astype(np.float32) - 1
    scale = np.float32(_scale(t)) * codes.norms.astype(np.float32)
    return (sq @ signs.swapaxes(-1, -2)) * scale[:, :, None, :]


CODEC = register_codec(Codec(
    name="qjl", tables=tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np,
    params=("jl_dim", "seed"),
    error="unbiased over the sketch: E[est] = <q, k>, Var = ((pi/2)||q||^2||k||^2 - <q, k>^2)/m "
          "<= (pi/2)||q||^2||k||^2/m, decreasing in m (decode is likewise an unbiased estimate of k)"))
