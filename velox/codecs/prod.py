"""TurboQuant_prod: the TurboQuant MSE codec at ``bits - 1`` bits plus a QJL sketch of its
residual, an unbiased inner-product codec at ``bits`` bits per coordinate.

Params ``bits`` (total ``b >= 2``, default 2), ``jl_dim`` (``m``; 0 means ``head_dim`` when
``b <= 2``, else ``min(head_dim, 64)``) and ``seed`` (default 42).

* Stage 1: ``turboquant_mse`` at ``b - 1`` bits with ``seed`` (rotation and Gaussian Lloyd-Max
  codebook, :mod:`velox.codecs.turboquant`): ``x_mse = decode_mse(encode_mse(k))`` (from the
  stored float16 norm, exactly what decode reads).
* Stage 2: ``qjl`` of the residual ``r = k - x_mse`` with the sketch of ``seed + 1``
  (:mod:`velox.codecs.qjl`): ``sign(S r)`` packed 32 to a word and ``||r||`` in float16.
* Scores: ``<q, x_mse> + sqrt(pi/2) / m * ||r|| * <S q, sign(S r)>`` (the query rotated once and
  projected once). Given the rotation the second term is an unbiased estimate of ``<q, r>``, so
  the score is unbiased for ``<q, k>`` with variance
  ``((pi/2) ||q||^2 ||r||^2 - <q, r>^2) / m <= (pi/2) ||q||^2 ||r||^2 / m``.
* Decode: ``x_mse + sqrt(pi/2) / m * ||r|| * S^T sign(S r)``, an unbiased estimate of ``k``
  (not an exact decode); scores are ``q . decode``.
* Bytes per key: the MSE indices ``padded * (b - 1) / 8`` (``padded`` is ``head_dim`` rounded up
  to what :func:`velox.quant.pack` packs, :func:`velox.codecs.turboquant.padded_dim`), its float16
  norm (2), the signs ``4 * ceil(m / 32)`` and the float16 residual norm (2): for ``head_dim``
  and ``m`` multiples of 32, ``d (b - 1) / 8 + m / 8 + 4``.

References:
    Zandieh, Daliri, Hadian, Mirrokni. "TurboQuant: Online Vector Quantization with Near-optimal
    Distortion Rate", arXiv 2504.19874.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .._typing import Array, Float, UInt
from . import Codec, numpy_tables, register_codec
from . import qjl
from . import turboquant as tq

__all__ = ["TurboQuantProdTables", "TurboQuantProdCodes", "default_jl_dim", "prod_tables",
           "tables", "encode", "decode", "scores", "encode_np", "decode_np", "scores_np", "CODEC"]

DEFAULT_BITS = 2
DEFAULT_SEED = 42


class TurboQuantProdTables(NamedTuple):
    """The MSE stage's tables (at ``bits - 1``) and the residual's sketch, side by side."""

    rotation: Float[Array, "d d"]
    centroids: Float[Array, "c"]
    boundaries: Float[Array, "c1"]
    sketch: Float[Array, "p d"]
    bits: int       # total b: the MSE stage uses b - 1
    head_dim: int
    padded: int     # MSE indices per row after zero padding
    jl_dim: int     # m


class TurboQuantProdCodes(NamedTuple):
    idx: UInt[Array, "b h n w"]        # MSE indices, (b - 1) bits each, packed
    norm: Float[Array, "b h n"]        # ||k||, float16
    signs: UInt[Array, "b h n s"]      # sign bits of S r, packed
    res_norm: Float[Array, "b h n"]    # ||r||, float16


def default_jl_dim(head_dim: int, bits: int) -> int:
    """``m`` for ``jl_dim = 0``: ``head_dim`` at 2 bits, ``min(head_dim, 64)`` above."""
    return head_dim if bits <= 2 else min(head_dim, 64)


def _bits(bits) -> int:
    if isinstance(bits, bool) or int(bits) != bits or not 2 <= int(bits) <= 9:
        raise ValueError(f"bits must be an integer in 2..9 (the MSE stage uses bits - 1), got {bits!r}")
    return int(bits)


def prod_tables(head_dim: int, bits: int = DEFAULT_BITS, jl_dim: int = 0,
                seed: int = DEFAULT_SEED) -> TurboQuantProdTables:
    bits = _bits(bits)
    mse = tq.mse_tables(head_dim, bits - 1, seed)
    sk = qjl.sketch_tables(head_dim, int(jl_dim) or default_jl_dim(int(head_dim), bits), seed + 1)
    return TurboQuantProdTables(mse.rotation, mse.centroids, mse.boundaries, sk.sketch, bits,
                                mse.head_dim, mse.padded, sk.jl_dim)


def tables(head_dim: int, params: dict) -> TurboQuantProdTables:
    return prod_tables(head_dim, _bits(params.get("bits", DEFAULT_BITS)), int(params.get("jl_dim", 0)),
                       int(params.get("seed", DEFAULT_SEED)))


def _mse(t: TurboQuantProdTables) -> tq.TurboQuantTables:
    return tq.TurboQuantTables(t.rotation, t.centroids, t.boundaries, t.bits - 1, t.head_dim,
                               t.padded)


def _qjl(t: TurboQuantProdTables) -> qjl.QJLTables:
    return qjl.QJLTables(t.sketch, t.jl_dim)


def encode(t: TurboQuantProdTables, rows: Float[Array, "b h n d"]) -> TurboQuantProdCodes:
    x = rows.astype(mx.float32)
    m = tq.mse_encode(_mse(t), x)
    r = qjl.encode(_qjl(t), x - tq.mse_decode(_mse(t), m))
    return TurboQuantProdCodes(m.idx, m.norm, r.signs, r.norms)


def decode(t: TurboQuantProdTables, codes: TurboQuantProdCodes) -> Float[Array, "b h n d"]:
    return (tq.mse_decode(_mse(t), tq.MseCodes(codes.idx, codes.norm))
            + qjl.decode(_qjl(t), qjl.QJLCodes(codes.signs, codes.res_norm)))


def scores(t: TurboQuantProdTables, queries: Float[Array, "b h m d"],
           codes: TurboQuantProdCodes) -> Float[Array, "b h m n"]:
    q = queries.astype(mx.float32)
    return (tq.mse_scores(_mse(t), q, tq.MseCodes(codes.idx, codes.norm))
            + qjl.scores(_qjl(t), q, qjl.QJLCodes(codes.signs, codes.res_norm)))


def encode_np(t: TurboQuantProdTables, rows: np.ndarray) -> TurboQuantProdCodes:
    t = numpy_tables(t)
    x = np.asarray(rows, np.float32)
    m = tq.mse_encode_np(_mse(t), x)
    r = qjl.encode_np(_qjl(t), x - tq.mse_decode_np(_mse(t), m))
    return TurboQuantProdCodes(m.idx, m.norm, r.signs, r.norms)


def decode_np(t: TurboQuantProdTables, codes: TurboQuantProdCodes) -> np.ndarray:
    t = numpy_tables(t)
    return (tq.mse_decode_np(_mse(t), tq.MseCodes(codes.idx, codes.norm))
            + qjl.decode_np(_qjl(t), qjl.QJLCodes(codes.signs, codes.res_norm)))


def scores_np(t: TurboQuantProdTables, queries: np.ndarray, codes: TurboQuantProdCodes) -> np.ndarray:
    t = numpy_tables(t)
    q = np.asarray(queries, np.float32)
    return (tq.mse_scores_np(_mse(t), q, tq.MseCodes(codes.idx, codes.norm))
            + qjl.scores_np(_qjl(t), q, qjl.QJLCodes(codes.signs, codes.res_norm)))


CODEC = register_codec(Codec(
    name="turboquant_prod", tables=tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np,
    params=("bits", "jl_dim", "seed"),
    error=("unbiased: E[est] = <q, k> over the residual's sketch, Var = ((pi/2)||q||^2||r||^2 - "
           "<q, r>^2)/m <= (pi/2)||q||^2||r||^2/m with r = k - x_mse the residual of the "
           "(bits - 1)-bit MSE stage (decode is likewise an unbiased estimate of k)"),
))
