"""Keyformer: H2O-style accumulated scores of Gumbel-perturbed attention, annealed temperature.

Each query adds to every visible token the softmax of its logits perturbed by Gumbel noise,
``softmax(z + tau * g)``; scores accumulate (with ``decay``) and the ``budget`` best tokens are
kept besides the sinks and the ``recent`` newest. ``g`` is a deterministic function of ``(seed,
key position, query position)`` (a counter-based hash, ``velox.noise``), so it is redrawn for
every query as in the paper, yet independent of the batch layout and of chunking. The
temperature anneals linearly with the query's absolute position ``p``: ``tau = tau_init +
(tau_end - tau_init) * min(p, anneal_steps) / anneal_steps`` (``anneal_steps = 0``: constant
``tau_init``). A multi-token chunk is one selection, each query weighted ``decay**(s-1-i)`` as
in H2O; ``tau = 0`` is H2O exactly (same ``grace = recent`` and ``decay``).

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache: H2O's fused
kernels, the weights kernel drawing the same noise itself (the hash, logs and temperature of
the ``mlx`` ops) and adding it to the logits, ``velox.kernels.evict``; every other step runs
the ``mlx`` ops).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float
from ..attention import candidate_mass
from ..heavy_hitters import heavy_hitter_inputs, heavy_hitter_scores
from ..noise import hash_uniform, hash_uniform_np
from ..registry import register

__all__ = ["KeyformerState", "State", "init", "update", "get_kv", "nbytes"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, recent: int = 32, tau_init: float = 1.0,
         tau_end: float = 1.0, anneal_steps: int = 0, decay: float = 1.0, seed: int = 0,
         backend: str = "auto") -> KeyformerState:
    """Empty Keyformer state keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head, sinks and recent window included.
        n_sink: leading tokens never evicted.
        recent: newest tokens never evicted (the paper's recent window; h2o's grace).
        tau_init: noise temperature at position 0 (0 = no noise: h2o).
        tau_end: noise temperature from position anneal_steps on (the paper uses 2).
        anneal_steps: positions over which the temperature goes linearly from tau_init to
            tau_end (0 = constant tau_init).
        decay: multiplier applied to accumulated scores at every token (1 = the paper; not in
            the seed).
        seed: seed of the Gumbel noise.
    """
    return evict.empty_state(KeyformerState, locals())


KeyformerState = State = evict.state_type(
    "KeyformerState", init,
    "Kept rows, their absolute positions and accumulated perturbed attention ``scores``.",
    scores=Float[Array, "b h n"])


def _tau(state: KeyformerState, qpos):
    """The annealed temperature at query positions ``qpos`` (MLX or NumPy arrays)."""
    if state.anneal_steps == 0 or state.tau_end == state.tau_init:
        return state.tau_init + 0.0 * qpos
    lib = mx if isinstance(qpos, mx.array) else np
    frac = lib.minimum(qpos, state.anneal_steps) / state.anneal_steps
    return state.tau_init + (state.tau_end - state.tau_init) * frac


def _noise(state: KeyformerState, qpos, kpos) -> mx.array:
    """``tau * g``: the scaled Gumbel noise of queries at ``qpos [b, h, m]`` on keys at
    ``kpos [b, h, N]`` (uint32), ``[b, h, m, N]`` float32."""
    tau = _tau(state, qpos.astype(mx.float32)).astype(mx.float32)
    g = -mx.log(-mx.log(hash_uniform(state.seed, kpos[:, :, None, :], qpos[:, :, :, None])))
    return tau[..., None] * g


def _candidate_positions(state: KeyformerState, s: int) -> tuple[mx.array, mx.array]:
    """Positions (uint32) of the stored ++ new candidates ``[b, h, n + s]`` and of the new
    tokens ``[b, h, s]``."""
    qpos = state.next_pos.astype(mx.uint32)[:, :, None] + mx.arange(s, dtype=mx.uint32)
    return mx.concatenate([state.positions.astype(mx.uint32), qpos], axis=2), qpos


def _gumbel_mass(state: KeyformerState, queries, keys, coef) -> mx.array:
    """Attention mass of the chunk's queries with Gumbel-perturbed logits (``candidate_mass``
    with the noise of each query on each candidate it may see)."""
    n, s = state.keys.shape[2], keys.shape[2]
    kpos, qpos = _candidate_positions(state, s)

    def noise(start, stop, visible):  # [b, h, 1, m, n + visible]
        return _noise(state, qpos[:, :, start:stop], kpos[:, :, : n + visible])[:, :, None]

    return candidate_mass(queries, state.keys, keys, coef, noise=noise)


def _score(state: KeyformerState, keys, values, queries, evicting) -> evict.Scored:
    """H2O's accumulated scores with the Gumbel-perturbed attention mass, carried as ``scores``."""
    def mass(q, _stored, new_keys, coef):
        return _gumbel_mass(state, q, new_keys, coef)
    return heavy_hitter_scores(state, keys, values, queries, evicting, mass=mass)


def _score_reference(state: KeyformerState, head: ref.Head) -> tuple:
    """One head, token by token: decay, then add the query's perturbed attention (the mean
    over the kv head's query heads)."""
    N, s, pos = len(head.positions), head.s, head.positions
    d = head.probes.shape[-1]
    acc = np.zeros(N)
    acc[: N - s] = head.carried["scores"]
    for t in range(s):
        p = pos[N - s + t]
        g = -np.log(-np.log(hash_uniform_np(state.seed, pos, np.full(N, p))))
        logits = head.probes[:, t] @ head.keys.astype(np.float64).T / np.sqrt(d)  # [g, N]
        logits = np.where(pos <= p, logits + _tau(state, np.float64(p)) * g, -np.inf)
        acc = acc * state.decay + ref.softmax(logits).mean(0)
    return acc, {"scores": acc}


def _kernel(state: KeyformerState, keys, values, queries) -> dict:
    """H2O's fused decode step, the weights kernel drawing the same noise itself."""
    gumbel = dict(seed=state.seed, tau_init=state.tau_init, tau_end=state.tau_end,
                  anneal_steps=state.anneal_steps, positions=state.positions,
                  next_pos=state.next_pos)
    return heavy_hitter_inputs(state, keys, values, queries, gumbel=gumbel)


method = register("keyformer", KeyformerState, init,
                  evict.score_and_keep(_score, _score_reference, kernel=evict.ScoreKernel(_kernel),
                                       carry=("scores",)))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
