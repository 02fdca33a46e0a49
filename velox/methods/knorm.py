"""KNorm: keep the keys with the lowest L2 norm (they draw the most attention).

A token's score is its key's L2 norm, fixed at insertion: ``-norm`` with ``keep="low"`` (the
paper), ``+norm`` with ``keep="high"`` (the inverted ablation). Every update keeps the sinks,
the ``recent`` newest tokens and the best-scoring rest, ``budget`` in all; a multi-token chunk
is one selection over stored + new tokens. With ``recent=0`` the kept set is a function of the
tokens seen only (one chunk or token by token end alike).

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache scores with the
``mlx`` ops and finds the loser and moves the rows in one fused kernel,
``velox.kernels.evict.compact``; every other step runs the ``mlx`` ops).

References:
    Devoto, Zhao, Scardapane, Minervini. A Simple and Effective L2 Norm-Based Strategy for KV
    Cache Compression. EMNLP 2024. arXiv:2406.11430.

Deviations from the paper:
    * ``n_sink`` protects the first tokens and ``recent`` the newest ones (the paper keeps
      neither; ``n_sink=0, recent=0`` is the paper).
    * The paper compresses once at a fixed ratio; here every update evicts down to ``budget``.
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

__all__ = ["KNormState", "knorm_init", "knorm_update", "knorm_get_kv", "knorm_bytes"]

KEY = "knorm"


class KNormState(NamedTuple):
    """Kept rows and their absolute positions; scores are recomputed from the kept keys."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    budget: int
    n_sink: int
    recent: int
    keep: str
    backend: str


def knorm_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
               budget: int = 512, n_sink: int = 4, recent: int = 32, keep: str = "low",
               backend: str = "auto") -> KNormState:
    """Empty KNorm state keeping at most ``budget`` tokens per head (sinks included)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, n_sink=n_sink, recent=recent, keep=keep))
    return KNormState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), **p, backend=backend)


def _scores(state: KNormState, keys) -> mx.array:
    """Every candidate's score (stored ++ new): its key norm, negated for ``keep='low'``."""
    norms = mx.concatenate([evict.row_norms(state.keys), evict.row_norms(keys)], axis=2)
    return -norms if state.keep == "low" else norms


def _update_mlx(state: KNormState, keys, values, queries) -> KNormState:
    n, s = state.keys.shape[2], keys.shape[2]
    idx = None
    if n + s > state.budget:
        idx = evict.top_budget(_scores(state, keys), state.budget,
                               evict.protected(n + s, state.n_sink, state.recent))
    k, v, p = evict.keep_rows((state.keys, state.values, state.positions),
                              (keys, values, evict.new_positions(state.next_pos, s)), idx)
    return state._replace(keys=k, values=v, positions=p, next_pos=state.next_pos + s)


def _decode_cuda(state: KNormState, keys, values, queries) -> KNormState:
    from ..kernels.evict import compact
    return evict.with_compacted(state, compact(
        state.keys, state.values, state.positions, keys, values, state.next_pos,
        by=_scores(state, keys), n_sink=state.n_sink, recent=state.recent))


def _update_reference(state: KNormState, keys, values, queries) -> KNormState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    sign = -1.0 if state.keep == "low" else 1.0
    chosen = []
    for i in range(b):
        chosen.append([])
        for j in range(h):
            norms = np.linalg.norm(c.keys[i, j].astype(np.float64), axis=-1)
            keep = ref.protected(c.positions[i, j], c.total[i, j], state.n_sink, state.recent)
            chosen[i].append(ref.top_budget(sign * norms, state.budget, keep))
    return ref.keep(state, c, chosen)


def knorm_update(state: KNormState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
                 *, queries: Float[Array, "b q s d"] | None = None) -> KNormState:
    """Append ``s`` tokens; keep sinks, the recent window and the lowest-norm (or highest) rest."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def knorm_get_kv(state: KNormState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def knorm_bytes(state: KNormState) -> int:
    """Bytes of every array the state holds."""
    return state_nbytes(state)


register(KEY, state_type=KNormState, init=knorm_init, update=knorm_update, get_kv=knorm_get_kv,
         nbytes=knorm_bytes, backends={"reference": _update_reference, "mlx": _update_mlx,
                                        "cuda": evict.cuda_update(_update_mlx, lambda st: st.budget,
                                                                  _decode_cuda)})
