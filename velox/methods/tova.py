"""TOVA: evict the tokens the current query attends to least; memoryless.

References:
    Oren, Hassid, Yarden, Adi, Schwartz. Transformers are Multi-State RNNs. EMNLP 2024.
    arXiv:2401.06104.

Backends: ``reference``, ``mlx`` and ``cuda`` (fused kernels for a decode step at a full
cache, ``velox.kernels.evict``; every other step runs the ``mlx`` ops).

Deviations from the paper:
    * ``n_sink`` protects the first tokens (the paper protects none; ``n_sink=0`` is the paper).
    * A multi-token chunk is one selection, scored by the chunk's last query (the paper's rule
      at the last step of the chunk; it does not evict inside a prompt chunk either).
    * Without real queries the newest key stands in for the query (key-as-query proxy).
    * ``per_head=True`` lets every kv head keep its own tokens (the paper averages over all
      heads and keeps one set per layer, the default).
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

__all__ = ["TovaState", "tova_init", "tova_update", "tova_get_kv", "tova_bytes"]

KEY = "tova"


class TovaState(NamedTuple):
    """Kept rows and their absolute positions; no score memory."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    budget: int
    n_sink: int
    per_head: bool
    backend: str


def tova_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
              budget: int = 512, n_sink: int = 4, per_head: bool = False,
              backend: str = "auto") -> TovaState:
    """Empty TOVA state keeping at most ``budget`` tokens per head (sinks included)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, n_sink=n_sink, per_head=per_head))
    return TovaState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), **p, backend=backend)


def _update_mlx(state: TovaState, keys, values, queries) -> TovaState:
    n, s = state.keys.shape[2], keys.shape[2]
    idx = None
    if n + s > state.budget:
        last = scoring_queries(keys, queries)[:, :, :, -1:]
        w = candidate_weights(last, state.keys, keys)[:, :, :, 0].mean(axis=2)
        if not state.per_head:  # one selection for the layer, shared by every head
            w = w.mean(axis=1, keepdims=True)
        idx = evict.top_budget(w, state.budget, evict.protected(n + s, state.n_sink))
        idx = mx.broadcast_to(idx, state.positions.shape[:2] + idx.shape[2:])
    k, v, p = evict.keep_rows((state.keys, state.values, state.positions),
                              (keys, values, evict.new_positions(state.next_pos, s)), idx)
    return state._replace(keys=k, values=v, positions=p, next_pos=state.next_pos + s)


def _decode_cuda(state: TovaState, keys, values, queries) -> TovaState:
    from ..kernels.evict import compact, weights
    w, _ = weights(queries, state.keys, keys)
    return evict.with_compacted(state, compact(
        state.keys, state.values, state.positions, keys, values, state.next_pos, by=w,
        shared=not state.per_head, n_sink=state.n_sink))


def _update_reference(state: TovaState, keys, values, queries) -> TovaState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    if N <= state.budget:
        return ref.keep(state, c, [[None] * h for _ in range(b)])
    last = ref.scoring_queries(c.new_keys, c.queries)[:, :, :, -1:]
    w = np.zeros((b, h, N))
    for i in range(b):
        for j in range(h):  # attention of the newest query, averaged over the group's heads
            pos = c.positions[i, j]
            w[i, j] = ref.attention_weights(last[i, j], c.keys[i, j], pos, pos[-1:])[:, 0].mean(0)
    if not state.per_head:
        w[:] = w.mean(axis=1, keepdims=True)
    chosen = [[ref.top_budget(w[i, j], state.budget, c.positions[i, j] < state.n_sink)
               for j in range(h)] for i in range(b)]
    return ref.keep(state, c, chosen)


def tova_update(state: TovaState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
                *, queries: Float[Array, "b q s d"] | None = None) -> TovaState:
    """Append ``s`` tokens; if over budget keep those the newest query attends to most."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def tova_get_kv(state: TovaState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def tova_bytes(state: TovaState) -> int:
    """Bytes of every array the state holds."""
    return state_nbytes(state)


register(KEY, state_type=TovaState, init=tova_init, update=tova_update, get_kv=tova_get_kv,
         nbytes=tova_bytes, backends={"reference": _update_reference, "mlx": _update_mlx,
                                       "cuda": evict.cuda_update(_update_mlx, lambda st: st.budget,
                                                                 _decode_cuda)})
