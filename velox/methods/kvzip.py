"""KVzip: keep the tokens a context-reconstruction pass relies on most; query-agnostic.

References:
    Kim, Kim, Kwon, Lee, Yun, Song. KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction. NeurIPS 2025. arXiv:2505.23416.

Rule (``probe="context"``): a candidate's importance is the maximum attention it receives from
any probe query, over the probes and the query heads of its kv head. The probes are the
queries given to the update, taken as reconstruction queries: run the model over the repeated
context ("Repeat the previous context:" + the chunk) and pass that pass's queries with the
chunk's keys and values; each probe reads every candidate (stored + new), as a reconstruction
pass reads the whole context. Without queries every candidate's key is a probe (the stored
keys as the reconstruction, the key-as-query proxy). ``probe="latest"`` scores by the chunk's
newest query alone, averaged over the group (TOVA's rule). Sinks are protected; the ``budget``
best candidates are kept; a chunk is one selection.

Deviations from the paper:
    * The paper scores a whole context once after prefill, then evicts; here every update that
      overflows the budget re-scores stored + new, so a context streamed in chunks is
      compressed chunk by chunk (importance is not carried between updates).
    * Without real probe queries the candidates' keys are the probes (key-as-query proxy).
    * ``n_sink`` protects the first tokens; the paper protects none.
    * ``per_head=False`` keeps one token set per layer (importance averaged over kv heads).
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

__all__ = ["KVzipState", "kvzip_init", "kvzip_update", "kvzip_get_kv", "kvzip_bytes",
           "kvzip_importance"]

KEY = "kvzip"


class KVzipState(NamedTuple):
    """Kept rows and their absolute positions; no score memory."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    budget: int
    n_sink: int
    probe: str
    per_head: bool
    backend: str


def kvzip_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
               budget: int = 512, n_sink: int = 4, probe: str = "context", per_head: bool = True,
               backend: str = "auto") -> KVzipState:
    """Empty KVzip state keeping at most ``budget`` tokens per head (sinks included)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, n_sink=n_sink, probe=probe, per_head=per_head))
    return KVzipState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), **p, backend=backend)


def kvzip_importance(probes: Float[Array, "b h g m d"], stored: Float[Array, "b h n d"],
                     new: Float[Array, "b h s d"], block: int = 256) -> Float[Array, "b h ns"]:
    """Max attention each of ``n + s`` candidates receives from any probe (no causal mask).

    Probes go in blocks of ``block`` so ``n + s`` probes never hold every weight at once.
    """
    b, h, g, m, d = probes.shape
    scale = d ** -0.5
    k = (mx.concatenate([stored, new], axis=2) if stored.shape[2] else new).astype(mx.float32)
    best = None
    for start in range(0, m, block):
        q = probes[:, :, :, start:start + block].astype(mx.float32) * scale
        q = q.reshape(b, h, -1, d)
        w = mx.softmax(q @ k.swapaxes(-1, -2), axis=-1, precise=True).max(axis=2)
        best = w if best is None else mx.maximum(best, w)
    return best


def _update_mlx(state: KVzipState, keys, values, queries) -> KVzipState:
    n, s = state.keys.shape[2], keys.shape[2]
    idx = None
    if n + s > state.budget:
        if state.probe == "latest":  # TOVA: the newest query, averaged over its group
            last = scoring_queries(keys, queries)[:, :, :, -1:]
            score = candidate_weights(last, state.keys, keys)[:, :, :, 0].mean(axis=2)
        elif queries is None:  # every candidate's key probes
            cand = mx.concatenate([state.keys, keys], axis=2) if n else keys
            score = kvzip_importance(cand[:, :, None], state.keys, keys)
        else:
            score = kvzip_importance(scoring_queries(keys, queries), state.keys, keys)
        if not state.per_head:
            score = score.mean(axis=1, keepdims=True)
        idx = evict.top_budget(score, state.budget, evict.protected(n + s, state.n_sink))
        idx = mx.broadcast_to(idx, state.positions.shape[:2] + idx.shape[2:])
    k, v, p = evict.keep_rows((state.keys, state.values, state.positions),
                              (keys, values, evict.new_positions(state.next_pos, s)), idx)
    return state._replace(keys=k, values=v, positions=p, next_pos=state.next_pos + s)


def _update_reference(state: KVzipState, keys, values, queries) -> KVzipState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    if N <= state.budget:
        return ref.keep(state, c, [[None] * h for _ in range(b)])
    d = keys.shape[3]
    if state.probe == "latest":
        probes = ref.scoring_queries(c.new_keys, c.queries)[:, :, :, -1:]
    elif c.queries is None:
        probes = c.keys.astype(np.float64)[:, :, None]
    else:
        probes = ref.scoring_queries(c.new_keys, c.queries)
    score = np.zeros((b, h, N))
    for i in range(b):
        for j in range(h):
            pos = c.positions[i, j]
            if state.probe == "latest":  # causal attention of the newest query, group mean
                score[i, j] = ref.attention_weights(probes[i, j], c.keys[i, j], pos, pos[-1:])[:, 0].mean(0)
            else:  # each probe reads every candidate; a candidate keeps its best probe
                q = probes[i, j].reshape(-1, d)
                w = ref.softmax(q @ c.keys[i, j].astype(np.float64).T / np.sqrt(d))
                score[i, j] = w.max(axis=0)
    if not state.per_head:
        score[:] = score.mean(axis=1, keepdims=True)
    chosen = [[ref.top_budget(score[i, j], state.budget, c.positions[i, j] < state.n_sink)
               for j in range(h)] for i in range(b)]
    return ref.keep(state, c, chosen)


def kvzip_update(state: KVzipState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
                 *, queries: Float[Array, "b q s d"] | None = None) -> KVzipState:
    """Append ``s`` tokens; if over budget keep those the probes (``queries``) rely on most."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def kvzip_get_kv(state: KVzipState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def kvzip_bytes(state: KVzipState) -> int:
    """Bytes of every array the state holds."""
    return state_nbytes(state)


register(KEY, state_type=KVzipState, init=kvzip_init, update=kvzip_update, get_kv=kvzip_get_kv,
         nbytes=kvzip_bytes, backends={"reference": _update_reference, "mlx": _update_mlx})
