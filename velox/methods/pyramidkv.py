"""PyramidKV: SnapKV selection with per-layer budgets on a pyramid (more below, less above).

The schedule (:func:`pyramid_budgets`) is static: every layer keeps the protected tokens
(sinks and observation window); the rest of the average budget, ``free = budget - n_sink -
obs_window``, is tapered linearly from ``2 * free - free / beta`` at the bottom layer to
``free / beta`` at the top (at least 1), as in the authors' code, then rounded so the layers
sum to exactly ``n_layers * budget``. The ``layer_params`` hook hands each layer its budget;
``init`` takes that layer's budget, and within a layer the update is SnapKV's (its
:func:`velox.methods.snapkv.votes`): a prefill chunk (``s > 1``) is cut to ``budget`` by the
observation window's pooled votes, a decode token is appended. Backends: ``reference`` and
``mlx``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import mlx.core as mx

from .. import evict
from ..crosslayer import round_to_total
from ..registry import register
from ..spec import load_spec, validate_params
from .snapkv import votes, votes_reference

__all__ = ["PyramidKVState", "State", "init", "update", "get_kv", "nbytes", "pyramid_budgets"]


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
    p = validate_params(load_spec("pyramidkv"), params)
    budgets = pyramid_budgets(n_layers, p["budget"], p["beta"], reserved=p["n_sink"] + p["obs_window"])
    return [{**p, "budget": b} for b in budgets]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, obs_window: int = 8, n_sink: int = 4, kernel_size: int = 7,
         pooling: str = "maxpool", beta: float = 2.0, backend: str = "auto") -> PyramidKVState:
    """Empty state of one layer; ``budget`` is this layer's (from :func:`pyramid_budgets`).

    Args:
        budget: tokens kept per head after each prefill chunk: the average over layers in
            layer_params, this layer's own in pyramidkv_init.
        obs_window: newest prompt tokens whose queries vote; always kept.
        n_sink: leading tokens never evicted.
        kernel_size: pooling width over neighbouring positions (odd; 1 = no pooling).
        pooling: pooling of the votes.
        beta: pyramid steepness: the top layer keeps 1/beta of the average selectable budget
            (1 = flat).
    """
    return evict.empty_state(PyramidKVState, locals())


PyramidKVState = State = evict.state_type(
    "PyramidKVState", init,
    "Kept rows and their absolute positions (SnapKV's state, with this layer's budget).", grows=True)


# Within a layer the rule is SnapKV's, with the layer's own budget.
method = register("pyramidkv", PyramidKVState, init, evict.score_and_keep(votes, votes_reference),
                  layer_params=_layer_params)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
