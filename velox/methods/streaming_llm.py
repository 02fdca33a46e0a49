"""StreamingLLM: keep the attention sinks and a window of the most recent tokens.

References:
    Xiao, Tian, Chen, Han, Lewis. Efficient Streaming Language Models with Attention Sinks.
    ICLR 2024. arXiv:2309.17453.

Backends: ``reference``, ``mlx`` and ``cuda`` (fused kernels for a decode step at a full
cache, ``velox.kernels.evict``; every other step runs the ``mlx`` ops).

Deviations from the paper:
    * Kept tokens keep their original absolute positions (the adapter's RoPE offset is the
      true position); the paper re-indexes positions inside the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..accounting import state_nbytes
from ..registry import dispatch, prepare_init, register

__all__ = ["StreamingLLMState", "streaming_llm_init", "streaming_llm_update",
           "streaming_llm_get_kv", "streaming_llm_bytes"]

KEY = "streaming_llm"


class StreamingLLMState(NamedTuple):
    """Sinks + recency window. ``positions`` are absolute; ``next_pos`` = tokens seen."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    n_sink: int
    window_size: int
    backend: str


def streaming_llm_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
                       n_sink: int = 4, window_size: int = 512,
                       backend: str = "auto") -> StreamingLLMState:
    """Empty state keeping ``n_sink`` sinks and the ``window_size`` newest tokens."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(n_sink=n_sink, window_size=window_size))
    return StreamingLLMState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), **p, backend=backend)


def _update_mlx(state: StreamingLLMState, keys, values, queries) -> StreamingLLMState:
    n, s = state.keys.shape[2], keys.shape[2]
    sink, window = state.n_sink, state.window_size
    idx = None
    if n + s > sink + window:  # keep the first `sink` candidates and the last `window`
        keep = mx.concatenate([mx.arange(sink), mx.arange(n + s - window, n + s)]).astype(mx.int32)
        idx = mx.broadcast_to(keep, state.positions.shape[:2] + keep.shape)
    k, v, p = evict.keep_rows((state.keys, state.values, state.positions),
                              (keys, values, evict.new_positions(state.next_pos, s)), idx)
    return state._replace(keys=k, values=v, positions=p, next_pos=state.next_pos + s)


def _decode_cuda(state: StreamingLLMState, keys, values, queries) -> StreamingLLMState:
    from ..kernels.evict import compact
    # the loser is the oldest non-sink token, or the new one when there is no window
    drop = state.n_sink if state.window_size else state.keys.shape[2]
    return evict.with_compacted(state, compact(
        state.keys, state.values, state.positions, keys, values, state.next_pos, drop=drop))


def _update_reference(state: StreamingLLMState, keys, values, queries) -> StreamingLLMState:
    # Executable spec: score every candidate by recency, protect the sinks, keep the best.
    c = ref.candidates(state, keys, values, queries)
    budget = state.n_sink + state.window_size
    chosen = [[ref.top_budget(p.astype(np.float64), budget, p < state.n_sink) for p in row]
              for row in c.positions]
    return ref.keep(state, c, chosen)


def streaming_llm_update(state: StreamingLLMState, keys: Float[Array, "b h s d"],
                         values: Float[Array, "b h s d"], *,
                         queries: Float[Array, "b q s d"] | None = None) -> StreamingLLMState:
    """Append ``s`` tokens and keep the sinks plus the ``window_size`` newest (queries unused)."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def streaming_llm_get_kv(state: StreamingLLMState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def streaming_llm_bytes(state: StreamingLLMState) -> int:
    """Bytes of every array the state holds."""
    return state_nbytes(state)


register(KEY, state_type=StreamingLLMState, init=streaming_llm_init, update=streaming_llm_update,
         get_kv=streaming_llm_get_kv, nbytes=streaming_llm_bytes,
         backends={"reference": _update_reference, "mlx": _update_mlx,
                   "cuda": evict.cuda_update(_update_mlx, lambda st: st.n_sink + st.window_size,
                                             _decode_cuda)})
