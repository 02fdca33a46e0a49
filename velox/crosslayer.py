"""Cross-layer helpers: exact-sum integer budgets and validated per-layer updates.

Per-layer budgets (PyramidKV's pyramid, SqueezeAttention's reallocation) are real-valued
shares of a total number of tokens; :func:`round_to_total` makes them integers that sum to
the total exactly. :func:`checked_update` validates one layer's ``keys``/``values``/``queries``
inside a ``layer_update`` hook, as ``<key>_update`` does; :func:`layer_params` validates the
per-layer parameters a ``model_init`` hook receives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import mlx.core as mx

from typing import Any

from .spec import load_spec, validate_params
from .validate import check_update

__all__ = ["round_to_total", "checked_update", "layer_params"]


def round_to_total(shares: Sequence[float | Fraction], total: int) -> list[int]:
    """Largest-remainder rounding of ``shares`` (summing to ``total``) to integers summing to it.

    Each result is the floor or the ceiling of its share; the ``total - sum(floors)`` units
    left go to the largest fractional parts, ties to the earlier entry. A non-increasing list
    of shares therefore stays non-increasing, and shares ``>= f`` (an integer) stay ``>= f``.
    """
    if not shares:
        return []
    exact = [Fraction(x) for x in shares]
    floors = [math.floor(x) for x in exact]
    left = min(max(total - sum(floors), 0), len(exact))
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    if sum(floors) != total:
        raise ValueError(f"shares sum to {float(sum(exact))}, not to the total {total}")
    return floors


def checked_update(state, keys: mx.array, values: mx.array, queries: mx.array | None) -> None:
    """Validate one layer's update inputs against ``state`` (raises ``ValueError``): the dims
    its method reads from it (``keys [b, h, n, d]`` where the method has no ``dims``)."""
    from .registry import method_of
    from .state_dims import method_dims

    b, h, d, dtype = method_dims(method_of(state), state)
    check_update(keys, values, queries, batch=b, heads=h, head_dim=d, dtype=dtype)


def layer_params(key: str, per_layer_params: list[dict[str, Any]], shared: str) -> tuple[list[dict], Any]:
    """Each layer's parameters of method ``key`` validated against its spec, and the value of
    the parameter ``shared``, which every layer must give alike (a model-level choice)."""
    if not per_layer_params:
        raise ValueError(f"{key} needs at least one layer")
    spec = load_spec(key)
    params = [validate_params(spec, p) for p in per_layer_params]
    values = {p[shared] for p in params}
    if len(values) > 1:
        raise ValueError(f"layers disagree on {shared}: {sorted(values)}")
    return params, values.pop()
