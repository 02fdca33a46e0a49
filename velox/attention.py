"""Attention pieces shared by attention-scored methods: GQA grouping, proxy queries, masks.

Query head ``i`` reads kv head ``i // g`` (``g = q / h``), the grouping of mlx-lm and of
every GQA model. Without real queries, methods use the *key-as-query proxy*: the new
keys stand in for the queries of their own tokens (one "query head" per kv head).

Stored keys are rows (``[b, h, n, d]``) or :class:`CodedKeys`, a codec's codes: a score that
reads the stored keys only through :func:`candidate_logits` (and :func:`candidate_weights`,
:func:`candidate_mass`, :func:`accumulated_scores`; one head of a ``reference`` score:
:func:`head_weights`) then gets the codec's estimates ``codec.scores`` as their logits,
never a decode (``velox.compose`` hands them over; ``velox.evict.score_and_keep``'s
``logits_only`` declares such a score). The new keys are always rows, scored exactly.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from . import reference as ref
from ._typing import Array, Bool, Float, Int
from .coded import CodedKeys
from .consts import cached_const  # the byte-bounded cache of shared constants

__all__ = ["group_queries", "scoring_queries", "causal_mask", "chunk_mask", "candidate_logits",
           "candidate_weights", "candidate_mass", "accumulated_scores", "softmax", "CodedKeys",
           "stored_count", "stored_logits", "head_weights"]

_LOG2E = 1.4426950408889634
# 2**f = e**(f ln 2) for f in [-1/2, 1/2]: Taylor coefficients to degree 6 (error < 2e-7)
_EXP2 = tuple(math.log(2) ** k / math.factorial(k) for k in range(7))


def _exp2_nonpositive(t: Float[Array, "..."]) -> Float[Array, "..."]:
    """``2**t`` for float32 ``t <= 0`` in plain arithmetic (no transcendental call): ``2**k``
    built in the exponent bits, ``2**f`` a polynomial; values below ``2**-126`` are 0."""
    t = mx.maximum(t, -127.0)
    k = mx.floor(t + 0.5)
    f = t - k
    p = _EXP2[-1]
    for c in reversed(_EXP2[:-1]):
        p = p * f + c
    return p * mx.view((k.astype(mx.int32) + 127) << 23, mx.float32)


def softmax(x: Float[Array, "..."], axis: int = -1) -> Float[Array, "..."]:
    """Float32 softmax along ``axis``; masked (``-inf``) entries get exactly 0.

    On the CPU the exponentials are a polynomial in plain arithmetic, which ``mx.compile``
    fuses into one loop: about 2.5x faster than ``mx.softmax`` there (whose ``exp`` costs
    ~12 ns an element on the CPU), within 4e-7 relative of it. Other devices use
    ``mx.softmax(precise=True)``.
    """
    if mx.default_device() != mx.cpu:
        return mx.softmax(x, axis=axis, precise=True)
    x = x.astype(mx.float32)
    e = _exp2_nonpositive((x - x.max(axis=axis, keepdims=True)) * _LOG2E)
    return e / e.sum(axis=axis, keepdims=True)


def stored_count(stored: Float[Array, "b h n d"] | CodedKeys) -> int:
    """``n``: the stored keys (rows or codes)."""
    return stored.coded if isinstance(stored, CodedKeys) else stored.shape[2]


def stored_logits(q: Float[Array, "b h m d"], stored: Float[Array, "b h n d"] | CodedKeys) -> Float[Array, "b h m n"]:
    """``q . k`` of float32 queries (already scaled) and every stored key: a matmul over rows,
    or the codec's ``scores`` over codes."""
    if isinstance(stored, CodedKeys):
        return stored.codec.scores(stored.tables, q, stored.codes)
    return q @ stored.astype(mx.float32).swapaxes(-1, -2)


def head_weights(q: np.ndarray, keys: np.ndarray | CodedKeys, key_pos: np.ndarray,
                 query_pos: np.ndarray) -> np.ndarray:
    """One head of a ``reference`` score: causal weights ``[g, m, N]`` of queries ``[g, m, d]``
    (float64) over the candidates' keys, rows ``[N, d]`` (``velox.reference.attention_weights``)
    or one head's :class:`CodedKeys` (NumPy): the coded keys' logits from the codec's
    ``scores_np`` of the scaled queries (float32), the new keys' exact, one softmax."""
    if not isinstance(keys, CodedKeys) or keys.coded == 0:
        return ref.attention_weights(q, keys if not isinstance(keys, CodedKeys) else keys.rows,
                                     key_pos, query_pos)
    g, m, d = q.shape
    n = keys.coded
    scaled = (q / np.sqrt(d)).astype(np.float32).reshape(1, 1, g * m, d)
    coded = keys.codec.scores_np(keys.tables, scaled, keys.codes).reshape(g, m, n).astype(np.float64)
    logits = np.concatenate([coded, q @ keys.rows[n:].T / np.sqrt(d)], axis=-1)
    return ref.softmax(np.where(ref.visible(key_pos, query_pos), logits, -np.inf))


def group_queries(queries: Float[Array, "b q s d"], kv_heads: int) -> Float[Array, "b h g s d"]:
    """Split query heads into ``kv_heads`` groups of ``g = q // kv_heads``."""
    b, hq, s, d = queries.shape
    return queries.reshape(b, kv_heads, hq // kv_heads, s, d)


def scoring_queries(keys: Float[Array, "b h s d"],
                    queries: Float[Array, "b q s d"] | None) -> Float[Array, "b h g s d"]:
    """Real queries grouped per kv head when given, else the key-as-query proxy (g = 1)."""
    if queries is None:
        return keys[:, :, None]
    return group_queries(queries, keys.shape[1])


def causal_mask(key_positions: Int[Array, "b h n"],
                query_positions: Int[Array, "b h m"]) -> Bool[Array, "b h m n"]:
    """``True`` where a query may attend a key: the key's absolute position is not later."""
    return key_positions[:, :, None, :] <= query_positions[:, :, :, None]


def chunk_mask(n: int, s: int, m: int) -> Bool[Array, "m n_plus_s"]:
    """Visibility of ``n`` stored + ``s`` new keys for the chunk's last ``m`` queries.

    Stored keys precede the chunk, so every query sees them; query ``i`` (the chunk's token
    ``s - m + i``) sees the new keys up to itself. Static, so compiled updates need no
    position arithmetic; it equals :func:`causal_mask` on absolute positions.
    """
    if m * (n + s) <= 1 << 16:  # decode-sized: a cached constant, no primitives per call
        return cached_const(("chunk_mask", n, s, m), lambda: _chunk_mask_np(n, s, m))
    q = mx.arange(s - m, s)[:, None]
    j = mx.arange(n + s)[None, :] - n
    return j <= q


def _chunk_mask_np(n: int, s: int, m: int) -> np.ndarray:
    return np.arange(n + s)[None, :] - n <= np.arange(s - m, s)[:, None]


def candidate_logits(queries: Float[Array, "b h g m d"], stored: Float[Array, "b h n d"] | CodedKeys,
                     new: Float[Array, "b h s d"], scale: float | None = None) -> Float[Array, "b h g m ns"]:
    """Scaled float32 logits of the chunk's last ``m`` queries over stored + new keys, causal.

    The two key sets are scored separately, so no concatenated key array is built; stored
    :class:`CodedKeys` are scored by their codec (:func:`stored_logits`).
    """
    b, h, g, m, d = queries.shape
    n, s = stored_count(stored), new.shape[2]
    scale = d ** -0.5 if scale is None else scale
    q = queries.reshape(b, h, g * m, d).astype(mx.float32) * scale
    parts = [q @ new.astype(mx.float32).swapaxes(-1, -2)]
    if n:
        parts.insert(0, stored_logits(q, stored))
    logits = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    logits = logits.reshape(b, h, g, m, n + s)
    if m > 1 or s > 1:
        logits = mx.where(chunk_mask(n, s, m), logits, -mx.inf)
    return logits


def candidate_weights(queries: Float[Array, "b h g m d"], stored: Float[Array, "b h n d"] | CodedKeys,
                      new: Float[Array, "b h s d"]) -> Float[Array, "b h g m ns"]:
    """Softmax attention weights of the chunk's last ``m`` queries over stored + new keys."""
    return softmax(candidate_logits(queries, stored, new))


#: Elements of one block's logits a sequence in :func:`candidate_mass` (float32: 64 MiB), so
#: that a 2048-token prefill chunk over 4096 candidates with 32 query heads goes 128 queries a
#: block at any batch size (a batch's prefill holds a batch's worth of everything else; a tile
#: shared by the batch sent 4 queries a block at 32 sequences, 512 blocks one after another).
MASS_TILE = 1 << 24


def candidate_mass(queries: Float[Array, "b h g m d"], stored: Float[Array, "b h n d"] | CodedKeys,
                   new: Float[Array, "b h s d"], coef: Float[Array, "m"] | None = None,
                   block: int | None = None, noise=None) -> Float[Array, "b h ns"]:
    """Attention each candidate receives from the chunk's last ``m`` queries.

    Summed over queries (weighted by ``coef``), averaged over the ``g`` query heads of a kv
    head. Queries go in blocks of ``block`` (by default as many as keep a block's logits
    within :data:`MASS_TILE` elements a sequence, at most 256), one block's weights at a time: each
    block's queries depend on the sum so far, so a long chunk never holds more than one
    block's logits and weights (a prefill's peak memory).
    ``noise(start, stop, visible)``, when given, is added to the logits of queries
    ``start..stop-1`` over the ``n + visible`` candidates they may see before the softmax
    (``[b, h, 1 or g, stop - start, n + visible]``: Keyformer's Gumbel noise).
    """
    b, h, g, m, _ = queries.shape
    s = new.shape[2]
    if block is None:
        block = max(1, min(256, MASS_TILE // (h * g * (stored_count(stored) + s))))
    total = None
    for start in range(0, m, block):
        stop = min(start + block, m)
        # the block's queries are the chunk's tokens s-m+start .. s-m+stop-1: only the new
        # keys up to the block's last query can be visible
        visible = s - m + stop
        q = queries[:, :, :, start:stop]
        if total is not None:  # one block's weights at a time: the next block waits for this sum
            q = mx.depends(q, [total])
        if noise is None:
            w = candidate_weights(q, stored, new[:, :, :visible])
        else:
            logits = candidate_logits(q, stored, new[:, :, :visible])
            w = softmax(logits + noise(start, stop, visible))
        if coef is not None:
            w = w * coef[start:stop, None]
        part = (w[:, :, :, 0] if stop - start == 1 else w.sum(axis=3)).mean(axis=2)
        if visible < s:
            part = mx.concatenate([part, mx.zeros(part.shape[:2] + (s - visible,), part.dtype)], axis=2)
        total = part if total is None else total + part
    return total


def accumulated_scores(scores: Float[Array, "b h n"], queries: Float[Array, "b h g s d"],
                       stored: Float[Array, "b h n d"] | CodedKeys, new: Float[Array, "b h s d"], decay: float,
                       mass=candidate_mass) -> tuple[Float[Array, "b h n"], Float[Array, "b h s"]]:
    """H2O's accumulation over one chunk: stored scores decayed by ``decay**s`` plus the
    chunk's attention mass, query ``i`` of ``s`` weighted by ``decay**(s-1-i)`` (equal to
    token-by-token accumulation). Returns the stored and the new candidates' scores.

    ``mass(queries, stored, new, coef)`` computes the weighted mass (a variant may perturb it);
    ``coef`` is ``None`` for a single query (weight 1).
    """
    n, s = stored_count(stored), new.shape[2]
    # one query (a decode step) has weight decay**0 = 1
    coef = decay ** mx.arange(s - 1, -1, -1, dtype=mx.float32) if s > 1 else None
    m = mass(queries, stored, new, coef)
    if n == 0:  # no arithmetic on empty arrays: MLX's compiled CUDA kernels fault on them
        return scores, m
    return scores * (decay ** s) + m[:, :, :n], m[:, :, n:]
