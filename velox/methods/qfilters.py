"""Q-Filters: keep the keys with the largest projection on the head's query direction.

Queries of a head share a favoured direction ``u`` (``E<Q, u> > 0``) and ``E_Q <Q, K> ~
kappa <K, u>`` with ``kappa > 0``, so ``<K, u>`` ranks keys by the attention they can expect
from any query. The filter ``u`` of a kv head is the top right singular vector of its query
heads' calibration queries, signed so the queries project positively on it
(:func:`qfilters_from_queries`). :func:`init_calibrated` installs any such filters;
``calibration="smollm2-135m-instruct"`` loads layer ``layer``'s from the artifact shipped in
``velox.adapters`` (``make_cache`` numbers the layers through ``layer_params``). Each
update scores every candidate (stored + new) by ``sign * <k, u>`` and keeps sinks, the
``recent`` newest tokens and the best of the rest, ``budget`` in all. With calibrated filters
the kept set is a function of the tokens seen alone (a prompt in one chunk or token by token
ends the same).

Without calibrated filters (``calibration="none"``), each kv head's direction is the sum of the
queries of the first ``calib_tokens`` tokens it sees (their keys when no queries are given):
the paper's ``u = argmax_u E<Q, u>`` is the mean query direction, estimated online. The
estimate changes while calibration lasts, then freezes.

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache scores with the
``mlx`` ops and finds the loser and moves the rows in one fused kernel,
``velox.kernels.evict.compact``; every other step runs the ``mlx`` ops).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..attention import scoring_queries
from ..registry import register

__all__ = ["QFiltersState", "State", "init", "update", "get_kv", "nbytes", "init_calibrated",
           "qfilters_init_calibrated", "qfilters_from_queries"]

#: Calibrations shipped in ``velox.adapters/data``: name -> file (``filters [layers, h, d]``).
ARTIFACTS = {"smollm2-135m-instruct": "qfilters_smollm2.npz"}


class QFiltersState(NamedTuple):
    """Kept rows, their positions, and each kv head's filter direction."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    filters: Float[Array, "b h d"]  # float32; calibrated unit filters, or the running query sum
    budget: int
    n_sink: int
    recent: int
    calib_tokens: int
    sign: int
    calibration: str
    layer: int
    slack: int
    calibrated: bool
    empty: int  # empty slots (velox.evict)
    backend: str
    ragged: bool = False  # batch rows hold different numbers of tokens (velox.ragged)


def qfilters_from_queries(queries: Float[Array, "t q d"] | Float[np.ndarray, "t q d"],
                          kv_heads: int) -> Float[np.ndarray, "h d"]:
    """Q-Filters ``[kv_heads, d]`` (float32, unit norm) from calibration queries of one layer.

    ``queries`` are post-RoPE queries ``[tokens, q_heads, d]``; query head ``i`` reads kv head
    ``i // (q_heads // kv_heads)``. A kv head's filter is the top right singular vector of its
    query heads' queries stacked ``[tokens * g, d]`` (no centring; computed as the top
    eigenvector of their ``d x d`` Gram matrix), signed so that the sum of the queries'
    projections is positive (``sgn(1^T u_1)`` in the paper).
    """
    q = ref.to_np(queries) if isinstance(queries, mx.array) else np.asarray(queries, np.float64)
    t, hq, d = q.shape
    if hq % kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of kv_heads={kv_heads}")
    g = hq // kv_heads
    out = np.zeros((kv_heads, d))
    for j in range(kv_heads):
        x = q[:, j * g:(j + 1) * g].reshape(-1, d)
        _, vecs = np.linalg.eigh(x.T @ x)  # right singular vectors of x, ascending
        v = vecs[:, -1]
        out[j] = v if (x @ v).sum() >= 0 else -v
    return out.astype(np.float32)


@lru_cache(maxsize=None)
def _artifact(name: str) -> np.ndarray:
    with resources.as_file(resources.files("velox.adapters") / "data" / ARTIFACTS[name]) as path:
        with np.load(path) as data:
            return data["filters"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, recent: int = 32, calib_tokens: int = 128,
         sign: int = 1, calibration: str = "none", layer: int = 0, slack: int = 0,
         backend: str = "auto") -> QFiltersState:
    """Empty Q-Filters state: shipped filters (``calibration``, ``layer``) or the online estimate.

    Args:
        budget: tokens kept per head, sinks and recent tokens included.
        n_sink: leading tokens never evicted.
        recent: newest tokens never evicted.
        calib_tokens: without calibrated filters: the first tokens whose queries (or keys) set
            the direction.
        sign: 1 keeps the keys most aligned with the filter; -1 the least (ablation).
        calibration: shipped filters to load (none: the online estimate; any filters:
            init_calibrated).
        layer: layer whose shipped filters to load (make_cache numbers the layers).
        slack: rows held beyond budget: a full state (budget + slack rows) keeps budget in
            one selection, and the next slack tokens fill the freed slots (0 = per token).
    """
    if calibration != "none":
        table = _artifact(calibration)
        if layer >= len(table) or table.shape[1:] != (kv_heads, head_dim):
            raise ValueError(f"calibration {calibration!r} holds filters [{len(table)} layers, "
                             f"{table.shape[1]} kv heads, {table.shape[2]} dims]; asked for "
                             f"layer={layer}, kv_heads={kv_heads}, head_dim={head_dim}")
        filters = mx.broadcast_to(mx.array(table[layer])[None], (batch, kv_heads, head_dim))
    else:
        filters = mx.zeros((batch, kv_heads, head_dim), mx.float32)
    calibrated = calibration != "none"
    return evict.empty_state(QFiltersState, locals(), filters=mx.array(filters))


def _layer_params(n_layers: int, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Number the layers, so each loads its own calibrated filters."""
    return [dict(params, layer=i) for i in range(n_layers)]


def init_calibrated(filters: Float[Array, "h d"] | Float[np.ndarray, "h d"], batch: int,
                    kv_heads: int, head_dim: int, **params) -> QFiltersState:
    """Empty Q-Filters state scoring with calibrated ``filters`` ``[kv_heads, head_dim]``.

    ``filters`` come from :func:`qfilters_from_queries` (one layer's); ``params`` are
    :func:`init`'s (``calib_tokens``, ``calibration`` and ``layer`` are unused here).
    """
    state = init(batch, kv_heads, head_dim, **{**params, "calibration": "none"})
    f = mx.array(np.asarray(filters, np.float32)) if not isinstance(filters, mx.array) else filters
    if tuple(f.shape) != (kv_heads, head_dim):
        raise ValueError(f"filters shape {tuple(f.shape)} must be [kv_heads={kv_heads}, head_dim={head_dim}]")
    if not bool(mx.all(mx.isfinite(f)).item()):
        raise ValueError("filters hold non-finite values")
    f = mx.broadcast_to(f.astype(mx.float32)[None], (batch, kv_heads, head_dim))
    return state._replace(filters=mx.array(f), calibrated=True)


qfilters_init_calibrated = init_calibrated  # the name it had before ``init``


def _filters(state: QFiltersState, keys, queries) -> mx.array:
    """The filters after this update: online, the sum of the queries of tokens at positions
    below ``calib_tokens`` grows; calibrated, they stay."""
    if state.calibrated:
        return state.filters
    s = keys.shape[2]
    q = scoring_queries(keys, queries).astype(mx.float32)  # [b, h, g, s, d]
    at = state.next_pos.astype(mx.float32)[:, :, None] + mx.arange(s, dtype=mx.float32)
    inside = (at < state.calib_tokens).astype(mx.float32)  # [b, h, s]
    return state.filters + (q.sum(axis=2) * inside[..., None]).sum(axis=2)


def _scores(state: QFiltersState, filters, keys) -> mx.array:
    """Every candidate's score (stored ++ new): its key's projection on the filter, signed."""
    f = filters[:, :, :, None]
    return mx.concatenate([state.keys.astype(mx.float32) @ f, keys.astype(mx.float32) @ f],
                          axis=2)[..., 0] * state.sign


def _score(state: QFiltersState, keys, values, queries, evicting) -> evict.Scored:
    """The filters after this update (refreshed on every update); when evicting, every
    candidate's score under them."""
    filters = _filters(state, keys, queries)
    return evict.Scored(_scores(state, filters, keys) if evicting else None, {"filters": filters})


def _score_reference(state: QFiltersState, head: ref.Head) -> evict.Scored:
    filters = head.carried["filters"].astype(np.float32)
    if not state.calibrated:
        q = head.probes.astype(np.float32)
        N = len(head.positions)
        for t in range(head.s):  # token by token, while the calibration lasts
            if head.positions[N - head.s + t] < state.calib_tokens:
                filters += q[:, t].sum(axis=0)
    score = state.sign * (head.keys.astype(np.float64) @ filters.astype(np.float64))
    return evict.Scored(score, {"filters": filters})


State = QFiltersState
method = register("qfilters", QFiltersState, init,
                  evict.score_and_keep(_score, _score_reference, fields=("filters",)),
                  layer_params=_layer_params)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
