"""KVzip: keep the tokens a context-reconstruction pass relies on most; query-agnostic.

References:
    Kim, Kim, Kwon, Lee, Yun, Song. KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction. NeurIPS 2025. arXiv:2505.23416.

Rule (``probe="context"``): a candidate's importance is the maximum attention it has received
from any probe query, over the probes and the query heads of its kv head. The probes of an
update are the queries given to it, taken as reconstruction queries: run the model over the
repeated context ("Repeat the previous context:" + the chunk; the adapter's
``reconstruction_prefill`` does this) and pass that pass's queries with the chunk's keys and
values; each probe reads every candidate (stored + new), as a reconstruction pass reads the
whole context. Without queries the new tokens' keys are the probes (key-as-query proxy; for
the first chunk every candidate's key). Importance is carried between updates as a running
maximum, so a decode step costs one probe against the cache. ``probe="latest"`` scores by the
chunk's newest query alone, averaged over the group (TOVA's rule). Sinks are protected; the
``budget`` best candidates are kept; a chunk is one selection.

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache: one fused
kernel for the probe's weights (max or mean over the group) and the running maximum, one that
finds the loser and moves the rows and importance; every other step runs the ``mlx`` ops).

Deviations from the paper:
    * The paper scores a whole context once after prefill, then evicts; here every update that
      overflows the budget selects over stored + new, so a context streamed in chunks (and
      decoding) is compressed step by step, with importance carried as a running maximum.
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
from ..attention import candidate_weights, scoring_queries, softmax
from ..registry import dispatch, prepare_init, register

__all__ = ["KVzipState", "kvzip_init", "kvzip_update", "kvzip_get_kv", "kvzip_bytes",
           "kvzip_importance"]

KEY = "kvzip"


class KVzipState(NamedTuple):
    """Kept rows, their absolute positions and the best probe attention each has received."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    importance: Float[Array, "b h n"]
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
    k, v, pos, nxt = evict.empty_rows(batch, kv_heads, head_dim, dtype)
    importance = mx.zeros((batch, kv_heads, 0), mx.float32)
    return KVzipState(k, v, pos, importance, nxt, **p, backend=backend)


def kvzip_importance(probes: Float[Array, "b h g m d"], stored: Float[Array, "b h n d"],
                     new: Float[Array, "b h s d"], block: int = 256) -> Float[Array, "b h ns"]:
    """Max attention each of ``n + s`` candidates receives from any probe (no causal mask).

    Probes go in blocks of ``block`` so ``n + s`` probes never hold every weight at once.
    """
    b, h, g, m, d = probes.shape
    scale = d ** -0.5
    # stored and new keys are scored apart: no concatenated copy of the cache
    parts = [p.astype(mx.float32).swapaxes(-1, -2) for p in (stored, new) if p.shape[2]]
    best = None
    for start in range(0, m, block):
        q = probes[:, :, :, start:start + block].astype(mx.float32) * scale
        q = q.reshape(b, h, -1, d)
        logits = [q @ kt for kt in parts]
        logits = mx.concatenate(logits, axis=-1) if len(logits) > 1 else logits[0]
        w = softmax(logits).max(axis=2)
        best = w if best is None else mx.maximum(best, w)
    return best


def _update_mlx(state: KVzipState, keys, values, queries) -> KVzipState:
    n, s = state.keys.shape[2], keys.shape[2]
    probes = scoring_queries(keys, queries)
    if state.probe == "latest":  # TOVA: the newest query, averaged over its group
        current = candidate_weights(probes[:, :, :, -1:], state.keys, keys)[:, :, :, 0].mean(axis=2)
    else:
        current = kvzip_importance(probes, state.keys, keys)
    carried = mx.concatenate([state.importance, mx.zeros(current.shape[:2] + (s,), mx.float32)], 2)
    importance = mx.maximum(carried, current)
    idx = None
    if n + s > state.budget:
        score = current if state.probe == "latest" else importance
        if not state.per_head:
            score = score.mean(axis=1, keepdims=True)
        idx = evict.top_budget(score, state.budget, evict.protected(n + s, state.n_sink))
        idx = mx.broadcast_to(idx, state.positions.shape[:2] + idx.shape[2:])
    k, v, p, imp = evict.keep_rows(
        (state.keys, state.values, state.positions, importance[:, :, :n]),
        (keys, values, evict.new_positions(state.next_pos, s), importance[:, :, n:]), idx)
    return state._replace(keys=k, values=v, positions=p, importance=imp, next_pos=state.next_pos + s)


def _decode_cuda(state: KVzipState, keys, values, queries) -> KVzipState:
    from ..kernels.evict import compact, weights
    latest = state.probe == "latest"
    current, importance = weights(queries, state.keys, keys, old=state.importance,
                                  accumulate="max", group="mean" if latest else "max")
    return evict.with_compacted(state, compact(
        state.keys, state.values, state.positions, keys, values, state.next_pos,
        by=current if latest else importance, carry=importance, shared=not state.per_head,
        n_sink=state.n_sink), carried="importance")


def _update_reference(state: KVzipState, keys, values, queries) -> KVzipState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    s = keys.shape[2]
    d = keys.shape[3]
    probes = ref.scoring_queries(c.new_keys, c.queries)
    current = np.zeros((b, h, N))
    for i in range(b):
        for j in range(h):
            pos = c.positions[i, j]
            if state.probe == "latest":  # causal attention of the newest query, group mean
                current[i, j] = ref.attention_weights(probes[i, j, :, -1:], c.keys[i, j], pos,
                                                      pos[-1:])[:, 0].mean(0)
            else:  # each probe reads every candidate; a candidate keeps its best probe
                q = probes[i, j].reshape(-1, d)
                w = ref.softmax(q @ c.keys[i, j].astype(np.float64).T / np.sqrt(d))
                current[i, j] = w.max(axis=0)
    carried = np.concatenate([ref.to_np(state.importance), np.zeros((b, h, s))], axis=2)
    importance = np.maximum(carried, current)
    if N <= state.budget:
        return ref.keep(state, c, [[None] * h for _ in range(b)], importance=importance)
    score = current if state.probe == "latest" else importance
    if not state.per_head:
        score = np.repeat(score.mean(axis=1, keepdims=True), h, axis=1)
    chosen = [[ref.top_budget(score[i, j], state.budget, c.positions[i, j] < state.n_sink)
               for j in range(h)] for i in range(b)]
    return ref.keep(state, c, chosen, importance=importance)


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
         nbytes=kvzip_bytes, backends={"reference": _update_reference, "mlx": _update_mlx,
                                        "cuda": evict.cuda_update(_update_mlx, lambda st: st.budget,
                                                                  _decode_cuda)})
