"""Heavy-hitter scores: the attention a token has received, accumulated over every query since
it arrived (decayed by the state's ``decay`` per token), carried per token as ``scores``.

H2O's rule, and the score of every method built on it: H2O and SqueezeAttention evict by it,
Keyformer perturbs its attention with Gumbel noise, CaM merges its losers, ChunkKV averages it
over chunks. Each function works on any state with ``keys``, ``scores`` and ``decay`` fields;
the three are the ``mlx`` score, the one-head ``reference`` and the ``cuda`` kernel input of
``velox.evict.score_and_keep``. Both scores read the stored keys only as attention logits
(``velox.attention``: :class:`velox.attention.CodedKeys` are scored by their codec).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np

from . import evict
from . import reference as ref
from .attention import accumulated_scores, candidate_mass, head_weights, scoring_queries

__all__ = ["heavy_hitter_scores", "heavy_hitter_reference", "heavy_hitter_inputs", "heavy_hitter_kernel"]


def heavy_hitter_scores(state, keys, values, queries, evicting=True, mass=candidate_mass) -> evict.Scored:
    """H2O's score on any state with ``keys``, ``scores`` and ``decay`` fields: the stored
    scores decayed plus the chunk's attention mass (``mass`` as in
    :func:`velox.attention.accumulated_scores`), carried as the new ``scores``."""
    if evict.empty_slots(state):  # amortized eviction: an empty slot receives no attention
        if mass is not candidate_mass:
            raise ValueError("empty slots take the plain heavy-hitter mass only")
        mass = partial(candidate_mass, noise=_empty_slots_bias(state.positions))
    old, new = accumulated_scores(state.scores, scoring_queries(keys, queries), state.keys, keys,
                                  state.decay, mass=mass)
    return evict.Scored(mx.concatenate([old, new], axis=2), {"scores": (old, new)})


def _empty_slots_bias(positions):
    """``candidate_mass``'s ``noise``: ``-inf`` on the logits of the empty slots (position
    ``-1``), 0 on the filled ones and the new tokens."""
    bias = mx.where(positions < 0, -mx.inf, 0.0)[:, :, None, None, :]

    def noise(start, stop, visible):
        b, h = positions.shape[:2]
        return mx.concatenate([bias, mx.zeros((b, h, 1, 1, visible), bias.dtype)], axis=-1)
    return noise


def heavy_hitter_reference(state, head: ref.Head) -> tuple:
    """One head of :func:`heavy_hitter_scores`, token by token: decay, then add the query's
    attention (the mean over the kv head's query heads)."""
    N, s, pos = len(head.positions), head.s, head.positions
    acc = np.zeros(N)
    acc[: N - s] = head.carried["scores"]
    for t in range(s):
        w = head_weights(head.probes[:, t:t + 1], head.keys, pos, pos[N - s + t:][:1])
        acc = acc * state.decay + w[:, 0].mean(0)
    return acc, {"scores": acc}


def heavy_hitter_inputs(state, keys, values, queries, gumbel=None, attend: bool = False) -> dict:
    """The fused decode step's input (``velox.kernels.evict``): the step's attention
    accumulated into the scores (with ``gumbel``, Keyformer's noise added to its logits);
    with ``attend`` (and no noise) also the step's attention output, ``out``."""
    from .kernels.evict import attend_weights, weights
    if attend and gumbel is None:  # the step's attention output from the same softmax
        out, _, scores = attend_weights(queries, state.keys, state.values, keys, values,
                                        old=state.scores, accumulate="decay", decay=state.decay)
        return dict(by=scores, carry=scores, out=out)
    _, scores = weights(queries, state.keys, keys, old=state.scores, accumulate="decay",
                        decay=state.decay, gumbel=gumbel)
    return dict(by=scores, carry=scores)


# a whole decode step in kernels.evict.attend_select: ranked by the decayed sum it carries
heavy_hitter_kernel = evict.ScoreKernel(
    heavy_hitter_inputs, attends=True,
    select_args=lambda state: dict(by="carried", accumulate="decay", old=state.scores,
                                   decay=state.decay, carry=True))
