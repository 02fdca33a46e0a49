"""Outlier channels: a codec combinator that codes two channel sets with two instances of a codec.

TurboQuant (arXiv 2504.19874, its KV-cache experiments) reaches fractional bit widths (2.5 and
3.5 bits a channel) by splitting each key's channels into a set of outlier channels and the
rest, and running two independent instances of the quantizer, the outliers at a higher bit
width: e.g. ``head_dim`` 128 with 32 outlier channels at 3 bits and 96 at 2 bits is
``(32 * 3 + 96 * 2) / 128 = 2.25`` index bits a channel; 32 at 4 and 96 at 3 is 3.25 (the
norms bring each to about 2.5 and 3.5).

:func:`of` turns a codec (``turboquant_mse``, ``turboquant_prod``, ``turboquant_rvq``) into its
split codec ``"<name>_split"``, a codec like any other (:class:`velox.codecs.Codec`) over rows
whose **first** ``n_outlier`` channels are the outlier channels:

* ``tables(head_dim, params)``: :class:`SplitTables`, the codec's tables of dimension
  ``n_outlier`` (the outlier part) and of dimension ``head_dim - n_outlier`` (the inlier part),
  each its own rotation of its own dimension (neither need be a power of two: a dimension that
  is not one gets the Haar QR rotation, :mod:`velox.codecs.rotation`). Params: the codec's own,
  plus ``n_outlier`` (``1 <= n_outlier < head_dim``) and ``outlier_bits`` (0: the same as
  ``bits``). The inlier part is the codec at ``params`` (``bits``, ``seed``); the outlier part
  is the codec at ``bits = outlier_bits`` and ``seed + OUTLIER_SEED_OFFSET`` (``seed + 2``:
  ``turboquant_prod`` draws its rotation from its seed and its residual's sketch from the seed
  plus one, so the four draws ``seed``, ``seed + 1``, ``seed + 2``, ``seed + 3`` are distinct).
  ``jl_dim`` (``turboquant_prod``) applies to each part: 0 is each part's own default
  (:func:`velox.codecs.prod.default_jl_dim` of its dimension and bits).
* ``encode``: the codec's codes of ``rows[..., :n_outlier]`` and of ``rows[..., n_outlier:]``,
  in one flat record (:func:`codes_type`: the fields ``outlier_<field>`` then
  ``inlier_<field>``, every one with leading ``[b, h, n]`` axes, so that
  :func:`velox.codecs.append` and :func:`velox.codecs.take` work on it). Each part has its own
  norm (and residual norm, gain).
* ``decode``: the two parts' decodes side by side (outlier channels first).
* ``scores``: the sum of the two parts' scores, the query split the same way (each part rotates
  its share of the query once). A part's error statement holds part by part: for
  ``turboquant_prod`` each part's estimate is unbiased for its share of ``q . k`` (its own
  rotation and sketch), so their sum is unbiased for ``q . k``, with variance the sum of the two
  parts' variances (independent sketches), each ``<= (pi/2) ||q_part||^2 ||r_part||^2 / m_part``.
* Bytes per row: the two parts' bytes (each padded to its own pack granularity).

Which channels are the outliers is the cache's business, per (batch row, kv head), not the
codec's: :func:`channel_order` (NumPy twin :func:`channel_order_np`) picks the ``n_outlier``
channels of largest mean squared magnitude over the given keys (ties: the lower channel index
first; a channel whose energy is not finite, NaN included, counts as +inf) and returns the
permutation ``[b, h, d]`` that puts them first (each set in ascending channel order);
:func:`gather` applies it to rows or queries and :func:`scatter` undoes it.
``velox.codec_cache`` chooses the channels on the first update that holds tokens and keeps them.

The mean squared magnitude is taken as the float32 sum of squares over the tokens (the same
ranking); the MLX and NumPy sums may round differently, so two channels whose energies agree to
float32 rounding can rank either way on the two backends.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from . import Codec, get_codec, numpy_tables, register_codec

__all__ = ["SplitTables", "OUTLIER_SEED_OFFSET", "DEFAULT_SEED", "of", "codes_type", "parts",
           "channel_order", "channel_order_np", "gather", "gather_np", "scatter", "scatter_np",
           "SPLIT_CODECS", "SPLIT_MSE", "SPLIT_PROD", "SPLIT_RVQ"]

#: The outlier part's seed is the inlier part's plus this (see the module doc).
OUTLIER_SEED_OFFSET = 2
#: The seed of the codecs split here when ``params`` gives none.
DEFAULT_SEED = 42


class SplitTables(NamedTuple):
    """The codec's tables of the outlier part (``n_outlier`` channels) and of the rest."""

    outlier: Any      # the codec's tables of dimension n_outlier
    inlier: Any       # the codec's tables of dimension head_dim - n_outlier
    n_outlier: int
    head_dim: int


@functools.lru_cache(maxsize=None)
def codes_type(base: type) -> type:
    """The flat codes record of a split over codes records of type ``base``: the fields
    ``outlier_<f>`` then ``inlier_<f>`` for each field ``f`` of ``base``."""
    fields = [(f"{part}_{f}", mx.array) for part in ("outlier", "inlier") for f in base._fields]
    record = NamedTuple(f"Split{base.__name__}", fields)
    record.base = base
    record.__doc__ = (f"Codes of the outlier channels and of the rest, each a {base.__name__} "
                      "(fields prefixed outlier_ and inlier_).")
    return record


def parts(codes) -> tuple[Any, Any]:
    """``(outlier codes, inlier codes)`` of a flat split codes record, as the codec's records."""
    base = type(codes).base
    k = len(base._fields)
    return base(*codes[:k]), base(*codes[k:])


def _join(o, i):
    return codes_type(type(o))(*o, *i)


def _n_outlier(n_outlier, head_dim: int) -> int:
    if isinstance(n_outlier, bool) or int(n_outlier) != n_outlier or not 1 <= int(n_outlier) < head_dim:
        raise ValueError(f"n_outlier must be an integer in 1..head_dim - 1 = {head_dim - 1} for a "
                         f"channel split, got {n_outlier!r}")
    return int(n_outlier)


def _tables(base: Codec, head_dim: int, params: dict) -> SplitTables:
    d = int(head_dim)
    n = _n_outlier(params.get("n_outlier", 0), d)
    inner = {k: v for k, v in params.items() if k not in ("n_outlier", "outlier_bits")}
    outer = dict(inner, seed=int(inner.get("seed", DEFAULT_SEED)) + OUTLIER_SEED_OFFSET)
    if params.get("outlier_bits", 0):
        outer["bits"] = params["outlier_bits"]
    return SplitTables(base.tables(n, outer), base.tables(d - n, inner), n, d)


def _check(t: SplitTables, shape) -> None:
    if len(shape) != 4 or shape[-1] != t.head_dim:
        raise ValueError(f"rows must be [b, h, n, {t.head_dim}], got {tuple(shape)}")


def _make(base: Codec) -> Codec:
    def encode(t: SplitTables, rows: mx.array):
        _check(t, rows.shape)
        n = t.n_outlier
        return _join(base.encode(t.outlier, rows[..., :n]), base.encode(t.inlier, rows[..., n:]))

    def decode(t: SplitTables, codes) -> mx.array:
        o, i = parts(codes)
        return mx.concatenate([base.decode(t.outlier, o), base.decode(t.inlier, i)], axis=-1)

    def scores(t: SplitTables, q: mx.array, codes) -> mx.array:
        o, i = parts(codes)
        n = t.n_outlier
        return base.scores(t.outlier, q[..., :n], o) + base.scores(t.inlier, q[..., n:], i)

    def encode_np(t: SplitTables, rows: np.ndarray):
        _check(t, rows.shape)
        n, x = t.n_outlier, np.asarray(rows, np.float32)
        return _join(base.encode_np(numpy_tables(t.outlier), x[..., :n]),
                     base.encode_np(numpy_tables(t.inlier), x[..., n:]))

    def decode_np(t: SplitTables, codes) -> np.ndarray:
        o, i = parts(codes)
        return np.concatenate([base.decode_np(numpy_tables(t.outlier), o),
                               base.decode_np(numpy_tables(t.inlier), i)], axis=-1)

    def scores_np(t: SplitTables, q: np.ndarray, codes) -> np.ndarray:
        o, i = parts(codes)
        n, q = t.n_outlier, np.asarray(q, np.float32)
        return (base.scores_np(numpy_tables(t.outlier), q[..., :n], o)
                + base.scores_np(numpy_tables(t.inlier), q[..., n:], i))

    return Codec(
        name=f"{base.name}_split", tables=functools.partial(_tables, base), encode=encode,
        decode=decode, scores=scores, encode_np=encode_np, decode_np=decode_np,
        scores_np=scores_np, params=(*base.params, "n_outlier", "outlier_bits"),
        error=(f"part by part (the first n_outlier channels at outlier_bits, the rest at bits, "
               f"each its own instance): {base.error}; scores are the sum of the two parts'"),
    )


SPLIT_CODECS: dict[str, Codec] = {}


def of(base: Codec | str) -> Codec:
    """The split codec of ``base`` (a codec or its name): registered as ``"<name>_split"``."""
    base = get_codec(base) if isinstance(base, str) else base
    if base.name not in SPLIT_CODECS:
        SPLIT_CODECS[base.name] = register_codec(_make(base))
    return SPLIT_CODECS[base.name]


# --- which channels are the outliers ----------------------------------------------------------

def _order_from_energy(e, n_outlier: int, xp):
    """The permutation ``[b, h, d]`` putting the ``n_outlier`` channels of largest ``e``
    first (ties: lower index first), each set in ascending channel order."""
    d = e.shape[-1]
    idx = xp.arange(d)
    ej, ec = e[..., None, :], e[..., :, None]          # [.., c, j]: channel j against channel c
    before = (ej > ec) | ((ej == ec) & (idx[None, :] < idx[:, None]))
    rank = before.astype(xp.int32).sum(axis=-1)        # a permutation of 0..d-1 per row
    out = rank < n_outlier
    o = out.astype(xp.int32)
    pos = xp.where(out, xp.cumsum(o, axis=-1) - 1, n_outlier + xp.cumsum(1 - o, axis=-1) - 1)
    return xp.argsort(pos, axis=-1).astype(xp.int32)


def _energy_mx(keys: mx.array) -> mx.array:
    x = keys.astype(mx.float32)
    e = mx.sum(x * x, axis=2)
    return mx.where(mx.isnan(e), mx.array(mx.inf, mx.float32), e)


def channel_order(keys: mx.array, n_outlier: int) -> mx.array:
    """``[b, h, d]`` int32: per (batch row, kv head), the ``n_outlier`` channels of largest mean
    squared magnitude over ``keys [b, h, n, d]`` (ascending channel order), then the others
    (ascending); ties go to the lower channel index."""
    return _order_from_energy(_energy_mx(keys), int(n_outlier), mx)


def channel_order_np(keys: np.ndarray, n_outlier: int) -> np.ndarray:
    """NumPy twin of :func:`channel_order`."""
    x = np.asarray(keys, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.sum(x * x, axis=2, dtype=np.float32)
    e = np.where(np.isnan(e), np.float32(np.inf), e)
    return _order_from_energy(e, int(n_outlier), np)


def gather(x: mx.array, order: mx.array) -> mx.array:
    """``x [b, h, n, d]`` with its channels in ``order [b, h, d]``: ``out[..., p] = x[..., order[p]]``."""
    return mx.take_along_axis(x, order[:, :, None, :], axis=-1)


def scatter(x: mx.array, order: mx.array) -> mx.array:
    """The inverse of :func:`gather`: channels back to their places."""
    return mx.take_along_axis(x, mx.argsort(order, axis=-1)[:, :, None, :], axis=-1)


def gather_np(x: np.ndarray, order: np.ndarray) -> np.ndarray:
    return np.take_along_axis(np.asarray(x), np.asarray(order)[:, :, None, :], axis=-1)


def scatter_np(x: np.ndarray, order: np.ndarray) -> np.ndarray:
    return np.take_along_axis(np.asarray(x), np.argsort(np.asarray(order), axis=-1)[:, :, None, :],
                              axis=-1)


SPLIT_MSE = of("turboquant_mse")
SPLIT_PROD = of("turboquant_prod")
SPLIT_RVQ = of("turboquant_rvq")
