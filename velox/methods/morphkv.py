"""MorphKV: keep the tokens the most recent window of queries attends to; memoryless.

References:
    Ghadia, Kumar, Jain, Nair, Das. Dialogue Without Limits: Constant-Sized KV Caches for
    Extended Responses in LLMs. ICML 2025. arXiv:2503.00979.

Rule: the ``window`` newest tokens vote (the chunk's newest queries, preceded where the chunk
is shorter than the window by the stored real queries of the tokens before it); each candidate
(stored + new) scores the sum (or max) over voters of the causal attention it receives, averaged
over the kv head's query heads. Sinks and the ``window - 1`` newest tokens (the next update's
voters) are protected; the ``budget`` best candidates are kept. A chunk is one selection.

Deviations from the paper:
    * ``window - 1`` recent tokens are protected instead of ``window``: the window's oldest
      token competes like every other, so ``window=1`` is TOVA's rule exactly.
    * ``n_sink`` protects the first tokens; the paper protects none.
    * Without real queries the voters' keys stand in for their queries (key-as-query proxy);
      an update whose query head count differs from the stored voters' restarts the window.
    * The voters' attention is recomputed over the current candidates at every update (the
      paper reuses each recent token's attention profile from its own step).
    * ``per_head=False`` keeps one token set per layer (attention averaged over kv heads).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..accounting import state_nbytes
from ..attention import candidate_weights, group_queries
from ..registry import dispatch, prepare_init, register

__all__ = ["MorphKVState", "morphkv_init", "morphkv_update", "morphkv_get_kv", "morphkv_bytes"]

KEY = "morphkv"


class MorphKVState(NamedTuple):
    """Kept rows, their positions, and the real queries of the newest ``window - 1`` tokens."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    voters: Float[Array, "b h g m d"]  # queries of the m <= window-1 newest tokens (g=0: none)
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
    voters = mx.zeros((batch, kv_heads, 0, 0, head_dim), dtype)
    return MorphKVState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), voters, **p,
                        backend=backend)


def _voters_mlx(state: MorphKVState, keys, queries) -> tuple[mx.array, mx.array]:
    """Scoring queries of the newest ``W`` candidates ``[b, h, g, W, d]`` and the new buffer."""
    n, s = state.keys.shape[2], keys.shape[2]
    keep = state.window - 1
    if queries is None:  # proxies: the newest stored keys (protected, so still stored) and the new
        w = min(state.window, n + s)
        prev = state.keys[:, :, n - (w - s):] if w > s else state.keys[:, :, :0]
        voters = mx.concatenate([prev, keys], axis=2)[:, :, -w:][:, :, None]
        b, h, _, d = keys.shape
        return voters, mx.zeros((b, h, 0, 0, d), keys.dtype)
    q = group_queries(queries, keys.shape[1])  # [b, h, g, s, d]
    prev = state.voters if state.voters.shape[2] == q.shape[2] else state.voters[:, :, :0, :0]
    if prev.shape[3]:
        q = mx.concatenate([prev.astype(q.dtype), q], axis=3)
    voters = q[:, :, :, -state.window:]
    buffer = q[:, :, :, q.shape[3] - min(keep, q.shape[3]):] if keep else q[:, :, :, :0]
    return voters, buffer.astype(keys.dtype)


def _update_mlx(state: MorphKVState, keys, values, queries) -> MorphKVState:
    n, s = state.keys.shape[2], keys.shape[2]
    voters, buffer = _voters_mlx(state, keys, queries)
    idx = None
    if n + s > state.budget:
        w = candidate_weights(voters, state.keys, keys)  # [b, h, g, W, n+s], causal on slots
        score = (w.sum(axis=3) if state.aggregate == "sum" else w.max(axis=3)).mean(axis=2)
        if not state.per_head:
            score = score.mean(axis=1, keepdims=True)
        idx = evict.top_budget(score, state.budget,
                               evict.protected(n + s, state.n_sink, state.window - 1))
        idx = mx.broadcast_to(idx, state.positions.shape[:2] + idx.shape[2:])
    k, v, p = evict.keep_rows((state.keys, state.values, state.positions),
                              (keys, values, evict.new_positions(state.next_pos, s)), idx)
    return state._replace(keys=k, values=v, positions=p, voters=buffer,
                          next_pos=state.next_pos + s)


def _update_reference(state: MorphKVState, keys, values, queries) -> MorphKVState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    keep = state.window - 1
    if c.queries is None:  # proxies: every candidate's key stands in for its query
        q = c.keys.astype(np.float64)[:, :, None]
        buffer = np.zeros((b, h, 0, 0, keys.shape[3]))
    else:
        q = ref.scoring_queries(c.new_keys, c.queries)  # [b, h, g, s, d]
        prev = ref.to_np(state.voters)
        if prev.shape[2] == q.shape[2] and prev.shape[3]:
            q = np.concatenate([prev, q], axis=3)
        buffer = q[:, :, :, q.shape[3] - min(keep, q.shape[3]):] if keep else q[:, :, :, :0]
    W = min(state.window, q.shape[3])
    voters = q[:, :, :, q.shape[3] - W:]
    buffer = ref.to_mx(buffer, state.keys.dtype)
    if N <= state.budget:
        return ref.keep(state, c, [[None] * h for _ in range(b)])._replace(voters=buffer)
    score = np.zeros((b, h, N))
    for i in range(b):
        for j in range(h):  # voter t sits at candidate slot N - W + t (the newest tokens)
            pos = c.positions[i, j]
            w = ref.attention_weights(voters[i, j].astype(np.float64), c.keys[i, j], pos, pos[N - W:])
            score[i, j] = (w.sum(axis=1) if state.aggregate == "sum" else w.max(axis=1)).mean(0)
    if not state.per_head:
        score[:] = score.mean(axis=1, keepdims=True)
    chosen = [[ref.top_budget(score[i, j], state.budget,
                              ref.protected(c.positions[i, j], c.total[i, j], state.n_sink, keep))
               for j in range(h)] for i in range(b)]
    return ref.keep(state, c, chosen)._replace(voters=buffer)


def morphkv_update(state: MorphKVState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
                   *, queries: Float[Array, "b q s d"] | None = None) -> MorphKVState:
    """Append ``s`` tokens; if over budget keep those the newest ``window`` queries attend to most."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def morphkv_get_kv(state: MorphKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def morphkv_bytes(state: MorphKVState) -> int:
    """Bytes of every array the state holds (the voters' queries included)."""
    return state_nbytes(state)


register(KEY, state_type=MorphKVState, init=morphkv_init, update=morphkv_update,
         get_kv=morphkv_get_kv, nbytes=morphkv_bytes,
         backends={"reference": _update_reference, "mlx": _update_mlx})
