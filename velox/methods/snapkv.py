"""SnapKV: at prefill, keep the prompt tokens the observation window votes for.

A chunk of ``s > 1`` tokens is prefill: the last ``min(obs_window, s)`` queries vote (summed
attention), votes are pooled over neighbouring positions (``kernel_size``, ``pooling``), and
the union of stored and new tokens is cut to ``budget``: sinks, the ``obs_window`` newest
tokens and the best-voted rest. A chunk of one token is decode: appended, never evicted (into
empty slots added as needed, ``velox.evict.grow_by`` at a time, written in place; see
``velox.evict``).

The votes (:func:`votes`, and :func:`votes_reference` for one head in NumPy) are the score of
PyramidKV's layers and of RocketKV's first stage as well. Backends: ``reference`` and ``mlx``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float
from ..attention import candidate_mass, head_weights, scoring_queries, stored_count
from ..registry import register

__all__ = ["SnapKVState", "State", "init", "update", "get_kv", "nbytes", "votes",
           "votes_reference"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, obs_window: int = 32, n_sink: int = 4, kernel_size: int = 5,
         pooling: str = "avgpool", backend: str = "auto") -> SnapKVState:
    """Empty SnapKV state; prefill chunks are cut to ``budget`` tokens per head.

    Args:
        budget: tokens kept per head after each prefill chunk (sinks and window included).
        obs_window: newest prompt tokens whose queries vote; they are always kept.
        n_sink: leading tokens never evicted (0 = the paper).
        kernel_size: pooling width over neighbouring positions (odd; 1 = no pooling).
        pooling: pooling of the votes.
    """
    return evict.empty_state(SnapKVState, locals())


SnapKVState = State = evict.state_type(
    "SnapKVState", init, "Kept rows and their absolute positions.", grows=True)


def _pool_mlx(x: mx.array, kernel: int, pooling: str) -> mx.array:
    """1-D pooling along the last axis, stride 1, 'same' padding (avg counts the padding).

    A non-finite vote pools as the padding does (so its neighbours keep theirs) and its own
    pooled score is ``-inf``, the lowest rank (the non-finite rule of ``velox.evict``).
    """
    if kernel == 1 or x.shape[-1] == 0:
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


def _pool_reference(x: np.ndarray, kernel: int, pooling: str) -> np.ndarray:
    r = kernel // 2
    pad = 0.0 if pooling == "avgpool" else -np.inf
    out = np.empty_like(x)
    for t in range(len(x)):  # a non-finite vote pools as padding; its own score is -inf
        window = [x[u] if 0 <= u < len(x) and np.isfinite(x[u]) else pad
                  for u in range(t - r, t + r + 1)]
        out[t] = (sum(window) / kernel if pooling == "avgpool" else max(window)) if np.isfinite(x[t]) else -np.inf
    return out


def votes(state, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
          queries: Float[Array, "b q s d"] | None, evicting: bool = True, *,
          pooling: str | None = None) -> Float[Array, "b h ns"]:
    """SnapKV's score of the ``n + s`` candidates, on any state with ``keys``, ``obs_window``,
    ``kernel_size`` (and ``pooling``, unless given): the attention the chunk's last
    ``min(obs_window, s)`` queries pay each candidate (summed over those queries, averaged over
    the kv head's query heads; the new keys stand in for absent queries), pooled over
    ``kernel_size`` neighbours in the prefix before the ``obs_window`` newest candidates (the
    window itself, always kept, keeps its own votes)."""
    n, s = stored_count(state.keys), keys.shape[2]
    w = min(state.obs_window, s)
    mass = candidate_mass(scoring_queries(keys, queries)[:, :, :, s - w:], state.keys, keys)
    prefix = max(0, n + s - state.obs_window)
    pooled = _pool_mlx(mass[:, :, :prefix], state.kernel_size, pooling or state.pooling)
    return mx.concatenate([pooled, mass[:, :, prefix:]], axis=2)


def votes_reference(state, head: ref.Head, *, pooling: str | None = None) -> np.ndarray:
    """One head of :func:`votes` (NumPy, float64): the window's causal attention summed over
    its queries, averaged over the query heads, the prefix pooled."""
    N, s, pos = len(head.positions), head.s, head.positions
    w = min(state.obs_window, s)
    weights = head_weights(head.probes[:, s - w:], head.keys, pos, pos[N - w:])  # [g, w, N]
    v = weights.sum(axis=1).mean(axis=0)
    prefix = max(0, N - state.obs_window)
    v[:prefix] = _pool_reference(v[:prefix], state.kernel_size, pooling or state.pooling)
    return v


method = register("snapkv", SnapKVState, init, evict.score_and_keep(votes, votes_reference, logits_only=True))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
