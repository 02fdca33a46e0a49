"""A²ATS's key codec: query-aware product quantization of position-free (pre-RoPE) keys, and
the rotary position embedding it is decoupled from (He et al., "A²ATS: Retrieval-Based KV Cache
Reduction via Windowed Rotary Position Embedding and Query-Aware Vector Quantization",
arXiv 2502.12665).

``"a2ats"`` (params ``sub_dim``, ``bits``, ``codebook``, ``seed``, ``kv_heads``, ``layer``,
``b``, ``query_aware``, ``rope_base``, ``rope_scaling``) codes rows that carry no position (the
method un-rotates each post-RoPE key by its own position first, :func:`rotate`):

* encode: the row cut into ``J = d / sub_dim`` sub-vectors, each held as the index of the
  centroid ``c`` of its sub-space's codebook (``[h, J, 2^bits, sub_dim]``, one a kv head and
  sub-space) minimising ``(x - c)^T H_j (x - c)`` (:func:`velox.codecs.pq.assign`), ``H_j`` the
  second moment ``E[q_j q_j^T]`` of the queries' sub-vectors in sub-space ``j`` (``metric [h, J,
  sub_dim, sub_dim]``), which is the expected squared error of the score ``q . x`` the centroid
  gives; ``query_aware=False`` (or no ``H``) assigns by Euclidean distance. Indices packed
  ``bits`` each (:func:`velox.codecs.pq.pack`): ``bits / sub_dim`` bits an element, no side data.
* decode: the centroids side by side.
* scores: ``q . decode(codes)`` read through the query's lookup table (asymmetric distance,
  :func:`velox.codecs.pq.scores`): no key is rebuilt.

Tables come from calibration (``codebook="smollm2-135m-instruct"``: layer ``layer`` of the
artifact shipped for the embedded SmolLM2, :data:`SHIPPED`; :func:`tables_from_arrays` for any
fit, ``velox calibrate --method a2ats``), which also carries the model's RoPE frequencies
(measured from its ``rope`` module: :func:`rope_frequencies`) and the distance ``b`` its ``H``
was taken at; a shipped fit that does not match (kv heads, head_dim, bits, sub_dim, ``b``,
layer) gives tables with ``calibrated = False``. ``codebook="prefill"`` (data-free) fits the
codebooks to the pre-RoPE keys of the first update that holds tokens, one fit a batch row, kv
head and sub-space (:func:`prefill_tables`: Lloyd's k-means in MLX from ``seed``), with
``H = I`` (no query is seen: the assignment is Euclidean) and the frequencies of ``rope_base``
and ``rope_scaling``; its codebook then has a batch axis (``[b, h, J, K, s]``).
``codebook="random"`` (tests) draws standard normal centroids from ``seed``, ``H = I`` and the
frequencies of ``rope_base`` and ``rope_scaling`` (:func:`inverse_frequencies`).

RoPE here is mlx-lm's rotate-half form (``traditional=False``): coordinates ``i`` and ``i + d /
2`` turn by ``pos * f_i``; :func:`rotate` turns rows by any per-row position (negative:
un-rotate), angles ``pos * f`` in float32 in both twins.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .._typing import Array, Float, UInt
from . import Codec, register_codec, shipped_calibration
from . import pq

__all__ = ["A2atsTables", "A2atsCodes", "SHIPPED", "ROPE_SCALINGS", "PREFILL_ITERS",
           "inverse_frequencies", "prefill_placeholder", "prefill_tables",
           "rope_frequencies", "rotate", "rotate_np", "shipped_arrays", "tables_from_arrays",
           "tables", "encode", "decode", "scores", "encode_np", "decode_np", "scores_np",
           "indices", "indices_np", "CODEC"]

#: Calibrations shipped in ``velox.adapters/data``: name -> file.
SHIPPED = {"smollm2-135m-instruct": "a2ats_smollm2.npz"}
#: ``rope_scaling`` choices: none, or mlx-lm's Llama-3 frequency scaling (low 1, high 4,
#: original context 8,192) at factor 8 (Llama-3.1) or 32 (Llama-3.2).
ROPE_SCALINGS = {"none": None, "llama3.1": 8.0, "llama3.2": 32.0}
#: Lloyd rounds of a codebook fitted at the prefill (``codebook="prefill"``), as many as the
#: shipped calibration's fit (``velox calibrate --method a2ats``, ``iters`` 10).
PREFILL_ITERS = 10


class A2atsTables(NamedTuple):
    # a batch axis only where fitted at the prefill, one fit a batch row ("*bh": velox.ragged
    # cuts such an array by row); the other arrays are shared by the rows
    codebook: Float[Array, "*bh j k s"]  # float16 [h, J, 2^bits, sub_dim] ([1, ...]: every
    #                                      head), or [b, h, J, 2^bits, sub_dim] (prefill)
    metric: Float[Array, "hc j s s"]    # float32 H a kv head and sub-space (identity: Euclidean)
    freqs: Float[Array, "r"]            # float32 [d / 2] RoPE angle a position, pair i
    head_dim: int
    sub_dim: int
    bits: int
    query_aware: bool
    calibrated: bool    # False: the shipped calibration does not fit (the method refuses)


class A2atsCodes(NamedTuple):
    idx: UInt[Array, "b h n w"]  # w = ceil(d / sub_dim * bits / 32) uint32 words


# --- RoPE -----------------------------------------------------------------------------------

def inverse_frequencies(head_dim: int, base: float, scaling: str = "none") -> np.ndarray:
    """RoPE angle a position of each pair ``[d / 2]`` (float32): ``base^(-2i/d)``, with
    mlx-lm's Llama-3 scaling where ``scaling`` names one (:data:`ROPE_SCALINGS`)."""
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling={scaling!r} is one of {', '.join(map(repr, ROPE_SCALINGS))}")
    period = float(base) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = ROPE_SCALINGS[scaling]
    if factor is not None:  # mlx_lm.models.rope_utils.Llama3RoPE
        low, high, old = 1.0, 4.0, 8192.0
        wave = 2 * np.pi * period
        scaled = np.where(wave > old / low, period * factor, period)
        smooth = (old / wave - low) / (high - low)
        mid = (wave > old / high) & (wave < old / low)
        period = np.where(mid, scaled / ((1 - smooth) / factor + smooth), scaled)
    return (1.0 / period).astype(np.float32)


def rope_frequencies(rope, head_dim: int) -> np.ndarray:
    """The angle a position of each pair ``[d / 2]`` (float32) of a model's ``rope`` module
    (``rope(x, offset=p)`` on ``[1, 1, 1, d]``), read from its rotation of a probe at offset 1
    and checked at offsets 2 and 7 on a random row: a module that is not rotate-half RoPE
    (interleaved pairs, scaled magnitudes) is refused with a ``ValueError``."""
    half = head_dim // 2
    probe = np.concatenate([np.ones(half), np.zeros(half)]).astype(np.float32)
    out = np.array(rope(mx.array(probe.reshape(1, 1, 1, -1)), offset=1), np.float64).reshape(-1)
    freqs = np.arctan2(out[half:], out[:half]).astype(np.float32)
    x = np.random.default_rng(0).standard_normal((1, 1, 1, head_dim)).astype(np.float32)
    for p in (2, 7):
        got = np.array(rope(mx.array(x), offset=p), np.float64)
        want = rotate_np(x, np.full((1, 1, 1), p), freqs)
        if not np.allclose(got, want, atol=1e-3 * max(1.0, np.abs(x).max()), rtol=1e-3):
            raise ValueError("a2ats takes rotate-half RoPE (mlx-lm's traditional=False, plain "
                             "magnitudes): this model's rope is not, so its keys cannot be "
                             "un-rotated")
    return freqs


def rotate(x: mx.array, pos: mx.array, freqs: mx.array) -> mx.array:
    """Rows ``x [..., n, d]`` (float32 out) turned by ``pos [..., n]`` positions (rotate-half
    RoPE; ``-pos`` un-rotates). Angles in float32: ``pos * f``."""
    half = x.shape[-1] // 2
    ang = pos.astype(mx.float32)[..., None] * freqs.astype(mx.float32)
    c, s = mx.cos(ang), mx.sin(ang)
    x = x.astype(mx.float32)
    a, b = x[..., :half], x[..., half:]
    return mx.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def rotate_np(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`rotate`, step by step in float32 as MLX computes it."""
    half = x.shape[-1] // 2
    ang = np.asarray(pos, np.float32)[..., None] * np.asarray(freqs, np.float32)
    c, s = np.cos(ang), np.sin(ang)
    x = np.asarray(x, np.float32)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


# --- tables ---------------------------------------------------------------------------------

@lru_cache(maxsize=4)
def shipped_arrays(name: str) -> tuple[dict, dict]:
    """``(arrays, info)`` of the shipped calibration ``name`` (:data:`SHIPPED`): ``codebook
    [layers, h, J, K, s]``, ``metric [layers, h, J, s, s]``, ``freqs [layers, h, d / 2]``,
    ``b [layers, h]``."""
    return shipped_calibration("A2ATS", SHIPPED, name)


def _check_metric(h: np.ndarray, j: int, s: int) -> np.ndarray:
    """``H`` as ``[hc, J, s, s]`` float32, checked: the shape, finite, symmetric, PSD."""
    h = np.asarray(h, np.float32)
    if h.ndim == 3:
        h = h[None]
    if h.ndim != 4 or h.shape[1:] != (j, s, s):
        raise ValueError(f"H of shape {h.shape} is not [kv_heads, {j}, {s}, {s}] (one "
                         f"[sub_dim, sub_dim] second moment a kv head and sub-space)")
    if not np.isfinite(h).all():
        raise ValueError("H holds non-finite entries")
    h64 = h.astype(np.float64)
    scale = max(1.0, float(np.abs(h64).max()))
    if not np.allclose(h64, np.swapaxes(h64, -1, -2), atol=1e-5 * scale, rtol=1e-5):
        raise ValueError("H is not symmetric")
    if np.linalg.eigvalsh((h64 + np.swapaxes(h64, -1, -2)) / 2).min() < -1e-5 * scale:
        raise ValueError("H is not positive semi-definite")
    return h


def tables_from_arrays(head_dim: int, sub_dim: int, bits: int, codebook, metric=None,
                       freqs=None, *, query_aware: bool = True,
                       calibrated: bool = True) -> A2atsTables:
    """Tables from a codebook ``[J, K, s]`` or ``[h, J, K, s]`` (``K = 2^bits``, ``s =
    sub_dim``), ``H`` ``[J, s, s]`` or ``[h, J, s, s]`` (``None``: the identity; checked
    symmetric PSD) and RoPE frequencies ``[d / 2]`` (``None``: base 10,000)."""
    d = int(head_dim)
    if d % 2 or sub_dim < 1 or d % sub_dim:
        raise ValueError(f"head_dim={d} must be even and divisible by sub_dim={sub_dim}")
    j = d // sub_dim
    cb = np.asarray(codebook, np.float32)
    cb = cb[None] if cb.ndim == 3 else cb
    if cb.ndim != 4 or cb.shape[1:] != (j, 1 << bits, sub_dim):
        raise ValueError(f"codebook of shape {np.shape(codebook)} is not [{j}, {1 << bits}, "
                         f"{sub_dim}] nor [kv_heads, {j}, {1 << bits}, {sub_dim}] (head_dim={d}, "
                         f"bits={bits}, sub_dim={sub_dim})")
    h = np.broadcast_to(np.eye(sub_dim, dtype=np.float32), (1, j, sub_dim, sub_dim)) if metric is None \
        else _check_metric(metric, j, sub_dim)
    f = inverse_frequencies(d, 10000.0) if freqs is None else np.asarray(freqs, np.float32)
    if f.shape != (d // 2,):
        raise ValueError(f"RoPE frequencies of shape {f.shape}, expected ({d // 2},)")
    return A2atsTables(mx.array(cb.astype(np.float16)), mx.array(np.ascontiguousarray(h)),
                       mx.array(f), d, int(sub_dim), int(bits), bool(query_aware), bool(calibrated))


def tables(head_dim: int, params: dict) -> A2atsTables:
    """The codec's tables for a method's parameters (module doc)."""
    sub_dim, bits = int(params.get("sub_dim", 8)), int(params.get("bits", 8))
    which, aware = params.get("codebook", "random"), bool(params.get("query_aware", True))
    d = int(head_dim)
    if d % 2 or d % sub_dim:
        raise ValueError(f"head_dim={d} must be even and divisible by sub_dim={sub_dim}")
    j = d // sub_dim
    if which == "prefill":  # zeros until the method fits them (prefill_placeholder)
        f = inverse_frequencies(d, params.get("rope_base", 10000.0), params.get("rope_scaling", "none"))
        return tables_from_arrays(d, sub_dim, bits, np.zeros((j, 1 << bits, sub_dim)), None, f,
                                  query_aware=aware)
    if which == "random":
        rng = np.random.default_rng([int(params.get("seed", 0)), 2])
        cb = rng.standard_normal((j, 1 << bits, sub_dim)).astype(np.float32)
        f = inverse_frequencies(d, params.get("rope_base", 10000.0), params.get("rope_scaling", "none"))
        return tables_from_arrays(d, sub_dim, bits, cb, None, f, query_aware=aware)
    arrays, info = shipped_arrays(which)
    layer, h = int(params.get("layer", -1)), int(params.get("kv_heads", -1))
    cb = arrays["codebook"]
    fits = (0 <= layer < cb.shape[0] and h == cb.shape[1] and d == info["head_dim"]
            and cb.shape[2:] == (j, 1 << bits, sub_dim)
            and float(arrays["b"][layer].flat[0]) == float(params.get("b", 2048)))
    if not fits:  # a placeholder the method refuses to encode with
        return tables_from_arrays(d, sub_dim, bits, np.zeros((j, 1 << bits, sub_dim)),
                                  query_aware=aware, calibrated=False)
    return tables_from_arrays(d, sub_dim, bits, cb[layer], arrays["metric"][layer],
                              arrays["freqs"][layer][0], query_aware=aware)


def prefill_placeholder(t: A2atsTables, batch: int, kv_heads: int) -> A2atsTables:
    """The tables of a ``codebook="prefill"`` state before its fit: zeros in the fitted shape
    ``[b, h, J, K, s]``, so that the state's arrays keep their shapes when
    :func:`prefill_tables` replaces them."""
    j = t.head_dim // t.sub_dim
    return t._replace(codebook=mx.zeros((batch, kv_heads, j, 1 << t.bits, t.sub_dim), mx.float16))


def prefill_tables(t: A2atsTables, rows: mx.array, seed) -> A2atsTables:
    """``t`` with codebooks fitted to pre-RoPE rows ``[b, h, n, d]`` (``n > 0``), one a batch
    row, kv head and sub-space: Lloyd's k-means of the sub-vectors
    (:func:`velox.codecs.pq.kmeans_many`, :data:`PREFILL_ITERS` rounds, the initial centroids
    drawn from ``seed``; Euclidean: ``H = I``, no query is seen), clipped to float16's range;
    a token with a non-finite element takes no part. One MLX function for both backends,
    nothing read back to the host."""
    b, h, n, d = rows.shape
    s, j = t.sub_dim, d // t.sub_dim
    x = rows.astype(mx.float32)
    finite = mx.all(mx.isfinite(x), axis=-1)                                    # [b, h, n]
    x = mx.where(finite[..., None], x, mx.zeros_like(x))
    pts = x.reshape(b, h, n, j, s).transpose(0, 1, 3, 2, 4).reshape(b * h * j, n, s)
    w = mx.broadcast_to(finite[:, :, None, :], (b, h, j, n)).reshape(b * h * j, n)
    cb = pq.kmeans_many(pts, 1 << t.bits, iters=PREFILL_ITERS, seed=seed, weights=w)
    f16 = float(np.finfo(np.float16).max)
    cb = mx.clip(cb, -f16, f16).astype(mx.float16).reshape(b, h, j, 1 << t.bits, s)
    return t._replace(codebook=cb, calibrated=True)


# --- MLX ------------------------------------------------------------------------------------

def _check(t: A2atsTables, shape) -> None:
    if len(shape) != 4 or shape[-1] != t.head_dim:
        raise ValueError(f"rows must be [b, h, n, {t.head_dim}], got {tuple(shape)}")
    cb = t.codebook
    if cb.ndim == 5:
        if tuple(cb.shape[:2]) != tuple(shape[:2]):
            raise ValueError(f"the tables hold {tuple(cb.shape[:2])} batch rows and kv heads; "
                             f"rows of shape {tuple(shape)} do not")
        return
    hc = cb.shape[0]
    if hc != 1 and hc != shape[1]:
        raise ValueError(f"the tables hold {hc} kv heads; rows of shape {tuple(shape)} do not")


def _metric(t: A2atsTables):
    return t.metric if t.query_aware else None


def _rows_of(cb, x):
    """``pq.fold_batch`` for this codec's codebooks (fitted a batch row and kv head:
    ``[b, h, J, K, s]``)."""
    return pq.fold_batch(cb, x, 5)


def _unfold(cb, y, shape):
    return pq.unfold_batch(cb, y, shape, 5)


def encode(t: A2atsTables, rows: mx.array) -> A2atsCodes:
    """Indices of the nearest centroids under ``H`` (``query_aware``) or Euclidean, packed."""
    _check(t, rows.shape)
    cb, sub = _rows_of(t.codebook, pq.split(rows.astype(mx.float32), t.sub_dim))
    idx = _unfold(t.codebook, pq.assign(sub, cb, _metric(t)), rows.shape)
    return A2atsCodes(pq.pack(idx, t.bits))


def indices(t: A2atsTables, codes: A2atsCodes) -> mx.array:
    """The unpacked indices ``[b, h, n, J]``."""
    return pq.unpack(codes.idx, t.bits, t.head_dim // t.sub_dim)


def decode(t: A2atsTables, codes: A2atsCodes) -> mx.array:
    idx = indices(t, codes)
    cb, fi = _rows_of(t.codebook, idx)
    return _unfold(t.codebook, pq.decode(cb, fi), idx.shape)


def scores(t: A2atsTables, queries: mx.array, codes: A2atsCodes) -> mx.array:
    cb, fq = _rows_of(t.codebook, queries.astype(mx.float32))
    _, fi = _rows_of(t.codebook, indices(t, codes))
    return _unfold(t.codebook, pq.scores(fq, cb, fi), queries.shape)


# --- NumPy twins ----------------------------------------------------------------------------

def _np(t: A2atsTables):
    cb = np.asarray(t.codebook).astype(np.float32)
    return cb, (np.asarray(t.metric, np.float32) if t.query_aware else None)


def encode_np(t: A2atsTables, rows: np.ndarray) -> A2atsCodes:
    x = np.asarray(rows, np.float32)
    _check(t, x.shape)
    cb, h = _np(t)
    fcb, sub = _rows_of(cb, pq.split(x, t.sub_dim))
    idx = _unfold(cb, pq.assign_np(sub, fcb, h), x.shape)
    return A2atsCodes(pq.pack_np(idx, t.bits))


def indices_np(t: A2atsTables, codes: A2atsCodes) -> np.ndarray:
    return pq.unpack_np(np.asarray(codes.idx), t.bits, t.head_dim // t.sub_dim)


def decode_np(t: A2atsTables, codes: A2atsCodes) -> np.ndarray:
    cb, idx = _np(t)[0], indices_np(t, codes)
    fcb, fi = _rows_of(cb, idx)
    return _unfold(cb, pq.decode_np(fcb, fi), idx.shape)


def scores_np(t: A2atsTables, queries: np.ndarray, codes: A2atsCodes) -> np.ndarray:
    cb, q = _np(t)[0], np.asarray(queries, np.float32)
    fcb, fq = _rows_of(cb, q)
    _, fi = _rows_of(cb, indices_np(t, codes))
    return _unfold(cb, pq.scores_np(fq, fcb, fi), q.shape)


CODEC = register_codec(Codec(
    name="a2ats", tables=tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np,
    params=("sub_dim", "bits", "codebook", "seed", "kv_heads", "layer", "b", "query_aware",
            "rope_base", "rope_scaling"),
    error=("no bound: each sub-vector is replaced by the centroid of least (x - c)^T H (x - c), "
           "the expected squared score error over the calibration queries; scores are "
           "q . decode(k) read from the lookup table")))
