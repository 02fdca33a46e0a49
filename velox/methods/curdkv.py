"""CurDKV: keep the tokens with the largest key-and-value CUR leverage; query-free.

Rule: for the candidates (stored + new) of a kv head, with ``X`` their keys ``[N, d]`` and
``V_r`` the top ``r = min(rank_cap, d, N)`` right singular vectors of ``X``, a token's key
leverage is its share of the rank-``r`` energy, ``l_K(i) = ||x_i V_r||^2 / ||X||_F^2``
(non-negative, summing to the retained energy fraction, 1 at full rank); ``l_V`` is the same
for the values. The score is ``l_K * l_V`` (the authors' ``kv_product``): a token is kept for a
distinctive key and a value that carries energy. Sinks are protected; the ``budget`` best are
kept. A chunk is one selection.

The subspaces ``V_r`` of keys and values are fitted (eigendecomposition) on the candidates of
every multi-token update that overflows the budget, and stored; other updates score with the
stored subspaces (leverage of the current candidates in the last fitted subspace). Before any
fit (a cache fed token by token from the start), a token's score uses its full-rank energy
share ``||x_i||^2 / ||X||_F^2``. Within a head the denominators ``||X||_F^2`` are one constant,
so the ranking is that of ``||x_i V_r||^2 * ||y_i W_r||^2``; the state keeps this product for
every stored row (``scores``, constant while the subspaces are), so a decode step projects only
the new token.

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache scores the new
token with the ``mlx`` ops, then one fused kernel finds the loser and moves the rows and
scores; every other step runs the ``mlx`` ops).
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float
from ..registry import register

__all__ = ["CurDKVState", "State", "init", "update", "get_kv", "nbytes", "curdkv_leverage"]

_TINY = 1e-30  # an all-zero block has zero energy: its leverage is 0, not NaN


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, rank_cap: int = 16, slack: int = 0,
         backend: str = "auto") -> CurDKVState:
    """Empty CurDKV state keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head, sinks included.
        n_sink: leading tokens never evicted.
        rank_cap: leading singular directions the leverage is measured in (capped by head_dim
            and the token count).
        slack: rows held beyond budget: a full state (budget + slack rows) keeps budget in
            one selection, and the next slack tokens fill the freed slots (0 = per token).
    """
    basis = mx.zeros((batch, kv_heads, head_dim, min(rank_cap, head_dim)), mx.float32)
    return evict.empty_state(CurDKVState, locals(), key_basis=basis, value_basis=basis)


CurDKVState = State = evict.state_type(
    "CurDKVState", init,
    "Kept rows, their absolute positions, the fitted subspaces and each row's score in them.",
    scores=Float[Array, "b h n"],  # ||x V_r||^2 * ||y W_r||^2 in the stored subspaces
    key_basis=Float[Array, "b h d r"], value_basis=Float[Array, "b h d r"])


def _fit_basis(x: mx.array, r: int) -> mx.array:
    """Top-``r`` right singular vectors ``[b, h, d, r]`` of ``x [b, h, n, d]`` (float32).

    Rows of non-finite energy (NaN, inf, or squares that overflow) are left out of the fit:
    their own scores are non-finite and rank lowest (``evict.ranked``)."""
    x = x.astype(mx.float32)
    d = x.shape[3]
    if r >= d:
        return mx.broadcast_to(mx.eye(d, dtype=mx.float32), x.shape[:2] + (d, d))
    x = mx.where(mx.isfinite(evict.row_sq_norms(x))[..., None], x, 0.0)
    # float64 and eigh run on the CPU (GPUs have neither); the basis is tiny (d x r).
    gram = mx.astype(x.swapaxes(-1, -2) @ x, mx.float64, stream=mx.cpu)
    _, vecs = mx.linalg.eigh(gram, stream=mx.cpu)  # ascending eigenvalues
    vecs = mx.astype(vecs, mx.float32, stream=mx.cpu)[..., d - r:]
    n = x.shape[2]
    if n < r:  # only n directions carry energy: the rest of the top r is an arbitrary null
        # space, left out as zero columns (r = min(rank_cap, d, N))
        vecs = mx.concatenate([mx.zeros(vecs.shape[:-1] + (r - n,), mx.float32), vecs[..., r - n:]], -1)
    return vecs


def _energy_in(x: mx.array, basis: mx.array) -> mx.array:
    """``||x_i V_r||^2`` of each row ``[b, h, n]`` (float32); ``||x_i||^2`` where the basis is
    unfitted (all zero). One row (a decode step) is projected elementwise, not by a matmul."""
    x = x.astype(mx.float32)
    fitted = (mx.abs(basis).sum(axis=(-2, -1)) > 0)[:, :, None]
    if x.shape[2] == 1:
        energy = mx.square(x).sum(axis=-1)
        inside = mx.square((x[:, :, 0, :, None] * basis).sum(axis=-2)).sum(axis=-1, keepdims=True)
    else:
        energy = evict.row_sq_norms(x)
        inside = mx.square(basis.swapaxes(-1, -2) @ x.swapaxes(-1, -2)).sum(axis=-2)
    return mx.where(fitted, inside, energy)


def _leverage(x: mx.array, basis: mx.array) -> mx.array:
    """Energy leverage ``||x_i V_r||^2 / ||X||_F^2`` of the rows of ``x`` in the subspace
    ``basis``; the full-rank energy share where the basis is unfitted (all zero)."""
    total = mx.maximum(evict.row_sq_norms(x).sum(axis=-1, keepdims=True), _TINY)
    return _energy_in(x, basis) / total


def curdkv_leverage(x: Float[Array, "b h n d"], rank_cap: int) -> Float[Array, "b h n"]:
    """Rank-capped energy leverage of each row: ``||x_i V_r||^2 / ||X||_F^2`` (float32)."""
    n, d = x.shape[2], x.shape[3]
    r = min(rank_cap, d, n)
    if r >= min(d, n):  # the top-r subspace holds every row: leverage is the row's energy share
        x = x.astype(mx.float32)
        return (x * x).sum(axis=-1) / mx.maximum((x * x).sum(axis=(2, 3)), _TINY)[:, :, None]
    return _leverage(x, _fit_basis(x, r))


def _score(state: CurDKVState, keys, values, queries, evicting) -> evict.Scored:
    """Key energy times value energy in the subspaces, carried as ``scores``; a chunk that
    overflows refits both subspaces (and rescores the stored rows) first."""
    n, s = state.keys.shape[2], keys.shape[2]
    kb, vb, stored = state.key_basis, state.value_basis, state.scores
    if s > 1 and evicting:
        r = kb.shape[-1]
        kb = _fit_basis(mx.concatenate([state.keys, keys], axis=2), r)
        vb = _fit_basis(mx.concatenate([state.values, values], axis=2), r)
        stored = _energy_in(state.keys, kb) * _energy_in(state.values, vb) if n else stored
    fresh = _energy_in(keys, kb) * _energy_in(values, vb)
    scores = mx.concatenate([stored, fresh], axis=2) if evicting else None
    return evict.Scored(scores, {"scores": (stored, fresh), "key_basis": kb, "value_basis": vb})


def _kernel(state: CurDKVState, keys, values, queries) -> dict:
    # a decode step never refits: the stored scores stand, the new token is scored
    scores = (state.scores, _energy_in(keys, state.key_basis) * _energy_in(values, state.value_basis))
    return dict(by=scores, carry=scores)


def _fit_reference(x: np.ndarray, r: int) -> np.ndarray:
    """One head: top-``r`` right singular vectors ``[d, r]`` of ``x [N, d]``."""
    d = x.shape[1]
    if r >= d:
        return np.eye(d)
    with np.errstate(over="ignore", invalid="ignore"):  # rows of non-finite energy: left out
        x = np.where(np.isfinite((x.astype(np.float32) ** 2).sum(axis=1))[:, None], x, 0.0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)  # rows of vt: right singular vectors
    basis = vt[:r].T
    if basis.shape[1] < r:  # fewer rows than r: zero columns stand for the null space
        basis = np.concatenate([basis, np.zeros((d, r - basis.shape[1]))], axis=1)
    return basis


def _energy_reference(x: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """One head: ``||x_i V_r||^2`` ``[N]`` of rows ``[N, d]`` in ``basis`` (float64); the row's
    energy when the basis is unfitted. Divided by ``||X||_F^2`` it is the leverage; the
    ranking within a head needs no division."""
    if not np.abs(basis).sum():  # never fitted: full-rank energy
        return (x * x).sum(axis=1)
    proj = x @ basis
    return (proj * proj).sum(axis=1)


def _score_reference(state: CurDKVState, head: ref.Head) -> evict.Scored:
    kb, vb = head.carried["key_basis"], head.carried["value_basis"]
    x, y = head.keys.astype(np.float64), head.values.astype(np.float64)
    if head.s > 1 and head.evicting:  # a chunk that overflows refits the subspaces
        kb, vb = _fit_reference(x, kb.shape[-1]), _fit_reference(y, vb.shape[-1])
    score = _energy_reference(x, kb) * _energy_reference(y, vb)
    return evict.Scored(score, {"scores": score, "key_basis": kb, "value_basis": vb})


method = register("curdkv", CurDKVState, init,
                  evict.score_and_keep(_score, _score_reference, kernel=evict.ScoreKernel(_kernel),
                                       carry=("scores",),
                                       fields=("key_basis", "value_basis")))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
