"""CurDKV: keep the tokens with the largest key-and-value CUR leverage; query-free.

References:
    Sengupta, Chaudhary, Chakraborty. Value-Guided KV Compression for LLMs via Approximated
    CUR Decomposition. NeurIPS 2025. arXiv:2509.15038.

Rule: for the candidates (stored + new) of a kv head, with ``X`` their keys ``[N, d]`` and
``V_r`` the top ``r = min(rank_cap, d, N)`` right singular vectors of ``X``, a token's key
leverage is its share of the rank-``r`` energy, ``l_K(i) = ||x_i V_r||^2 / ||X||_F^2``
(non-negative, summing to the retained energy fraction, 1 at full rank); ``l_V`` is the same
for the values. The score is ``l_K * l_V`` (the authors' ``kv_product``): a token is kept for a
distinctive key and a value that carries energy. Sinks are protected; the ``budget`` best are
kept. A chunk is one selection; nothing is carried between updates.

Deviations from the paper:
    * Exact rank-capped leverage from the eigendecomposition of the ``d x d`` Gram matrices
      instead of Gaussian-sketch estimates, and no local-window normalisation.
    * Every update that overflows the budget re-scores stored + new (the paper compresses a
      prompt once).
    * ``n_sink`` protects the first tokens.
    * The seed's ``rope_base`` is not a parameter: kept keys are never re-rotated.
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

__all__ = ["CurDKVState", "curdkv_init", "curdkv_update", "curdkv_get_kv", "curdkv_bytes",
           "curdkv_leverage"]

KEY = "curdkv"

_TINY = 1e-30  # an all-zero block has zero energy: its leverage is 0, not NaN


class CurDKVState(NamedTuple):
    """Kept rows and their absolute positions; no score memory."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    budget: int
    n_sink: int
    rank_cap: int
    backend: str


def curdkv_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
                budget: int = 512, n_sink: int = 4, rank_cap: int = 16,
                backend: str = "auto") -> CurDKVState:
    """Empty CurDKV state keeping at most ``budget`` tokens per head (sinks included)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, n_sink=n_sink, rank_cap=rank_cap))
    return CurDKVState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), **p, backend=backend)


def curdkv_leverage(x: Float[Array, "b h n d"], rank_cap: int) -> Float[Array, "b h n"]:
    """Rank-capped energy leverage of each row: ``||x_i V_r||^2 / ||X||_F^2`` (float32)."""
    x = x.astype(mx.float32)
    n, d = x.shape[2], x.shape[3]
    total = mx.maximum((x * x).sum(axis=(2, 3)), _TINY)[:, :, None]
    r = min(rank_cap, d, n)
    if r >= min(d, n):  # the top-r subspace holds every row: leverage is the row's energy share
        return (x * x).sum(axis=-1) / total
    gram = (x.swapaxes(-1, -2) @ x).astype(mx.float64)
    _, vecs = mx.linalg.eigh(gram, stream=mx.cpu)  # ascending eigenvalues
    top = vecs[..., d - r:].astype(mx.float32)
    proj = x @ top
    return (proj * proj).sum(axis=-1) / total


def _update_mlx(state: CurDKVState, keys, values, queries) -> CurDKVState:
    n, s = state.keys.shape[2], keys.shape[2]
    idx = None
    if n + s > state.budget:
        cand_k = mx.concatenate([state.keys, keys], axis=2) if n else keys
        cand_v = mx.concatenate([state.values, values], axis=2) if n else values
        score = curdkv_leverage(cand_k, state.rank_cap) * curdkv_leverage(cand_v, state.rank_cap)
        idx = evict.top_budget(score, state.budget, evict.protected(n + s, state.n_sink))
    k, v, p = evict.keep_rows((state.keys, state.values, state.positions),
                              (keys, values, evict.new_positions(state.next_pos, s)), idx)
    return state._replace(keys=k, values=v, positions=p, next_pos=state.next_pos + s)


def _leverage_reference(x: np.ndarray, rank_cap: int) -> np.ndarray:
    """One head: ``[N, d]`` rows -> rank-capped energy leverage ``[N]`` (float64)."""
    n, d = x.shape
    total = max(float((x * x).sum()), _TINY)
    r = min(rank_cap, d, n)
    _, _, vt = np.linalg.svd(x, full_matrices=False)  # rows of vt: right singular vectors
    proj = x @ vt[:r].T
    return (proj * proj).sum(axis=1) / total


def _update_reference(state: CurDKVState, keys, values, queries) -> CurDKVState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    if N <= state.budget:
        return ref.keep(state, c, [[None] * h for _ in range(b)])
    chosen = []
    for i in range(b):
        chosen.append([])
        for j in range(h):
            score = (_leverage_reference(c.keys[i, j].astype(np.float64), state.rank_cap)
                     * _leverage_reference(c.values[i, j].astype(np.float64), state.rank_cap))
            chosen[i].append(ref.top_budget(score, state.budget, c.positions[i, j] < state.n_sink))
    return ref.keep(state, c, chosen)


def curdkv_update(state: CurDKVState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
                  *, queries: Float[Array, "b q s d"] | None = None) -> CurDKVState:
    """Append ``s`` tokens; if over budget keep those with the largest key x value leverage.

    ``queries`` are accepted and unused (the score is query-free).
    """
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def curdkv_get_kv(state: CurDKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def curdkv_bytes(state: CurDKVState) -> int:
    """Bytes of every array the state holds."""
    return state_nbytes(state)


register(KEY, state_type=CurDKVState, init=curdkv_init, update=curdkv_update,
         get_kv=curdkv_get_kv, nbytes=curdkv_bytes,
         backends={"reference": _update_reference, "mlx": _update_mlx})
