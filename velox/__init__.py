"""velox: functional KV-cache compression for MLX.

Every method ``m`` is a state record ``MState`` plus pure functions ``m_init``, ``m_update``,
``m_get_kv`` and ``m_bytes``, vectorised over batch and kv heads. The registry maps each
method key to its functions and spec; :func:`init`, :func:`update`, :func:`get_kv` and
:func:`nbytes` dispatch on it.
"""

from __future__ import annotations

from typing import Any

from . import _blas  # noqa: F401  (first: OpenBLAS must load before mlx.core)

import mlx.core as mx

from . import methods as _methods  # noqa: F401  (registers every method)
from . import compose
from .accounting import fp16_bytes, state_nbytes
from .backend import BACKENDS, BackendUnavailable
from .registry import Method, State, get_method, method_keys, method_of
from .spec import Spec, load_spec

__version__ = "0.1.0"


def init(key: str, batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         backend: str = "auto", **params: Any) -> State:
    """``<key>_init`` by method key; unknown parameter names raise ``ValueError``."""
    method = get_method(key)
    unknown = sorted(set(params) - set(method.spec.params))
    if unknown:
        raise ValueError(f"{key} got unknown parameter(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(method.spec.params)}")
    return method.init(batch, kv_heads, head_dim, dtype=dtype, backend=backend, **params)


def update(state: State, keys: mx.array, values: mx.array, *,
           queries: mx.array | None = None) -> State:
    """``<key>_update`` for whichever method ``state`` belongs to."""
    return method_of(state).update(state, keys, values, queries=queries)


def get_kv(state: State) -> tuple[mx.array, mx.array]:
    """``<key>_get_kv`` for whichever method ``state`` belongs to."""
    return method_of(state).get_kv(state)


def nbytes(state: State) -> int:
    """``<key>_bytes`` for whichever method ``state`` belongs to."""
    return method_of(state).nbytes(state)


def positions(state: State) -> mx.array:
    """Absolute positions ``[b, h, n]`` of the tokens ``get_kv`` returns."""
    return method_of(state).positions(state)


def tokens_seen(state: State) -> int:
    """Tokens absorbed so far (the absolute position of the next token)."""
    return int(state.next_pos[0, 0].item())


__all__ = [
    "BACKENDS", "BackendUnavailable", "Method", "Spec", "compose", "fp16_bytes", "get_kv", "get_method",
    "init", "load_spec", "method_keys", "method_of", "nbytes", "positions", "state_nbytes",
    "tokens_seen", "update",
]


def _export_methods() -> None:
    """Expose each method's ``<key>_init/_update/_get_kv/_bytes`` and state type here."""
    for key in method_keys():
        if not key.isidentifier():  # compositions such as "tova+affine": use velox.init(key)
            continue
        m = get_method(key)
        names = {f"{key}_init": m.init, f"{key}_update": m.update, f"{key}_get_kv": m.get_kv,
                 f"{key}_bytes": m.nbytes, m.state_type.__name__: m.state_type}
        globals().update(names)
        __all__.extend(names)


compose.evict_then_store("tova")  # TOVA survivors as per-token affine codes: "tova+affine"
_export_methods()
