"""NestedKV: keep the keys that are anomalous at three memory time scales; key-only, at prefill.

Score of the ``N`` candidates of a kv head (stored + new, in slot order), from their unit keys
``k_i``:

1. Anchors: stable ``mu_s`` (mean of all), episodic ``mu_e(i)`` (mean of the block of ``B =
   clip(N // 32, 128, 256)`` slots holding ``i``), current ``mu_c(i)`` (mean of the ``window``
   slots ending at ``i``).
2. Cosine anomaly ``a_x(i) = 1 - cos(k_i, mu_x)``, min-max normalised over the head (a
   scale spread below ``1e-5``, rounding noise, counts as constant: 0).
3. Head-adaptive mixing: ``Delta_x`` = mean of the top 10% of ``a_x`` minus mean of the bottom
   10%; weights ``softmax(log(0.4, 0.4, 0.2) + beta * Delta)``; ``blend = sum_x w_x a_x``.
4. Surprise gate: ``s(i)`` = std of the three scales at ``i``, min-max normalised over the head
   and mean-centred; ``g(i) = sigmoid(kappa * (s(i) - tau))``; score ``(1 - g) blend + g max_x a_x``.

A chunk of ``s > 1`` tokens (prefill) keeps sinks and the ``budget`` best of stored + new; a
single token (decode) is appended, never scored (into empty slots added as needed,
``velox.evict.grow_by`` at a time; see ``velox.evict``). Backends: ``reference`` and ``mlx``.
"""

from __future__ import annotations

import math
import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float
from ..registry import register

__all__ = ["NestedKVState", "State", "init", "update", "get_kv", "nbytes", "nestedkv_score",
           "block_size", "tail_count"]

PRIOR = (0.4, 0.4, 0.2)  # stable, episodic, current (the paper's log-prior)
_EPS = 1e-12
# Anomalies lie in [0, 2]: a spread below this is rounding noise (a window of 1 gives the key
# itself as anchor, cos = 1 up to rounding), so the scale counts as constant (all zeros).
_FLAT = 1e-5


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, window: int = 64, beta: float = 3.0,
         tau: float = 0.6, kappa: float = 10.0, safeguard_alpha: float = 0.2,
         backend: str = "auto") -> NestedKVState:
    """Empty NestedKV state; prefill chunks are cut to ``budget`` tokens per head.

    Args:
        budget: tokens kept per head after each prefill chunk (sinks included).
        n_sink: leading tokens never evicted.
        window: slots averaged by the current-memory anchor.
        beta: temperature of the head-adaptive mixing (0: the fixed prior 0.4, 0.4, 0.2).
        tau: surprise-gate threshold on the centred, normalised cross-scale spread.
        kappa: surprise-gate sharpness.
        safeguard_alpha: per-head floor of the paper's layer-wide budget pool; heads keep a
            uniform budget here, which meets it.
    """
    return evict.empty_state(NestedKVState, locals())


NestedKVState = State = evict.state_type(
    "NestedKVState", init, "Kept rows and their absolute positions.", grows=True)


def block_size(n: int) -> int:
    """Episodic block length for ``n`` tokens: ``clip(n // 32, 128, 256)``."""
    return min(256, max(128, n // 32))


def tail_count(n: int) -> int:
    """Tokens in the top (and bottom) 10% of ``n``: at least one."""
    return max(1, int(math.floor(0.1 * n + 0.5)))


def _minmax(x: mx.array) -> mx.array:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    span = hi - lo
    return mx.where(span > _FLAT, (x - lo) / mx.maximum(span, _FLAT), 0.0)


def _anomaly(u: mx.array, mu: mx.array) -> mx.array:
    """``1 - cos(u_i, mu_i)`` for unit rows ``u`` ``[..., n, d]`` and anchors ``mu``."""
    norm = mx.sqrt((mu * mu).sum(axis=-1))
    return 1.0 - (u * mu).sum(axis=-1) / mx.maximum(norm, _EPS)


def nestedkv_score(keys: Float[Array, "b h n d"], *, window: int = 64, beta: float = 3.0,
                   tau: float = 0.6, kappa: float = 10.0) -> Float[Array, "b h n"]:
    """NestedKV score of every row (higher = keep), float32. Rows of non-finite energy (NaN,
    inf, overflowing squares) are left out of the anchors and score ``-inf``."""
    k = keys.astype(mx.float32)
    b, h, n, d = k.shape
    sq = (k * k).sum(axis=-1, keepdims=True)
    bad = ~mx.isfinite(sq)
    u = mx.where(bad, 0.0, k / mx.maximum(mx.sqrt(sq), _EPS))
    stable = u.mean(axis=2, keepdims=True)
    size = block_size(n)
    nb = -(-n // size)
    padded = mx.pad(u, [(0, 0), (0, 0), (0, nb * size - n), (0, 0)])
    counts = mx.array([min(size, n - i * size) for i in range(nb)], mx.float32)[:, None]
    blocks = padded.reshape(b, h, nb, size, d).sum(axis=3) / counts
    episodic = mx.repeat(blocks, size, axis=2)[:, :, :n]
    cs = mx.cumsum(u, axis=2)
    w = min(window, n)
    before = mx.concatenate([mx.zeros((b, h, w, d), cs.dtype), cs[:, :, :n - w]], axis=2)
    current = (cs - before) / mx.minimum(mx.arange(1, n + 1, dtype=mx.float32), w)[:, None]
    a = mx.stack([_minmax(_anomaly(u, stable)), _minmax(_anomaly(u, episodic)),
                  _minmax(_anomaly(u, current))], axis=2)  # [b, h, 3, n]
    t = tail_count(n)
    srt = mx.sort(a, axis=-1)
    delta = srt[..., n - t:].mean(axis=-1) - srt[..., :t].mean(axis=-1)  # [b, h, 3]
    weights = mx.softmax(mx.log(mx.array(PRIOR, mx.float32)) + beta * delta, axis=-1)
    blend = (weights[..., None] * a).sum(axis=2)
    surprise = _minmax(mx.sqrt(((a - a.mean(axis=2, keepdims=True)) ** 2).mean(axis=2)))
    surprise = surprise - surprise.mean(axis=-1, keepdims=True)
    gate = mx.sigmoid(kappa * (surprise - tau))
    return mx.where(bad[..., 0], -mx.inf, (1.0 - gate) * blend + gate * a.max(axis=2))


def _score(state: NestedKVState, keys, values, queries, evicting):
    """The candidates' score (stored ++ new); ``queries`` are unused (the score reads keys)."""
    cand = mx.concatenate([state.keys, keys], axis=2) if state.keys.shape[2] else keys
    return nestedkv_score(cand, window=state.window, beta=state.beta, tau=state.tau,
                          kappa=state.kappa)


def _minmax_reference(x: np.ndarray) -> np.ndarray:
    span = x.max() - x.min()
    return (x - x.min()) / span if span > _FLAT else np.zeros_like(x)


def _score_reference(keys: np.ndarray, state: NestedKVState) -> np.ndarray:
    """One head: ``[N, d]`` keys -> ``[N]`` scores, anchor by anchor (float64)."""
    n = len(keys)
    with np.errstate(over="ignore", invalid="ignore"):  # rows of non-finite energy: left out
        bad = ~np.isfinite((keys.astype(np.float32) ** 2).sum(axis=1))
        u = np.where(bad[:, None], 0.0, keys / np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), _EPS))
    size = block_size(n)

    def cos(x, mu):
        return x @ mu / max(np.linalg.norm(mu), _EPS)

    stable = u.mean(axis=0)
    scales = np.zeros((3, n))
    for i in range(n):
        start = i // size * size
        episodic = u[start:start + size].mean(axis=0)
        current = u[max(0, i - state.window + 1):i + 1].mean(axis=0)
        scales[:, i] = [1 - cos(u[i], stable), 1 - cos(u[i], episodic), 1 - cos(u[i], current)]
    a = np.stack([_minmax_reference(x) for x in scales])
    t = tail_count(n)
    delta = np.array([np.sort(x)[n - t:].mean() - np.sort(x)[:t].mean() for x in a])
    logits = np.log(PRIOR) + state.beta * delta
    weights = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    blend = weights @ a
    surprise = _minmax_reference(a.std(axis=0))
    surprise -= surprise.mean()
    gate = 1 / (1 + np.exp(-state.kappa * (surprise - state.tau)))
    return np.where(bad, -np.inf, (1 - gate) * blend + gate * a.max(axis=0))


def _head_score(state: NestedKVState, head: ref.Head) -> np.ndarray:
    return _score_reference(head.keys.astype(np.float64), state)


method = register("nestedkv", NestedKVState, init, evict.score_and_keep(_score, _head_score))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
