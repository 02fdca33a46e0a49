"""Attention pieces shared by attention-scored methods: GQA grouping, proxy queries, masks.

Query head ``i`` reads kv head ``i // g`` (``g = q / h``), the grouping of mlx-lm and of
every GQA model. Without real queries, methods use the *key-as-query proxy*: the new
keys stand in for the queries of their own tokens (one "query head" per kv head).
"""

from __future__ import annotations

import mlx.core as mx

from ._typing import Array, Bool, Float, Int

__all__ = ["group_queries", "scoring_queries", "causal_mask", "attention_weights", "attention_mass"]


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


def attention_weights(queries: Float[Array, "b h g m d"], keys: Float[Array, "b h n d"],
                      key_positions: Int[Array, "b h n"] | None = None,
                      query_positions: Int[Array, "b h m"] | None = None,
                      scale: float | None = None) -> Float[Array, "b h g m n"]:
    """Softmax attention weights (float32) of grouped queries over keys.

    With positions given, a query attends only keys at or before its own position; without,
    every key is visible (right for a single newest query).
    """
    b, h, g, m, d = queries.shape
    n = keys.shape[2]
    scale = d ** -0.5 if scale is None else scale
    logits = (queries.reshape(b, h, g * m, d) @ keys.swapaxes(-1, -2)).astype(mx.float32)
    logits = logits.reshape(b, h, g, m, n) * scale
    if key_positions is not None and query_positions is not None and m > 1:
        mask = causal_mask(key_positions, query_positions)[:, :, None]
        logits = mx.where(mask, logits, -mx.inf)
    return mx.softmax(logits, axis=-1, precise=True)


def attention_mass(queries: Float[Array, "b h g m d"], keys: Float[Array, "b h n d"],
                   key_positions: Int[Array, "b h n"], query_positions: Int[Array, "b h m"],
                   coef: Float[Array, "m"] | None = None, block: int = 256) -> Float[Array, "b h n"]:
    """Attention each key receives, summed over queries (weighted by ``coef``), mean over ``g``.

    Queries are processed in blocks of ``block`` so a long prefill chunk never materialises
    the full ``[m, n]`` weight matrix of every head at once.
    """
    m = queries.shape[3]
    total = None
    for start in range(0, m, block):
        stop = min(start + block, m)
        w = attention_weights(queries[:, :, :, start:stop], keys, key_positions,
                              query_positions[:, :, start:stop])
        if coef is not None:
            w = w * coef[start:stop, None]
        part = w.sum(axis=3).mean(axis=2)
        total = part if total is None else total + part
    return total
