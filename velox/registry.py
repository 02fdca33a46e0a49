"""The method registry: key -> the method's functions, backends and spec.

Generic code (adapter, CLI, tests, benchmarks) goes through this table and needs no
per-method branches. Kernel modules add backends to a registered method with
:func:`register_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .spec import Spec, load_spec

State = tuple  # every state record is a typing.NamedTuple

__all__ = ["Method", "register", "register_backend", "get_method", "method_keys", "method_of",
           "dims_of"]


@dataclass
class Method:
    """One registered method: its state type, its functions and its spec."""

    key: str
    state_type: type
    init: Callable[..., State]
    update: Callable[..., State]
    get_kv: Callable[[State], tuple[mx.array, mx.array]]
    nbytes: Callable[[State], int]
    positions: Callable[[State], mx.array]
    backends: dict[str, Callable[..., State]] = field(default_factory=dict)
    error_bound: Callable[[State], tuple[mx.array, mx.array]] | None = None
    dims: Callable[[State], tuple[int, int, int, mx.Dtype]] | None = None
    # Cross-layer hooks (see docs/adding-a-method.md):
    layer_params: Callable[[int, dict[str, Any]], list[dict[str, Any]]] | None = None
    model_init: Callable[[list[dict[str, Any]]], tuple] | None = None
    layer_update: Callable[..., tuple[tuple, State]] | None = None
    attend: Callable[..., mx.array] | None = None
    spec_override: Spec | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def per_layer_params(self, n_layers: int, params: dict[str, Any]) -> list[dict[str, Any]]:
        """Parameters of each of ``n_layers`` layers (a schedule where the method has one)."""
        if self.layer_params is None:
            return [dict(params) for _ in range(n_layers)]
        return self.layer_params(n_layers, dict(params))

    @property
    def spec(self) -> Spec:
        """The method's spec (its file in ``velox/specs``, or a generated one for compositions)."""
        return self.spec_override if self.spec_override is not None else load_spec(self.key)


_REGISTRY: dict[str, Method] = {}
_BY_STATE: dict[type, Method] = {}


def _stored_positions(state: State) -> mx.array:
    return state.positions


def register(key: str, *, state_type: type, init: Callable, update: Callable,
             get_kv: Callable, nbytes: Callable, backends: dict[str, Callable],
             positions: Callable | None = None, error_bound: Callable | None = None,
             dims: Callable | None = None, layer_params: Callable | None = None,
             model_init: Callable | None = None, layer_update: Callable | None = None,
             attend: Callable | None = None, **extras: Any) -> Method:
    """Add a method to the registry (called once by each method module).

    Args:
        positions: absolute positions ``[b, h, n]`` of what ``get_kv`` returns (default: the
            state's ``positions`` field).
        error_bound: per-element bound ``(keys, values)`` on ``|get_kv - input|`` (lossy methods).
        dims: ``(batch, kv_heads, head_dim, dtype)`` of a state (default: from ``state.keys``).
        layer_params: ``(n_layers, params) -> [params per layer]``: a static per-layer schedule.
        model_init, layer_update: cross-layer methods. ``model_init(per_layer_params)`` returns
            a model-level record; ``layer_update(record, layer, state, keys, values, *,
            queries=None) -> (record, state)`` is called for layers 0..L-1 in order within
            one forward, threading the record.
        attend: ``attend(state, queries, keys, values, *, scale, mask) -> out``: attention of
            ``queries [b, q, s, d]`` over the stored tokens plus ``s`` new ones, for methods
            whose attention is not plain attention over ``get_kv`` (sparse page selection,
            attention on packed quantized codes). ``mask`` is ``None`` or ``"causal"``.
    """
    if key in _REGISTRY:
        raise ValueError(f"method {key!r} is already registered")
    if (model_init is None) != (layer_update is None):
        raise ValueError(f"{key}: model_init and layer_update come together")
    m = Method(key=key, state_type=state_type, init=init, update=update, get_kv=get_kv,
               nbytes=nbytes, positions=positions or _stored_positions,
               backends=dict(backends), error_bound=error_bound, dims=dims,
               layer_params=layer_params, model_init=model_init, layer_update=layer_update,
               attend=attend, extras=extras)
    _REGISTRY[key] = m
    _BY_STATE[state_type] = m
    return m


def register_backend(key: str, backend: str, update: Callable) -> None:
    """Attach a backend implementation of ``key``'s update (used by kernel modules)."""
    get_method(key).backends[backend] = update


def get_method(key: str) -> Method:
    """Return the registered method ``key``; unknown keys raise ``ValueError``."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ValueError(f"unknown method {key!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def method_keys() -> tuple[str, ...]:
    """Keys of every registered method, sorted."""
    return tuple(sorted(_REGISTRY))


def method_of(state: State) -> Method:
    """The method a state record belongs to."""
    try:
        return _BY_STATE[type(state)]
    except KeyError:
        raise ValueError(f"{type(state).__name__} is not the state of a registered method") from None


def prepare_init(key: str, batch: int, kv_heads: int, head_dim: int, dtype: mx.Dtype,
                 backend: str, params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Validate an ``init`` call: dims, parameters (spec ranges, constraints), backend.

    Constraints in a spec may name ``batch``, ``kv_heads`` and ``head_dim`` as well.
    Returns the full parameter dict and the resolved backend name.
    """
    from .backend import resolve_backend
    from .spec import validate_params
    from .validate import check_dims

    check_dims(batch, kv_heads, head_dim, dtype)
    method = get_method(key)
    full = validate_params(method.spec, params, dims=dict(batch=batch, kv_heads=kv_heads,
                                                          head_dim=head_dim))
    return full, resolve_backend(backend, key, method.backends)


def dispatch(key: str, state: State, keys: mx.array, values: mx.array,
             queries: mx.array | None, dims: tuple[int, int, int, mx.Dtype]) -> State:
    """Validate an ``update`` call against the state's dims and run the state's backend."""
    from .validate import check_update

    b, h, d, dtype = dims
    check_update(keys, values, queries, batch=b, heads=h, head_dim=d, dtype=dtype)
    return _REGISTRY[key].backends[state.backend](state, keys, values, queries)


def dims_of(field: str) -> Callable[[Any], tuple[int, int, int, mx.Dtype]]:
    """A ``dims`` function (``register(..., dims=...)``) for states whose array ``field`` is
    ``[b, h, n, d]``: it returns ``(batch, kv_heads, head_dim, dtype)`` of that array."""
    def dims(state) -> tuple[int, int, int, mx.Dtype]:
        rows = getattr(state, field)
        b, h, _, d = rows.shape
        return b, h, d, rows.dtype
    dims.__doc__ = f"``(batch, kv_heads, head_dim, dtype)`` of the state's ``{field} [b, h, n, d]``."
    return dims
