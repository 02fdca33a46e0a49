"""PyramidKV: SnapKV selection with per-layer budgets on a pyramid (more below, less above).

The schedule (:func:`pyramid_budgets`) is static: every layer keeps the protected tokens
(sinks and observation window); the rest of the average budget, ``free = budget - n_sink -
obs_window``, is tapered linearly from ``2 * free - free / beta`` at the bottom layer to
``free / beta`` at the top (at least 1), as in the authors' code, then rounded so the layers
sum to exactly ``n_layers * budget``. The ``layer_params`` hook hands each layer its budget;
``pyramidkv_init`` takes that layer's budget, and within a layer the update is SnapKV's: a
prefill chunk (``s > 1``) is cut to ``budget`` by the observation window's pooled votes, a
decode token is appended.

References:
    Cai, Zhang, Gao, Liu, Liu, Lu, Xiong, Dong, Chang, Hu, Xiao. PyramidKV: Dynamic KV Cache
    Compression based on Pyramidal Information Funneling. COLM 2025. arXiv:2406.02069.

Deviations from the paper:
    * The schedule does not depend on the prompt length (the paper's code caps the bottom
      budget at the prompt length); it is an exact-sum integer rounding of the arithmetic one.
    * ``n_sink`` protects the first tokens and, like the window, sits outside the taper.
    * Within a layer, SnapKV's deviations: chunked prompts re-select over stored + new, and
      without real queries the window's keys are its queries (key-as-query proxy).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, NamedTuple

import mlx.core as mx

from .. import evict
from .._typing import Array, Float, Int
from ..accounting import state_nbytes
from ..crosslayer import round_to_total
from ..registry import dispatch, prepare_init, register
from ..spec import load_spec, validate_params
from .snapkv import SnapKVState
from .snapkv import _update_mlx as _snapkv_mlx
from .snapkv import _update_reference as _snapkv_reference

__all__ = ["PyramidKVState", "pyramidkv_init", "pyramidkv_update", "pyramidkv_get_kv",
           "pyramidkv_bytes", "pyramid_budgets"]

KEY = "pyramidkv"


class PyramidKVState(NamedTuple):
    """Kept rows and their absolute positions (SnapKV's state, with this layer's budget)."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]
    positions: Int[Array, "b h n"]
    next_pos: Int[Array, "b h"]
    budget: int
    obs_window: int
    n_sink: int
    kernel_size: int
    pooling: str
    beta: float
    backend: str


def pyramid_budgets(n_layers: int, budget: int, beta: float, *, reserved: int = 0) -> list[int]:
    """Per-layer budgets, non-increasing with depth, summing to exactly ``n_layers * budget``.

    Every layer gets ``reserved`` tokens; the rest, ``free = budget - reserved``, is an
    arithmetic sequence from ``2 * free - top`` (layer 0) to ``top = max(free / beta, 1)``
    (the last layer), rounded by largest remainder (ties to the lower layer). ``beta = 1``
    is flat. Requires ``n_layers >= 1``, ``free >= 1`` and ``beta >= 1``.
    """
    if n_layers < 1:
        raise ValueError(f"n_layers={n_layers} must be >= 1")
    free = budget - reserved
    if free < 1:
        raise ValueError(f"budget={budget} must exceed reserved={reserved}")
    if not beta >= 1:
        raise ValueError(f"beta={beta} must be >= 1")
    if n_layers == 1:
        return [budget]
    top = max(Fraction(free) / Fraction(beta), Fraction(1))
    bottom = 2 * free - top
    step = (bottom - top) / (n_layers - 1)
    shares = [bottom - step * i for i in range(n_layers)]
    return [reserved + t for t in round_to_total(shares, n_layers * free)]


def _layer_params(n_layers: int, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``layer_params`` hook: ``params`` (average budget) -> each layer's parameters."""
    p = validate_params(load_spec(KEY), params)
    budgets = pyramid_budgets(n_layers, p["budget"], p["beta"], reserved=p["n_sink"] + p["obs_window"])
    return [{**p, "budget": b} for b in budgets]


def pyramidkv_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
                   budget: int = 512, obs_window: int = 8, n_sink: int = 4, kernel_size: int = 7,
                   pooling: str = "maxpool", beta: float = 2.0, backend: str = "auto") -> PyramidKVState:
    """Empty state of one layer; ``budget`` is this layer's (from :func:`pyramid_budgets`)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(budget=budget, obs_window=obs_window, n_sink=n_sink,
                                   kernel_size=kernel_size, pooling=pooling, beta=beta))
    return PyramidKVState(*evict.empty_rows(batch, kv_heads, head_dim, dtype), **p, backend=backend)


def _as_snapkv(state: PyramidKVState) -> SnapKVState:
    return SnapKVState(state.keys, state.values, state.positions, state.next_pos, state.budget,
                       state.obs_window, state.n_sink, state.kernel_size, state.pooling, state.backend)


def _from_snapkv(state: PyramidKVState, new: SnapKVState) -> PyramidKVState:
    return state._replace(keys=new.keys, values=new.values, positions=new.positions,
                          next_pos=new.next_pos)


# Within a layer the rule is SnapKV's, run on a SnapKV view of this layer's state.
def _update_mlx(state: PyramidKVState, keys, values, queries) -> PyramidKVState:
    return _from_snapkv(state, _snapkv_mlx(_as_snapkv(state), keys, values, queries))


def _update_reference(state: PyramidKVState, keys, values, queries) -> PyramidKVState:
    return _from_snapkv(state, _snapkv_reference(_as_snapkv(state), keys, values, queries))


def pyramidkv_update(state: PyramidKVState, keys: Float[Array, "b h s d"],
                     values: Float[Array, "b h s d"], *,
                     queries: Float[Array, "b q s d"] | None = None) -> PyramidKVState:
    """Prefill chunk (``s > 1``): select to this layer's ``budget``; decode token: append."""
    return dispatch(KEY, state, keys, values, queries, evict.dims(state))


def pyramidkv_get_kv(state: PyramidKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Kept keys and values, in increasing absolute position."""
    return state.keys, state.values


def pyramidkv_bytes(state: PyramidKVState) -> int:
    """Bytes of every array the state holds."""
    return state_nbytes(state)


register(KEY, state_type=PyramidKVState, init=pyramidkv_init, update=pyramidkv_update,
         get_kv=pyramidkv_get_kv, nbytes=pyramidkv_bytes,
         backends={"reference": _update_reference, "mlx": _update_mlx}, layer_params=_layer_params)
