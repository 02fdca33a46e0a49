"""SqueezeAttention: H2O eviction per layer, with layer budgets reallocated once by importance.

Within a layer the update is H2O's (accumulated attention, ``grace``, ``decay``, sinks), with
the layer's own ``budget``. Across layers (``model_init`` / ``layer_update``): in the first
forward every layer measures its *concentration* ``c`` (mean pairwise cosine of the chunk's
keys, averaged over batch and heads) and evicts with the average budget; after the last layer
of that forward the budgets are reallocated once, ``share_l = avg * ((1 - strength) +
strength * w_l)`` with ``w_l = (1 - c_l) / mean(1 - c)`` (concentrated layers count as less
important), raised to the floor ``n_sink + grace + 1`` by taking from the layers above it,
and rounded so they sum to exactly the total. Every later forward runs each layer with its
budget (a layer given less shrinks at its next update, one given more grows into it).
``strength = 0`` keeps the uniform budget: every layer is H2O.

Backends: ``reference``, ``mlx`` and ``cuda`` (H2O's fused kernels for a decode step at a
full cache of the layer's budget; every other step runs the ``mlx`` ops).
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .._typing import Array, Float
from ..crosslayer import checked_update, layer_params, round_to_total
from ..distributed import LOCAL, Heads, head_gather
from ..heavy_hitters import heavy_hitter_kernel, heavy_hitter_reference, heavy_hitter_scores
from ..registry import get_method, register

__all__ = ["SqueezeState", "SqueezeRecord", "State", "init", "update", "get_kv", "nbytes",
           "squeeze_budgets", "concentration"]

KEY = "squeeze"


class SqueezeRecord(NamedTuple):
    """Model-level record threaded through ``layer_update`` (layers ``0..L-1`` per forward)."""

    concentration: Float[Array, "L"]  # measured in the first forward
    budgets: tuple[int, ...]          # each layer's budget in force
    resolved: bool                    # budgets reallocated (after the first forward)
    strength: float
    floor: int                        # smallest budget a layer may get


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, strength: float = 1.0, grace: int = 16,
         decay: float = 0.98, heads: Heads = LOCAL, backend: str = "auto") -> SqueezeState:
    """Empty state of one layer keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head: the layer's average budget before reallocation (sinks
            included).
        n_sink: leading tokens never evicted.
        strength: how far budgets follow layer importance (0 = uniform, every layer is h2o).
        grace: newest tokens never evicted (H2O's grace; not in the seed, added with h2o's
            default).
        decay: multiplier applied to accumulated scores at every token (H2O's decay; not in
            the seed, added with h2o's default).
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): the
            layer's concentration averages every shard's heads.
    """
    return evict.empty_state(SqueezeState, locals())


SqueezeState = State = evict.state_type(
    "SqueezeState", init,
    "One layer: kept rows, positions and accumulated attention ``scores`` (as H2O).",
    scores=Float[Array, "b h n"])


def concentration(keys: Float[Array, "b h s d"]) -> Float[Array, "b h"]:
    """Mean cosine similarity over the ``s * (s - 1)`` ordered pairs of distinct keys (0 if s < 2).

    ``||sum u||^2 - sum ||u||^2`` over the unit keys ``u`` (zero keys count as zero vectors):
    1 for identical directions, 0 for orthogonal keys, invariant to each key's scale.
    """
    s = keys.shape[2]
    if s < 2:
        return mx.zeros(keys.shape[:2], mx.float32)
    x = keys.astype(mx.float32)
    norm = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
    u = mx.where(norm > 0, x / mx.maximum(norm, 1e-30), 0.0)
    total = u.sum(axis=2)
    return ((total * total).sum(axis=-1) - (u * u).sum(axis=(2, 3))) / (s * (s - 1))


def squeeze_budgets(concentrations: Sequence[float], budget: int | Sequence[int], strength: float,
                    *, floor: int = 1) -> list[int]:
    """Reallocated per-layer budgets, summing to exactly the total of the average budgets.

    ``share_l = avg * ((1 - strength) + strength * w_l)``, ``w_l = (1 - c_l) / mean(1 - c)``
    (uniform when every ``c_l = 1``); shares under ``floor`` are raised to it and the excess
    over ``floor`` of the others scaled down to pay for it; largest-remainder rounding. A
    non-finite concentration counts as 1, the lowest importance (the non-finite rule of
    ``velox.evict``).
    """
    concentrations = [c if math.isfinite(c) else 1.0 for c in concentrations]
    L = len(concentrations)
    budgets = [budget] * L if isinstance(budget, int) else list(budget)
    if len(budgets) != L:
        raise ValueError(f"{len(budgets)} budgets for {L} layers")
    total = sum(budgets)
    if total < L * floor:
        raise ValueError(f"total budget {total} cannot give {L} layers floor={floor} each")
    avg, s = Fraction(total, L), Fraction(strength)
    imp = [1 - Fraction(c) for c in concentrations]
    mean = sum(imp) / L
    w = [x / mean for x in imp] if mean > 0 else [Fraction(1)] * L
    shares = [avg * ((1 - s) + s * wi) for wi in w]
    excess = [max(x - floor, Fraction(0)) for x in shares]
    spare = sum(excess)
    if spare > 0:
        shares = [floor + (total - L * floor) * e / spare for e in excess]
    return round_to_total(shares, total)


def _model_init(per_layer_params: list[dict[str, Any]]) -> SqueezeRecord:
    """The ``model_init`` hook: a record holding every layer's average budget, not yet resolved."""
    per_layer_params, strength = layer_params(KEY, per_layer_params, "strength")
    return SqueezeRecord(
        concentration=mx.zeros((len(per_layer_params),), mx.float32),
        budgets=tuple(int(p["budget"]) for p in per_layer_params), resolved=False,
        strength=float(strength),
        floor=max(p["n_sink"] + p["grace"] + 1 for p in per_layer_params))


def _layer_update(record: SqueezeRecord, layer: int, state: SqueezeState,
                  keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"], *,
                  queries: Float[Array, "b q s d"] | None = None) -> tuple[SqueezeRecord, SqueezeState]:
    """The ``layer_update`` hook: measure (first forward) or apply the layer's budget, then update."""
    checked_update(state, keys, values, queries)
    n_layers = len(record.budgets)
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer={layer} is outside the record's {n_layers} layers")
    if record.resolved and state.budget != record.budgets[layer]:
        state = state._replace(budget=record.budgets[layer])
    state = get_method(KEY).backends[state.backend](state, keys, values, queries)
    if not record.resolved:
        c = head_gather(state.heads, concentration(keys)).mean()
        conc = mx.where(mx.arange(n_layers) == layer, c, record.concentration)
        record = record._replace(concentration=conc)
        if layer == n_layers - 1:  # every layer has reported: reallocate once (host read)
            budgets = squeeze_budgets(np.array(conc, dtype=np.float64).tolist(), list(record.budgets),
                                      record.strength, floor=record.floor)
            record = record._replace(budgets=tuple(budgets), resolved=True)
    return record, state


# Within a layer the rule is H2O's, with the layer's own budget.
method = register(KEY, SqueezeState, init,
                  evict.score_and_keep(heavy_hitter_scores, heavy_hitter_reference,
                                       kernel=heavy_hitter_kernel, carry=("scores",)),
                  model_init=_model_init, layer_update=_layer_update)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
