"""MorphKV: keep the tokens the most recent window of queries attends to.

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

Memory: the profiles add ``4 * (window - 1)`` bytes per stored token and kv head (28 B at the
default window 8), counted by ``nbytes``.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..attention import candidate_weights, scoring_queries
from ..distributed import LOCAL, Heads
from ..registry import register

__all__ = ["MorphKVState", "State", "init", "update", "get_kv", "nbytes"]


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
    heads: Heads  # where its kv heads sit among the layer's (velox.distributed)
    backend: str
    ragged: bool = False  # batch rows hold different numbers of tokens (velox.ragged)


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, window: int = 8, aggregate: str = "sum",
         per_head: bool = True, heads: Heads = LOCAL, backend: str = "auto") -> MorphKVState:
    """Empty MorphKV state keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head, sinks and recent window included.
        n_sink: leading tokens never evicted.
        window: newest tokens whose queries vote; the window - 1 newest are never evicted
            (1 = TOVA).
        aggregate: how the voters' attention profiles combine into a token's score.
        per_head: each kv head keeps its own tokens (false: one set per layer, attention
            averaged over heads).
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): one
            selection for the layer gathers every shard's votes.
    """
    return evict.empty_state(MorphKVState, locals(),
                             profiles=mx.zeros((batch, kv_heads, 0, window - 1), mx.float32))


def _voters(state: MorphKVState, s: int, evicting: bool) -> int:
    """How many of this update's ``s`` newest queries matter: the ``window`` voters when it
    evicts, else the ``window - 1`` whose profiles the state keeps."""
    return min(state.window, s) if evicting else min(state.window - 1, s)


def _vote(state: MorphKVState, votes):
    return votes.sum(axis=-1) if state.aggregate == "sum" else votes.max(axis=-1)


def _score(state: MorphKVState, keys, values, queries, evicting) -> evict.Scored:
    """The voters' profiles over the candidates (the stored ones, then this update's newest
    queries', one column each); the score, when evicting, combines the newest ``window``."""
    s = keys.shape[2]
    b, h = state.positions.shape[:2]
    keep, m = state.window - 1, _voters(state, s, evicting)
    prof = mx.concatenate([state.profiles, mx.zeros((b, h, s, keep), mx.float32)], axis=2)
    if m:  # the newest m queries' profiles over the candidates, one column each
        q = scoring_queries(keys, queries)[:, :, :, s - m:]
        w = candidate_weights(q, state.keys, keys).mean(axis=2)  # [b, h, m, n+s], causal
        prof = mx.concatenate([prof, w.swapaxes(-1, -2)], axis=3)
    score = _vote(state, prof[..., prof.shape[3] - state.window:]) if evicting else None
    return evict.Scored(score, {"profiles": prof[..., prof.shape[3] - keep:]})


def _score_reference(state: MorphKVState, head: ref.Head) -> evict.Scored:
    N, s, pos = len(head.positions), head.s, head.positions
    keep, m = state.window - 1, _voters(state, s, head.evicting)
    prof = np.zeros((N, keep + m))
    prof[: N - s, :keep] = head.carried["profiles"]
    # voter t (of the newest m) sits at candidate slot N - m + t
    w = ref.attention_weights(head.probes[:, s - m:], head.keys, pos, pos[N - m:])
    prof[:, keep:] = w.mean(axis=0).T
    score = _vote(state, prof[:, keep + m - state.window:]) if head.evicting else None
    return evict.Scored(score, {"profiles": prof[:, m:]})


def _kernel(state: MorphKVState, keys, values, queries) -> dict:
    """The fused decode step's input: the new query's profile and every candidate's votes
    (window 1: TOVA's step, no stored profiles)."""
    from ..kernels.evict import weights
    if state.window == 1:
        w, _ = weights(queries, state.keys, keys)
        return dict(by=w)
    w, votes = weights(queries, state.keys, keys, old=state.profiles,
                       accumulate="vote_sum" if state.aggregate == "sum" else "vote_max")
    return dict(by=votes, profiles=(state.profiles, w))


State = MorphKVState
method = register("morphkv", MorphKVState, init,
                  evict.score_and_keep(_score, _score_reference, kernel=evict.ScoreKernel(_kernel),
                                       carry=("profiles",)))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
