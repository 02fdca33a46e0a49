"""RocketKV: SnapKV eviction at prefill, then per-step page-level sparse attention at decode.

Stage 1 (``update``, prefill chunk of ``s > 1`` tokens): SnapKV's votes
(:func:`velox.methods.snapkv.votes`): the last ``obs_window`` queries vote (causal attention
summed over the window, averaged over the kv head's query heads), the votes are max-pooled
over ``kernel_size`` neighbours, and stored + new are cut to ``budget``: sinks, the window and
the best-voted rest. A single token (decode) is appended.
The state keeps the survivors and, per page of ``page_size`` stored slots, the element-wise
max and min of their keys.

Stage 2 (``attend``, registered; one decode query): hybrid sparse attention. The ``head_topk1``
channels with the largest ``sum_g |q|`` over the group are kept; each page's bound on ``q.k``
uses ``K_max`` on channels where the group's query sum is positive and ``K_min`` elsewhere;
scaled by ``sqrt(d * |q_hat|_1 / |q|_1)`` and softmaxed over tokens per query head, summed over
the group, the ``k2`` best pages are read, ``k2 = ceil(ceil(n / c2) / page_size)``, and exact
attention runs over their tokens plus the new one. One selection per kv head serves its query
heads (GQA), as in the authors' implementation. What the state stores (``get_kv``,
``nbytes``) and what a step reads (:func:`rocketkv_read_size`) are reported separately.

Split of the target ratio ``c`` (``compression_ratio``): ``r = clip(0.2 + 0.06 log2 c, 0.2,
0.8)``; stage 2 reads ``1 / c2`` of the stored tokens, ``c2 = c ** (1 - r)``; ``c2`` splits
evenly into the page size (``ceil(sqrt(c2))``) and the channel reduction (``head_topk1 =
round(d * page_size / c2)``) unless those are given.

Backends: ``reference`` and ``mlx`` (stage 1 and the page summaries); stage 2 is the
``attend`` hook.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..attention import group_queries
from ..registry import register
from .snapkv import votes, votes_reference

__all__ = ["RocketKVState", "State", "init", "update", "get_kv", "nbytes", "rocketkv_attend",
           "rocketkv_select", "rocketkv_read_size", "ReadSize", "split_ratio"]


class RocketKVState(NamedTuple):
    """Stage-1 survivors and decode tokens, with per-page key max/min summaries."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    page_max: Float[Array, "b h p d"]  # element-wise max of the keys of each page of slots
    page_min: Float[Array, "b h p d"]
    budget: int
    compression_ratio: float
    page_size: int      # resolved (>= 1)
    head_topk1: int     # resolved (1 .. d)
    obs_window: int
    n_sink: int
    kernel_size: int
    backend: str


class ReadSize(NamedTuple):
    """What one decode step's attention reads from a state."""

    pages: int       # pages selected (of ``total_pages``)
    total_pages: int
    tokens: int      # stored tokens read, plus the new ones
    stored: int      # tokens the state holds


def split_ratio(c: float) -> tuple[float, float]:
    """``(c1, c2)``: stage-1 and stage-2 ratios with ``c1 * c2 = c`` (paper's adaptive split)."""
    r = min(max(0.2 + 0.06 * math.log2(c), 0.2), 0.8)
    return c ** r, c ** (1 - r)


def _resolve(compression_ratio: float, page_size: int, head_topk1: int, head_dim: int) -> tuple[int, int]:
    c2 = split_ratio(compression_ratio)[1]
    page = page_size or max(1, math.ceil(math.sqrt(c2)))
    k1 = head_topk1 or max(1, round(head_dim * page / c2))
    return page, min(k1, head_dim)


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, compression_ratio: float = 8.0, page_size: int = 0,
         head_topk1: int = 0, obs_window: int = 32, n_sink: int = 4, kernel_size: int = 63,
         backend: str = "auto") -> RocketKVState:
    """Empty RocketKV state; prefill chunks are cut to ``budget`` tokens per head.

    Args:
        budget: stage 1: tokens kept per head after each prefill chunk (sinks and window
            included).
        compression_ratio: target ratio c; stage 2 reads 1 / c**(1 - r) of the stored tokens,
            r = clip(0.2 + 0.06 log2 c, 0.2, 0.8).
        page_size: stage 2: stored slots per page (0: ceil(sqrt(c2)) from the split).
        head_topk1: stage 2: query channels kept for the page bounds (0: from the split;
            capped at head_dim).
        obs_window: stage 1: newest prompt tokens whose queries vote; always kept.
        n_sink: stage 1: leading tokens never evicted.
        kernel_size: stage 1: max-pooling width over neighbouring positions (odd).
    """
    page_size, head_topk1 = _resolve(compression_ratio, page_size, head_topk1, head_dim)
    empty = mx.zeros((batch, kv_heads, 0, head_dim), dtype)
    return evict.empty_state(RocketKVState, locals(), page_max=empty, page_min=empty)


# --- stage 1 ----------------------------------------------------------------------------

def _pages_mlx(keys: mx.array, page: int) -> tuple[mx.array, mx.array]:
    """Element-wise max and min of the keys of each page of ``page`` slots."""
    b, h, n, d = keys.shape
    np_ = -(-n // page)
    pad = [(0, 0), (0, 0), (0, np_ * page - n), (0, 0)]
    hi = mx.pad(keys, pad, constant_values=-mx.inf).reshape(b, h, np_, page, d).max(axis=3)
    lo = mx.pad(keys, pad, constant_values=mx.inf).reshape(b, h, np_, page, d).min(axis=3)
    return hi, lo


_NARROW = 16  # values per token up to which rows (positions) are concatenated, as in evict


def _append(a: mx.array, x: mx.array, index: dict | None = None) -> mx.array:
    """``a ++ x`` along the token axis, for a decode step (the state grows without bound).

    :func:`velox.evict.append_rows` gathers wide rows on the CPU through an index it caches
    per length; a state that grows at every step asks for a new length at every step, and
    those indices, none read again, would fill the constant cache (``evict.CONST_BYTES``)
    and stay live after the steps that made them. The same gather here takes an index made
    for this step only, freed with it (``index``: the step's indices by shape, shared by its
    arrays); other cases concatenate, as there.
    """
    n, s = a.shape[2], x.shape[2]
    b, h, rest = a.shape[0], a.shape[1], a.shape[3:]
    if (mx.default_device() != mx.cpu or n == 0 or s == 0 or s > n or a.dtype != x.dtype
            or math.prod(rest) <= _NARROW or 4 * b * h * (n + s) > evict.CONST_BYTES // 4):
        return mx.concatenate([a, x], axis=2)
    rows = None if index is None else index.get((b, h, n, s))
    if rows is None:  # each row's block of n, its last row repeated into the s new slots
        rows = mx.array((np.minimum(np.arange(n + s, dtype=np.int32), n - 1)
                         + (np.arange(b * h, dtype=np.int32) * n)[:, None]).reshape(-1))
        if index is not None:
            index[(b, h, n, s)] = rows
    out = mx.take(a.reshape(b * h * n, *rest), rows, axis=0)
    start = mx.array([0, 0, n] + [0] * len(rest))
    return mx.slice_update(out.reshape(b, h, n + s, *rest), x, start, axes=tuple(range(a.ndim)))


def _update_mlx(state: RocketKVState, keys, values, queries) -> RocketKVState:
    n, s = state.keys.shape[2], keys.shape[2]
    idx = None
    if s > 1 and n + s > state.budget:  # stage 1: SnapKV's selection, max-pooled
        idx = evict.top_budget(votes(state, keys, values, queries, pooling="maxpool"), state.budget,
                               evict.protected(n + s, state.n_sink, state.obs_window))
    stored = (state.keys, state.values, state.positions)
    new = (keys, values, evict.new_positions(state.next_pos, s))
    if s == 1:  # decode: appended, never evicted
        index = {}
        k, v, p = (_append(a, x, index) for a, x in zip(stored, new))
    else:
        k, v, p = evict.keep_rows(stored, new, idx)
    if s == 1 and n % state.page_size:  # the token joins the last, partial page
        last = mx.array([0, 0, state.page_max.shape[2] - 1, 0])
        hi = mx.maximum(state.page_max[:, :, -1:], keys)
        lo = mx.minimum(state.page_min[:, :, -1:], keys)
        page_max = mx.slice_update(state.page_max, hi, last, axes=(0, 1, 2, 3))
        page_min = mx.slice_update(state.page_min, lo, last, axes=(0, 1, 2, 3))
    elif s == 1:  # the token opens a page
        page_max = _append(state.page_max, keys)
        page_min = _append(state.page_min, keys)
    else:
        page_max, page_min = _pages_mlx(k, state.page_size)
    return state._replace(keys=k, values=v, positions=p, page_max=page_max, page_min=page_min,
                          next_pos=state.next_pos + s)


def _pages_reference(keys: np.ndarray, page: int) -> tuple[np.ndarray, np.ndarray]:
    """One head: ``[n, d]`` keys -> page max and min ``[ceil(n / page), d]``."""
    starts = range(0, len(keys), page)
    return (np.array([keys[i:i + page].max(axis=0) for i in starts]).reshape(-1, keys.shape[1]),
            np.array([keys[i:i + page].min(axis=0) for i in starts]).reshape(-1, keys.shape[1]))


def _update_reference(state: RocketKVState, keys, values, queries) -> RocketKVState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    s = keys.shape[2]
    chosen = [[None] * h for _ in range(b)]
    if s > 1 and N > state.budget:  # stage 1: SnapKV's selection, max-pooled
        for i in range(b):
            for j in range(h):
                score = votes_reference(state, ref.head(c, i, j, {}, True), pooling="maxpool")
                keep = ref.protected(c.positions[i, j], c.total[i, j], state.n_sink, state.obs_window)
                chosen[i][j] = ref.top_budget(score, state.budget, keep)
    out = ref.keep(state, c, chosen)
    kept = ref.to_np(out.keys, np.float32)
    pages = [[_pages_reference(kept[i, j], state.page_size) for j in range(h)] for i in range(b)]
    hi = np.stack([np.stack([p[0] for p in row]) for row in pages])
    lo = np.stack([np.stack([p[1] for p in row]) for row in pages])
    return out._replace(page_max=ref.to_mx(hi, state.keys.dtype), page_min=ref.to_mx(lo, state.keys.dtype))


# --- stage 2 ----------------------------------------------------------------------------

def _pages_read(state: RocketKVState) -> int:
    """Pages a decode step reads: ``ceil(ceil(n / c2) / page_size)``, at most all of them."""
    n = state.keys.shape[2]
    tokens = math.ceil(n / split_ratio(state.compression_ratio)[1])
    return min(math.ceil(tokens / state.page_size), state.page_max.shape[2])


def rocketkv_read_size(state: RocketKVState, queries: Float[Array, "b q s d"] | None = None,
                       s: int = 1) -> ReadSize:
    """What the attention of ``s`` new tokens over ``state`` reads.

    A decode step (``s == 1``) reads the selected pages' tokens and the new one; with the
    step's ``queries`` the count is exact (a selected last page may be partial), without them
    every selected page counts as full. A chunk (``s > 1``) reads every stored token.
    """
    n, total = state.keys.shape[2], state.page_max.shape[2]
    if s > 1 or n == 0:
        return ReadSize(pages=total, total_pages=total, tokens=n + s, stored=n)
    pages = _pages_read(state)
    if pages == total:
        return ReadSize(pages=total, total_pages=total, tokens=n + 1, stored=n)
    tokens = pages * state.page_size
    if queries is not None:  # the most any (batch row, kv head) reads
        chosen = np.array(rocketkv_select(state, queries)).reshape(-1, pages)
        tokens = int(np.minimum(state.page_size, n - chosen * state.page_size).sum(axis=1).max())
    return ReadSize(pages=pages, total_pages=total, tokens=tokens + 1, stored=n)


def _channels(x: mx.array, ch: mx.array) -> mx.array:
    """``x[..., ch]`` for ``x`` ``[b, h, m, d]`` and channels ``ch`` ``[b, h, k]`` (float32)."""
    return mx.take_along_axis(x.astype(mx.float32),
                              mx.broadcast_to(ch[:, :, None], x.shape[:3] + ch.shape[2:]), axis=-1)


def _page_scores(state: RocketKVState, q: mx.array) -> mx.array:
    """Per-page scores ``[b, h, p]`` of one decode step's grouped queries ``q`` ``[b, h, g, d]``."""
    b, h, g, d = q.shape
    q = q.astype(mx.float32)
    mag = mx.abs(q).sum(axis=2)  # [b, h, d]
    k1 = state.head_topk1
    if k1 < d:  # the group's k1 largest channels
        ch = mx.argpartition(-evict.ranked(mag), kth=k1 - 1, axis=-1)[..., :k1]
    else:
        ch = mx.broadcast_to(mx.arange(d), (b, h, d))
    q_hat = _channels(q, ch)  # [b, h, g, k1]
    positive = q_hat.sum(axis=2) > 0  # the group's sign per channel picks K_max or K_min
    bound = mx.where(positive[:, :, None], _channels(state.page_max, ch),
                     _channels(state.page_min, ch))  # [b, h, p, k1]
    logits = q_hat @ bound.swapaxes(-1, -2)  # [b, h, g, p]
    scale = mx.sqrt(d * mx.abs(q_hat).sum(axis=-1, keepdims=True)
                    / mx.maximum(mx.abs(q).sum(axis=-1, keepdims=True), 1e-30))
    logits = logits / mx.maximum(scale, 1e-30)
    n, total = state.keys.shape[2], state.page_max.shape[2]
    counts = mx.array([min(state.page_size, n - i * state.page_size) for i in range(total)], mx.float32)
    lse = mx.logsumexp(logits + mx.log(counts), axis=-1, keepdims=True)  # softmax over tokens
    return mx.exp(logits - lse).sum(axis=2)


def rocketkv_select(state: RocketKVState, queries: Float[Array, "b q 1 d"]) -> Int[Array, "b h k"] | None:
    """Pages ``[b, h, k2]`` (ascending) one decode step reads; ``None`` reads every page."""
    k2 = _pages_read(state)
    if k2 >= state.page_max.shape[2]:
        return None
    q = group_queries(queries, state.keys.shape[1])[:, :, :, 0]
    return evict.top_budget(_page_scores(state, q), k2)


def rocketkv_attend(state: RocketKVState, queries: Float[Array, "b q s d"], keys: Float[Array, "b h s d"],
                    values: Float[Array, "b h s d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention of ``queries`` over the stored tokens plus ``s`` new ones (sparse at decode)."""
    n, s = state.keys.shape[2], keys.shape[2]
    pages = rocketkv_select(state, queries) if s == 1 and n else None
    if pages is None:  # prefill chunk, or every page selected: dense attention
        k = mx.concatenate([state.keys, keys], axis=2) if n else keys
        v = mx.concatenate([state.values, values], axis=2) if n else values
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    b, h, k2 = pages.shape
    P = state.page_size
    slots = (pages[..., None] * P + mx.arange(P, dtype=mx.int32)).reshape(b, h, k2 * P)
    valid = slots < n
    slots = mx.minimum(slots, n - 1)
    k_sel = evict.take_rows(state.keys, slots).astype(mx.float32)
    v_sel = evict.take_rows(state.values, slots).astype(mx.float32)
    q = group_queries(queries, h).astype(mx.float32) * scale  # [b, h, g, 1, d]
    logits = mx.concatenate([q @ k_sel[:, :, None].swapaxes(-1, -2),
                             q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)], axis=-1)
    keep = mx.concatenate([valid, mx.ones((b, h, 1), mx.bool_)], axis=-1)[:, :, None, None]
    w = mx.softmax(mx.where(keep, logits, -mx.inf), axis=-1, precise=True)
    v_all = mx.concatenate([v_sel, values.astype(mx.float32)], axis=2)[:, :, None]
    out = w @ v_all  # [b, h, g, 1, d]
    return out.reshape(queries.shape).astype(queries.dtype)


State = RocketKVState
method = register("rocketkv", RocketKVState, init,
                  {"reference": _update_reference, "mlx": _update_mlx}, attend=rocketkv_attend)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
