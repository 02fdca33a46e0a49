"""Keyformer: H2O-style accumulated scores of Gumbel-perturbed attention, annealed temperature.

Each query adds to every visible token the softmax of its logits perturbed by Gumbel noise,
``softmax(z + tau * g)``; scores accumulate (with ``decay``) and the ``budget`` best tokens are
kept besides the sinks and the ``recent`` newest. ``g`` is a deterministic function of
``(seed, key position, query position)`` (a counter-based hash, ``velox.noise``), so it is redrawn for every
query as in the paper, yet independent of the batch layout and of chunking. The temperature
anneals linearly with the query's absolute position ``p``: ``tau = tau_init + (tau_end -
tau_init) * min(p, anneal_steps) / anneal_steps`` (``anneal_steps = 0``: constant
``tau_init``). A multi-token chunk is one selection, each query weighted ``decay**(s-1-i)``
as in H2O; ``tau = 0`` is H2O exactly (same ``grace = recent`` and ``decay``).

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache: H2O's fused
kernels, the weights kernel drawing the same noise itself (the hash, logs and temperature of
the ``mlx`` ops) and adding it to the logits, ``velox.kernels.evict``; every other step runs
the ``mlx`` ops).

References:
    Adnan, Arunkumar, Jain, Nair, Soloveychik, Kamath. Keyformer: KV Cache Reduction through
    Key Tokens Selection for Efficient Generative Inference. MLSys 2024. arXiv:2403.09054.

Deviations from the paper:
    * The temperature scales the noise, ``softmax(z + tau * g)``, instead of dividing the
      perturbed logits, ``softmax((z + g) / tau)``: equal at the paper's ``tau_init = 1``, and
      ``tau = 0`` is plain H2O. The schedule counts absolute positions, the prompt included.
    * Noise is shared by the heads (it depends on positions only), so each head's selection
      depends on its own inputs alone.
    * ``n_sink`` protects the first tokens; ``decay`` fades old scores (1 = the paper).
    * Kept keys keep their original rotation (no RoPE re-indexing: positions stay absolute).
    * Without real queries the new keys are their own queries (key-as-query proxy).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..accounting import state_nbytes
from ..attention import candidate_logits, softmax
from ..noise import hash_uniform, hash_uniform_np
from ..registry import dispatch, prepare_init, register
from .h2o import heavy_hitters, heavy_hitters_step

__all__ = ["KeyformerState", "keyformer_init", "keyformer_update", "keyformer_get_kv",
           "keyformer_bytes"]

KEY = "keyformer"

class KeyformerState(NamedTuple):
    """Kept rows, their absolute positions and accumulated perturbed attention ``scores``."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    scores: Float[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    budget: int
    n_sink: int
    recent: int
    tau_init: float
    tau_end: float
    anneal_steps: int
    decay: float
    seed: int
    backend: str


def keyformer_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
                   budget: int = 512, n_sink: int = 4, recent: int = 32, tau_init: float = 1.0,
                   tau_end: float = 1.0, anneal_steps: int = 0, decay: float = 1.0, seed: int = 0,
                   backend: str = "auto") -> KeyformerState:
    """Empty Keyformer state keeping at most ``budget`` tokens per head (sinks included)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, n_sink=n_sink, recent=recent, tau_init=tau_init,
                                   tau_end=tau_end, anneal_steps=anneal_steps, decay=decay, seed=seed))
    k, v, pos, nxt = evict.empty_rows(batch, kv_heads, head_dim, dtype)
    return KeyformerState(k, v, pos, mx.zeros((batch, kv_heads, 0), mx.float32), nxt, **p,
                          backend=backend)


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


def _gumbel_mass(state: KeyformerState, queries, keys, coef, block: int = 256) -> mx.array:
    """Attention mass of the chunk's queries with Gumbel-perturbed logits, as ``candidate_mass``."""
    n, s = state.keys.shape[2], keys.shape[2]
    kpos, qpos = _candidate_positions(state, s)
    total = None
    for start in range(0, s, block):
        stop = min(start + block, s)  # queries start..stop-1 see the new keys up to stop-1
        logits = candidate_logits(queries[:, :, :, start:stop], state.keys, keys[:, :, :stop])
        noise = _noise(state, qpos[:, :, start:stop], kpos[:, :, : n + stop])  # [b, h, m, n+stop]
        w = softmax(logits + noise[:, :, None])
        if coef is not None:
            w = w * coef[start:stop, None]
        part = (w[:, :, :, 0] if stop - start == 1 else w.sum(axis=3)).mean(axis=2)
        if stop < s:
            part = mx.concatenate([part, mx.zeros(part.shape[:2] + (s - stop,), part.dtype)], axis=2)
        total = part if total is None else total + part
    return total


def _update_mlx(state: KeyformerState, keys, values, queries) -> KeyformerState:
    stored, fresh, idx = heavy_hitters(
        state, keys, values, queries, state.recent,
        mass=lambda q, _stored, new_k, coef: _gumbel_mass(state, q, new_k, coef))
    k, v, p, sc = evict.keep_rows(stored, fresh, idx)
    return state._replace(keys=k, values=v, positions=p, scores=sc,
                          next_pos=state.next_pos + keys.shape[2])


def _decode_cuda(state: KeyformerState, keys, values, queries) -> KeyformerState:
    gumbel = dict(seed=state.seed, tau_init=state.tau_init, tau_end=state.tau_end,
                  anneal_steps=state.anneal_steps, positions=state.positions,
                  next_pos=state.next_pos)
    return heavy_hitters_step(state, keys, values, queries, state.recent, gumbel=gumbel)


def _update_reference(state: KeyformerState, keys, values, queries) -> KeyformerState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    s = keys.shape[2]
    q = ref.scoring_queries(c.new_keys, c.queries)
    d = q.shape[-1]
    acc = np.zeros((b, h, N))
    acc[:, :, : N - s] = ref.to_np(state.scores)
    chosen = []
    for i in range(b):
        chosen.append([])
        for j in range(h):
            pos = c.positions[i, j]
            for t in range(s):  # token by token: decay, then add this query's perturbed attention
                p = pos[N - s + t]
                g = -np.log(-np.log(hash_uniform_np(state.seed, pos, np.full(N, p))))
                logits = q[i, j, :, t] @ c.keys[i, j].astype(np.float64).T / np.sqrt(d)  # [g, N]
                logits = np.where(pos <= p, logits + _tau(state, np.float64(p)) * g, -np.inf)
                acc[i, j] = acc[i, j] * state.decay + ref.softmax(logits).mean(0)
            keep = ref.protected(pos, c.total[i, j], state.n_sink, state.recent)
            chosen[i].append(ref.top_budget(acc[i, j], state.budget, keep))
    return ref.keep(state, c, chosen, scores=acc)


def keyformer_update(state: KeyformerState, keys: Float[Array, "b h s d"],
                     values: Float[Array, "b h s d"], *,
                     queries: Float[Array, "b q s d"] | None = None) -> KeyformerState:
    """Append ``s`` tokens, accumulate their perturbed attention, keep the ``budget`` best."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def keyformer_get_kv(state: KeyformerState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def keyformer_bytes(state: KeyformerState) -> int:
    """Bytes of every array the state holds (scores included)."""
    return state_nbytes(state)


register(KEY, state_type=KeyformerState, init=keyformer_init, update=keyformer_update,
         get_kv=keyformer_get_kv, nbytes=keyformer_bytes,
         backends={"reference": _update_reference, "mlx": _update_mlx,
                   "cuda": evict.cuda_update(_update_mlx, lambda st: st.budget, _decode_cuda)})
