"""H2O: keep the heavy hitters, the tokens with the largest accumulated attention.

References:
    Zhang, Sheng, Zhou, Chen, Zheng, Cai, Song, Tian, Re, Barrett, Wang, Chen.
    H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models.
    NeurIPS 2023. arXiv:2306.14048.

Backends: ``reference``, ``mlx`` and ``cuda`` (fused kernels for a decode step at a full
cache, ``velox.kernels.evict``; every other step runs the ``mlx`` ops).

Deviations from the paper:
    * ``grace`` newest tokens are never evicted (the paper's recent-token share of the budget)
      and ``decay`` multiplies old scores each step; ``grace=0, decay=1`` is the paper's rule.
    * ``n_sink`` protects the first tokens.
    * A multi-token chunk is one selection: every query of the chunk adds its (causal)
      attention, the i-th of ``s`` weighted by ``decay**(s-1-i)``, which equals token-by-token
      accumulation when nothing is evicted inside the chunk.
    * GQA: a kv head's score is the mean over the query heads that read it.
    * Without real queries the new keys stand in for their own queries (key-as-query proxy).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..accounting import state_nbytes
from ..attention import accumulated_scores, candidate_mass, scoring_queries
from ..registry import dispatch, prepare_init, register

__all__ = ["H2OState", "h2o_init", "h2o_update", "h2o_get_kv", "h2o_bytes"]

KEY = "h2o"


class H2OState(NamedTuple):
    """Kept rows, their absolute positions and accumulated attention ``scores``."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    scores: Float[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    budget: int
    n_sink: int
    grace: int
    decay: float
    backend: str


def h2o_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
             budget: int = 512, n_sink: int = 4, grace: int = 16, decay: float = 0.98,
             backend: str = "auto") -> H2OState:
    """Empty H2O state keeping at most ``budget`` tokens per head (sinks included)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, n_sink=n_sink, grace=grace, decay=decay))
    k, v, pos, nxt = evict.empty_rows(batch, kv_heads, head_dim, dtype)
    scores = mx.zeros((batch, kv_heads, 0), mx.float32)
    return H2OState(k, v, pos, scores, nxt, **p, backend=backend)


def heavy_hitters(state, keys, values, queries, recent: int, mass=candidate_mass) -> tuple:
    """H2O's selection on any state with its fields (``keys``, ``values``, ``positions``,
    ``scores``, ``next_pos``, ``budget``, ``n_sink``, ``decay``): accumulate the chunk's
    attention mass (``mass`` as in :func:`accumulated_scores`), protect the sinks and the
    ``recent`` newest candidates, keep the ``budget`` heaviest.

    Returns ``(stored, fresh, idx)``: the stored and the new ``(keys, values, positions,
    scores)`` and the kept candidate indices (``None`` keeps all), for :func:`evict.keep_rows`
    or a merge.
    """
    n, s = state.keys.shape[2], keys.shape[2]
    old, new = accumulated_scores(state.scores, scoring_queries(keys, queries), state.keys, keys,
                                  state.decay, mass=mass)
    idx = evict.top_budget(mx.concatenate([old, new], axis=2), state.budget,
                           evict.protected(n + s, state.n_sink, recent))
    return ((state.keys, state.values, state.positions, old),
            (keys, values, evict.new_positions(state.next_pos, s), new), idx)


def _update_mlx(state: H2OState, keys, values, queries) -> H2OState:
    stored, fresh, idx = heavy_hitters(state, keys, values, queries, state.grace)
    k, v, p, sc = evict.keep_rows(stored, fresh, idx)
    return state._replace(keys=k, values=v, positions=p, scores=sc,
                          next_pos=state.next_pos + keys.shape[2])


def heavy_hitters_step(state, keys, values, queries, recent: int, gumbel=None):
    """H2O's decode step at a full cache in the fused kernels (``velox.kernels.evict``), on any
    state with :func:`heavy_hitters`' fields: accumulate the step's attention (with
    ``gumbel``, Keyformer's noise added to its logits, see ``weights``), protect the sinks
    and the ``recent`` newest candidates, drop the lightest and compact the rows and scores.
    Returns the new state."""
    from ..kernels.evict import compact, weights
    _, scores = weights(queries, state.keys, keys,
                        old=state.scores, accumulate="decay", decay=state.decay, gumbel=gumbel)
    return evict.with_compacted(state, compact(
        state.keys, state.values, state.positions, keys, values, state.next_pos, by=scores,
        carry=scores, n_sink=state.n_sink, recent=recent))


def _decode_cuda(state: H2OState, keys, values, queries) -> H2OState:
    return heavy_hitters_step(state, keys, values, queries, state.grace)


def _update_reference(state: H2OState, keys, values, queries) -> H2OState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    s = keys.shape[2]
    q = ref.scoring_queries(c.new_keys, c.queries)
    old = ref.to_np(state.scores)
    acc = np.zeros((b, h, N))
    chosen = []
    for i in range(b):
        chosen.append([])
        for j in range(h):
            pos = c.positions[i, j]
            acc[i, j, : N - s] = old[i, j]
            for t in range(s):  # token by token: decay, then add this query's attention
                w = ref.attention_weights(q[i, j, :, t:t + 1], c.keys[i, j], pos, pos[N - s + t:][:1])
                acc[i, j] = acc[i, j] * state.decay + w[:, 0].mean(0)
            keep = ref.protected(pos, c.total[i, j], state.n_sink, state.grace)
            chosen[i].append(ref.top_budget(acc[i, j], state.budget, keep))
    return ref.keep(state, c, chosen, scores=acc)


def h2o_update(state: H2OState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
               *, queries: Float[Array, "b q s d"] | None = None) -> H2OState:
    """Append ``s`` tokens, accumulate their attention, keep the ``budget`` heaviest."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def h2o_get_kv(state: H2OState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def h2o_bytes(state: H2OState) -> int:
    """Bytes of every array the state holds (scores included)."""
    return state_nbytes(state)


_update_cuda = evict.cuda_update(_update_mlx, lambda st: st.budget, _decode_cuda)

register(KEY, state_type=H2OState, init=h2o_init, update=h2o_update, get_kv=h2o_get_kv,
         nbytes=h2o_bytes, backends={"reference": _update_reference, "mlx": _update_mlx,
                                      "cuda": _update_cuda})
