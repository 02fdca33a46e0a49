"""KNorm: keep the keys with the lowest L2 norm (they draw the most attention).

A token's score is its key's L2 norm, fixed at insertion: ``-norm`` with ``keep="low"`` (the
paper), ``+norm`` with ``keep="high"`` (the inverted ablation). Every update keeps the sinks,
the ``recent`` newest tokens and the best-scoring rest, ``budget`` in all; a multi-token chunk
is one selection over stored + new tokens. With ``recent=0`` the kept set is a function of the
tokens seen only (one chunk or token by token end alike).

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache scores with the
``mlx`` ops and finds the loser and moves the rows in one fused kernel,
``velox.kernels.evict.compact``; every other step runs the ``mlx`` ops).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from ..registry import register

__all__ = ["KNormState", "State", "init", "update", "get_kv", "nbytes"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, recent: int = 32, keep: str = "low", slack: int = 0,
         backend: str = "auto") -> KNormState:
    """Empty KNorm state keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head, sinks and recent window included.
        n_sink: leading tokens never evicted (0 = the paper).
        recent: newest tokens never evicted (0 = the paper).
        keep: keep the lowest-norm keys (``"low"``, the paper) or the highest (``"high"``,
            the inverted ablation).
        slack: rows held beyond budget: a full state (budget + slack rows) keeps budget in
            one selection, and the next slack tokens fill the freed slots (0 = per token).
    """
    return evict.empty_state(KNormState, locals())


KNormState = State = evict.state_type(
    "KNormState", init,
    "Kept rows and their absolute positions; scores are recomputed from the kept keys.")


def _score(state: KNormState, keys, values, queries, evicting):
    """Every candidate's score (stored ++ new): its key norm, negated for ``keep='low'``."""
    norms = mx.concatenate([evict.row_norms(state.keys), evict.row_norms(keys)], axis=2)
    return -norms if state.keep == "low" else norms


def _score_reference(state: KNormState, head: ref.Head):
    norms = np.linalg.norm(head.keys.astype(np.float64), axis=-1)
    return -norms if state.keep == "low" else norms


method = register("knorm", KNormState, init, evict.score_and_keep(_score, _score_reference))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
