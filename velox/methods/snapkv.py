"""SnapKV: at prefill, keep the prompt tokens the observation window votes for.

References:
    Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen. SnapKV: LLM Knows What You
    are Looking for Before Generation. NeurIPS 2024. arXiv:2404.14469.

A chunk of ``s > 1`` tokens is prefill: the last ``min(obs_window, s)`` queries vote (summed
attention), votes are pooled over neighbouring positions (``kernel_size``, ``pooling``), and
the union of stored and new tokens is cut to ``budget``: sinks, the ``obs_window`` newest
tokens and the best-voted rest. A chunk of one token is decode: appended, never evicted.

Deviations from the paper:
    * ``n_sink`` protects the first tokens (the paper protects none; ``n_sink=0`` is the paper).
    * A prompt may arrive in several chunks; each chunk re-selects over stored + new, so the
      budget holds over their union. The paper compresses one whole prompt.
    * Without real queries the window's keys stand in for its queries (key-as-query proxy).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..accounting import state_nbytes
from ..attention import candidate_mass, scoring_queries
from ..registry import dispatch, prepare_init, register

__all__ = ["SnapKVState", "snapkv_init", "snapkv_update", "snapkv_get_kv", "snapkv_bytes"]

KEY = "snapkv"


class SnapKVState(NamedTuple):
    """Kept rows and their absolute positions."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    budget: int
    obs_window: int
    n_sink: int
    kernel_size: int
    pooling: str
    backend: str


def snapkv_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
                budget: int = 512, obs_window: int = 32, n_sink: int = 4, kernel_size: int = 5,
                pooling: str = "avgpool", backend: str = "auto") -> SnapKVState:
    """Empty SnapKV state; prefill chunks are cut to ``budget`` tokens per head."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, obs_window=obs_window, n_sink=n_sink,
                                   kernel_size=kernel_size, pooling=pooling))
    return SnapKVState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), **p, backend=backend)


def _pool_mlx(x: mx.array, kernel: int, pooling: str) -> mx.array:
    """1-D pooling along the last axis, stride 1, 'same' padding (avg counts the padding).

    A non-finite vote pools as the padding does (so its neighbours keep theirs) and its own
    pooled score is ``-inf``, the lowest rank (the non-finite rule of ``velox.evict``).
    """
    if kernel == 1:
        return x
    pad_value = 0.0 if pooling == "avgpool" else -mx.inf
    bad = ~mx.isfinite(x)
    out = _pool_finite(mx.where(bad, pad_value, x), kernel, pooling, pad_value)
    return mx.where(bad, -mx.inf, out)


def _pool_finite(x: mx.array, kernel: int, pooling: str, pad_value: float) -> mx.array:
    r = kernel // 2
    xp = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(r, r)], constant_values=pad_value)
    n = x.shape[-1]
    windows = [xp[..., i:i + n] for i in range(kernel)]
    if pooling == "avgpool":
        return sum(windows[1:], windows[0]) / kernel
    out = windows[0]
    for w in windows[1:]:
        out = mx.maximum(out, w)
    return out


def _update_mlx(state: SnapKVState, keys, values, queries) -> SnapKVState:
    n, s = state.keys.shape[2], keys.shape[2]
    idx = None
    if s > 1 and n + s > state.budget:
        w = min(state.obs_window, s)
        q = scoring_queries(keys, queries)[:, :, :, s - w:]
        votes = candidate_mass(q, state.keys, keys)
        prefix = n + s - state.obs_window  # the window itself is protected; pool the prefix only
        pooled = _pool_mlx(votes[:, :, :prefix], state.kernel_size, state.pooling)
        votes = mx.concatenate([pooled, votes[:, :, prefix:]], axis=2)
        idx = evict.top_budget(votes, state.budget,
                               evict.protected(n + s, state.n_sink, state.obs_window))
    k, v, p = evict.keep_rows((state.keys, state.values, state.positions),
                              (keys, values, evict.new_positions(state.next_pos, s)), idx)
    return state._replace(keys=k, values=v, positions=p, next_pos=state.next_pos + s)


def _pool_reference(x: np.ndarray, kernel: int, pooling: str) -> np.ndarray:
    r = kernel // 2
    pad = 0.0 if pooling == "avgpool" else -np.inf
    out = np.empty_like(x)
    for t in range(len(x)):  # a non-finite vote pools as padding; its own score is -inf
        window = [x[u] if 0 <= u < len(x) and np.isfinite(x[u]) else pad
                  for u in range(t - r, t + r + 1)]
        out[t] = (sum(window) / kernel if pooling == "avgpool" else max(window)) if np.isfinite(x[t]) else -np.inf
    return out


def _update_reference(state: SnapKVState, keys, values, queries) -> SnapKVState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    s = keys.shape[2]
    if s == 1 or N <= state.budget:
        return ref.keep(state, c, [[None] * h for _ in range(b)])
    w = min(state.obs_window, s)
    q = ref.scoring_queries(c.new_keys, c.queries)[:, :, :, s - w:]
    prefix = N - state.obs_window
    chosen = []
    for i in range(b):
        chosen.append([])
        for j in range(h):
            pos = c.positions[i, j]
            weights = ref.attention_weights(q[i, j], c.keys[i, j], pos, pos[N - w:])  # [g, w, N]
            votes = weights.sum(axis=1).mean(axis=0)
            votes[:prefix] = _pool_reference(votes[:prefix], state.kernel_size, state.pooling)
            keep = ref.protected(pos, c.total[i, j], state.n_sink, state.obs_window)
            chosen[i].append(ref.top_budget(votes, state.budget, keep))
    return ref.keep(state, c, chosen)


def snapkv_update(state: SnapKVState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
                  *, queries: Float[Array, "b q s d"] | None = None) -> SnapKVState:
    """Prefill chunk (``s > 1``): select to ``budget``; decode token (``s == 1``): append."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def snapkv_get_kv(state: SnapKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def snapkv_bytes(state: SnapKVState) -> int:
    """Bytes of every array the state holds."""
    return state_nbytes(state)


register(KEY, state_type=SnapKVState, init=snapkv_init, update=snapkv_update,
         get_kv=snapkv_get_kv, nbytes=snapkv_bytes,
         backends={"reference": _update_reference, "mlx": _update_mlx})
