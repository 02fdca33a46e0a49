"""MorphKV: keep the tokens the most recent window of queries attends to.

References:
    Ghadia, Kumar, Jain, Nair, Das. Dialogue Without Limits: Constant-Sized KV Caches for
    Extended Responses in LLMs. ICML 2025. arXiv:2503.00979.

Rule: the ``window`` newest tokens vote. Each voter's *attention profile* is its causal
attention over the cache at its own step, averaged over the kv head's query heads; a candidate
(stored + new) scores the sum (or max) of the voters' profiles at it (0 from voters older than
it). As in the paper, a profile is computed once, when its token arrives, and the state keeps
the profiles of the ``window - 1`` newest tokens beside the rows they cover (``profiles``,
``[b, h, n, window - 1]``, float32), so a decode step scores with one query, like TOVA. Sinks and
the ``window - 1`` newest tokens (the next update's voters) are protected; the ``budget`` best
candidates are kept. A chunk is one selection, voted by its newest ``window`` queries (preceded,
when it is shorter than the window, by the stored profiles).

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache: one fused kernel
for the new query's profile and every candidate's votes, one that finds the loser and moves
the rows and the shifted profiles; every other step runs the ``mlx`` ops).

Deviations from the paper:
    * ``window - 1`` recent tokens are protected instead of ``window``: the window's oldest
      token competes like every other, so ``window=1`` is TOVA's rule exactly.
    * ``n_sink`` protects the first tokens; the paper protects none.
    * Without real queries a token's key stands in for its query (key-as-query proxy).
    * A profile is averaged over the kv head's query heads before the voters combine, so with
      ``aggregate='max'`` and grouped queries the max is taken over the group means.
    * ``per_head=False`` keeps one token set per layer (scores averaged over kv heads).

Memory: the profiles add ``4 * (window - 1)`` bytes per stored token and kv head (28 B at the
default window 8), counted by :func:`morphkv_bytes`.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..accounting import state_nbytes
from ..attention import candidate_weights, scoring_queries
from ..registry import dispatch, prepare_init, register

__all__ = ["MorphKVState", "morphkv_init", "morphkv_update", "morphkv_get_kv", "morphkv_bytes"]

KEY = "morphkv"


class MorphKVState(NamedTuple):
    """Kept rows, their positions, and the attention profiles of the ``window - 1`` newest
    tokens over them (column ``j``: the ``j``-th of those voters, oldest first)."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    profiles: Float[Array, "b h n w"]
    budget: int
    n_sink: int
    window: int
    aggregate: str
    per_head: bool
    backend: str


def morphkv_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
                 budget: int = 512, n_sink: int = 4, window: int = 8, aggregate: str = "sum",
                 per_head: bool = True, backend: str = "auto") -> MorphKVState:
    """Empty MorphKV state keeping at most ``budget`` tokens per head (sinks included)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, n_sink=n_sink, window=window,
                                   aggregate=aggregate, per_head=per_head))
    profiles = mx.zeros((batch, kv_heads, 0, window - 1), mx.float32)
    return MorphKVState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), profiles, **p,
                        backend=backend)


def _update_mlx(state: MorphKVState, keys, values, queries) -> MorphKVState:
    n, s = state.keys.shape[2], keys.shape[2]
    b, h = state.positions.shape[:2]
    keep, over = state.window - 1, n + s > state.budget
    m = min(state.window, s) if over else min(keep, s)  # this update's voters that matter
    prof = mx.concatenate([state.profiles, mx.zeros((b, h, s, keep), mx.float32)], axis=2)
    if m:  # the newest m queries' profiles over the candidates, one column each
        q = scoring_queries(keys, queries)[:, :, :, s - m:]
        w = candidate_weights(q, state.keys, keys).mean(axis=2)  # [b, h, m, n+s], causal
        prof = mx.concatenate([prof, w.swapaxes(-1, -2)], axis=3)
    idx = None
    if over:
        votes = prof[..., prof.shape[3] - state.window:]
        score = votes.sum(axis=-1) if state.aggregate == "sum" else votes.max(axis=-1)
        if not state.per_head:
            score = score.mean(axis=1, keepdims=True)
        idx = evict.top_budget(score, state.budget, evict.protected(n + s, state.n_sink, keep))
        idx = mx.broadcast_to(idx, state.positions.shape[:2] + idx.shape[2:])
    prof = prof[..., prof.shape[3] - keep:]
    k, v, p, pr = evict.keep_rows(
        (state.keys, state.values, state.positions, prof[:, :, :n]),
        (keys, values, evict.new_positions(state.next_pos, s), prof[:, :, n:]), idx)
    return state._replace(keys=k, values=v, positions=p, profiles=pr, next_pos=state.next_pos + s)


def _decode_cuda(state: MorphKVState, keys, values, queries) -> MorphKVState:
    from ..kernels.evict import compact, weights
    rows = (state.keys, state.values, state.positions, keys, values, state.next_pos)
    keep, shared = state.window - 1, not state.per_head
    if not keep:  # window 1: TOVA's step, no stored profiles
        w, _ = weights(queries, state.keys, keys)
        return evict.with_compacted(state, compact(*rows, by=w, shared=shared, n_sink=state.n_sink))
    w, votes = weights(queries, state.keys, keys, old=state.profiles,
                       accumulate="vote_sum" if state.aggregate == "sum" else "vote_max")
    return evict.with_compacted(state, compact(
        *rows, by=votes, profiles=(state.profiles, w), shared=shared, n_sink=state.n_sink,
        recent=keep), carried="profiles")


def _update_reference(state: MorphKVState, keys, values, queries) -> MorphKVState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    s = keys.shape[2]
    keep, over = state.window - 1, N > state.budget
    m = min(state.window, s) if over else min(keep, s)
    q = ref.scoring_queries(c.new_keys, c.queries)  # [b, h, g, s, d]
    prof = np.zeros((b, h, N, keep + m))
    prof[:, :, : N - s, :keep] = ref.to_np(state.profiles)
    for i in range(b):
        for j in range(h):  # voter t (of the newest m) sits at candidate slot N - m + t
            pos = c.positions[i, j]
            w = ref.attention_weights(q[i, j, :, s - m:].astype(np.float64), c.keys[i, j], pos,
                                      pos[N - m:])
            prof[i, j, :, keep:] = w.mean(axis=0).T
    chosen = [[None] * h for _ in range(b)]
    if over:
        votes = prof[..., keep + m - state.window:]
        score = votes.sum(axis=-1) if state.aggregate == "sum" else votes.max(axis=-1)
        if not state.per_head:
            score[:] = score.mean(axis=1, keepdims=True)
        chosen = [[ref.top_budget(score[i, j], state.budget,
                                  ref.protected(c.positions[i, j], c.total[i, j], state.n_sink, keep))
                   for j in range(h)] for i in range(b)]
    return ref.keep(state, c, chosen, profiles=prof[..., m:])


def morphkv_update(state: MorphKVState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
                   *, queries: Float[Array, "b q s d"] | None = None) -> MorphKVState:
    """Append ``s`` tokens; if over budget keep those the newest ``window`` queries attend to most."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def morphkv_get_kv(state: MorphKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def morphkv_bytes(state: MorphKVState) -> int:
    """Bytes of every array the state holds (the voters' attention profiles included)."""
    return state_nbytes(state)


register(KEY, state_type=MorphKVState, init=morphkv_init, update=morphkv_update,
         get_kv=morphkv_get_kv, nbytes=morphkv_bytes,
         backends={"reference": _update_reference, "mlx": _update_mlx,
                   "cuda": evict.cuda_update(_update_mlx, lambda st: st.budget, _decode_cuda)})
