"""velox: functional KV-cache compression for MLX.

Every method ``m`` is a state record ``MState`` plus pure functions ``m_init``, ``m_update``,
``m_get_kv`` and ``m_bytes``, vectorised over batch and kv heads. The registry maps each
method key to its functions and spec; :func:`init`, :func:`update`, :func:`get_kv` and
:func:`nbytes` dispatch on it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import methods as _methods  # noqa: F401  (registers every method)
from .accounting import fp16_bytes, state_nbytes
from .backend import BACKENDS, BackendUnavailable
from .methods.h2o import H2OState, h2o_bytes, h2o_get_kv, h2o_init, h2o_update
from .methods.kivi import KiviState, kivi_bytes, kivi_get_kv, kivi_init, kivi_update
from .methods.snapkv import SnapKVState, snapkv_bytes, snapkv_get_kv, snapkv_init, snapkv_update
from .methods.streaming_llm import (StreamingLLMState, streaming_llm_bytes, streaming_llm_get_kv,
                                    streaming_llm_init, streaming_llm_update)
from .methods.tova import TovaState, tova_bytes, tova_get_kv, tova_init, tova_update
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
    "BACKENDS", "BackendUnavailable", "Method", "Spec", "fp16_bytes", "get_kv", "get_method",
    "init", "load_spec", "method_keys", "method_of", "nbytes", "positions", "state_nbytes",
    "tokens_seen", "update",
    "H2OState", "h2o_init", "h2o_update", "h2o_get_kv", "h2o_bytes",
    "KiviState", "kivi_init", "kivi_update", "kivi_get_kv", "kivi_bytes",
    "SnapKVState", "snapkv_init", "snapkv_update", "snapkv_get_kv", "snapkv_bytes",
    "StreamingLLMState", "streaming_llm_init", "streaming_llm_update", "streaming_llm_get_kv",
    "streaming_llm_bytes",
    "TovaState", "tova_init", "tova_update", "tova_get_kv", "tova_bytes",
]
