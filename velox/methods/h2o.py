"""H2O: keep the heavy hitters, the tokens with the largest accumulated attention.

A candidate's score is the attention it has received, accumulated over every query since it
arrived (decayed by ``decay`` per token) and carried in the state. Backends: ``reference``,
``mlx`` and ``cuda`` (fused kernels for a decode step at a full cache, ``velox.kernels.evict``;
every other step runs the ``mlx`` ops).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float
from ..attention import accumulated_scores, candidate_mass, scoring_queries
from ..registry import register

__all__ = ["H2OState", "State", "init", "update", "get_kv", "nbytes", "heavy_hitter_scores",
           "heavy_hitter_reference", "heavy_hitter_kernel"]

def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, grace: int = 16, decay: float = 0.98,
         backend: str = "auto") -> H2OState:
    """Empty H2O state keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head, sinks included.
        n_sink: leading tokens never evicted.
        grace: newest tokens never evicted (they have had no time to accumulate attention).
        decay: multiplier applied to accumulated scores at every token (1 = no decay).
    """
    return evict.empty_state(H2OState, locals())


H2OState = State = evict.state_type(
    "H2OState", init,
    "Kept rows, their absolute positions and accumulated attention ``scores``.",
    scores=Float[Array, "b h n"])


def heavy_hitter_scores(state, keys, values, queries, evicting=True, mass=candidate_mass) -> evict.Scored:
    """H2O's score on any state with ``keys``, ``scores`` and ``decay`` fields: the stored
    scores decayed plus the chunk's attention mass (``mass`` as in
    :func:`velox.attention.accumulated_scores`), carried as the new ``scores``."""
    old, new = accumulated_scores(state.scores, scoring_queries(keys, queries), state.keys, keys,
                                  state.decay, mass=mass)
    return evict.Scored(mx.concatenate([old, new], axis=2), {"scores": (old, new)})


def heavy_hitter_reference(state, head: ref.Head) -> tuple:
    """One head of :func:`heavy_hitter_scores`, token by token: decay, then add the query's
    attention (the mean over the kv head's query heads)."""
    N, s, pos = len(head.positions), head.s, head.positions
    acc = np.zeros(N)
    acc[: N - s] = head.carried["scores"]
    for t in range(s):
        w = ref.attention_weights(head.probes[:, t:t + 1], head.keys, pos, pos[N - s + t:][:1])
        acc = acc * state.decay + w[:, 0].mean(0)
    return acc, {"scores": acc}


def heavy_hitter_kernel(state, keys, values, queries, gumbel=None) -> dict:
    """The fused decode step's input (``velox.kernels.evict``): the step's attention
    accumulated into the scores (with ``gumbel``, Keyformer's noise added to its logits)."""
    from ..kernels.evict import weights
    _, scores = weights(queries, state.keys, keys, old=state.scores, accumulate="decay",
                        decay=state.decay, gumbel=gumbel)
    return dict(by=scores, carry=scores)


method = register("h2o", H2OState, init,
                  evict.score_and_keep(heavy_hitter_scores, heavy_hitter_reference,
                                       kernel=heavy_hitter_kernel, carry=("scores",)))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
