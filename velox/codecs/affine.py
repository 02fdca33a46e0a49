"""The per-token affine codec: min/max codes in groups along the channels of each row.

Each token's row of ``d`` channels splits into groups of ``group_size``; a group stores
``bits``-bit codes (packed in MLX's layout, ``velox.quant.pack``) and its scale and zero in
``velox.quant.side_dtype`` of the rows (float16; bfloat16 rows keep bfloat16). Rows are
independent, so dropping a token never touches another's codes (what an eviction policy
composed with it needs, ``velox.compose``).

Error: ``|x - decode(encode(x))| <= scale / 2`` per element, plus the rounding of the stored
scale and zero (``velox.quant.error_bound``).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, UInt
from . import Codec, register_codec

__all__ = ["AffineTables", "AffineCodes", "tables", "encode", "decode", "scores", "encode_np",
           "decode_np", "scores_np", "CODEC"]


class AffineTables(NamedTuple):
    """No arrays: the bit width, the group size and the side data's dtype name."""

    bits: int
    group_size: int
    side: str = "float16"


class AffineCodes(NamedTuple):
    """Packed codes and each group's scale and zero, per token."""

    codes: UInt[Array, "b h n w"]
    scales: Float[Array, "b h n g"]
    zeros: Float[Array, "b h n g"]


def tables(head_dim: int, params: dict) -> AffineTables:
    """``params``: ``bits``, ``group_size`` and optionally ``dtype`` (the rows' dtype name; the
    side data's dtype follows it, ``velox.quant.side_dtype``)."""
    bits, group = int(params["bits"]), int(params["group_size"])
    if head_dim % group:
        raise ValueError(f"head_dim={head_dim} is not a multiple of group_size={group}")
    side = quant.side_dtype(quant.dtype_of(params.get("dtype", "float32")))
    return AffineTables(bits, group, quant.dtype_name(side))


def encode(t: AffineTables, rows: mx.array) -> AffineCodes:
    return AffineCodes(*quant.quantize(rows, t.bits, t.group_size))


def decode(t: AffineTables, codes: AffineCodes) -> mx.array:
    return quant.dequantize_f32(codes.codes, codes.scales, codes.zeros, t.bits, t.group_size)


def scores(t: AffineTables, queries: mx.array, codes: AffineCodes) -> mx.array:
    """``q . k`` over the decoded rows (the codes are exact up to the quantization error)."""
    return queries.astype(mx.float32) @ decode(t, codes).swapaxes(-1, -2)


def encode_np(t: AffineTables, rows: np.ndarray) -> AffineCodes:
    """NumPy twin of :func:`encode` (``velox.reference.quantize``, float32 arithmetic, side data
    rounded to the tables' side dtype)."""
    side = quant.dtype_of(t.side)
    c, s, z = ref.quantize(np.asarray(rows, np.float32), t.bits, t.group_size, side)
    return AffineCodes(c, s, z)


def decode_np(t: AffineTables, codes: AffineCodes) -> np.ndarray:
    return ref.dequantize(np.asarray(codes.codes), np.asarray(codes.scales, np.float32),
                          np.asarray(codes.zeros, np.float32), t.bits, t.group_size)


def scores_np(t: AffineTables, queries: np.ndarray, codes: AffineCodes) -> np.ndarray:
    return np.asarray(queries, np.float64) @ decode_np(t, codes).astype(np.float64).swapaxes(-1, -2)


CODEC = register_codec(Codec(
    name="affine", tables=tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np,
    params=("bits", "group_size"),
    error="|x - decode(encode(x))| <= scale / 2 per element, plus the stored scale's and "
          "zero's rounding (velox.quant.error_bound)"))
