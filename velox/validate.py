"""Input validation shared by every method's ``update``: clear ``ValueError`` messages."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["check_update", "check_dims", "check_query_heads", "is_floating"]

_FLOATS = (mx.float16, mx.bfloat16, mx.float32, mx.float64)


def is_floating(dtype: mx.Dtype) -> bool:
    return dtype in _FLOATS


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def check_dims(batch: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> None:
    """Validate the arguments every ``<key>_init`` takes."""
    for name, v in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not isinstance(dtype, mx.Dtype) or not is_floating(dtype):
        raise ValueError(f"dtype must be a floating MLX dtype (float16, bfloat16, float32), got {dtype!r}")


def _check_array(name: str, x: object) -> mx.array:
    if not isinstance(x, mx.array):
        raise ValueError(f"{name} must be an mx.array, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have rank 4 [b, h, s, d], got shape {tuple(x.shape)}")
    if not is_floating(x.dtype):
        raise ValueError(f"{name} dtype {_dtype_name(x.dtype)} is not floating point")
    return x


def check_update(keys: mx.array, values: mx.array, queries: mx.array | None, *,
                 batch: int, heads: int, head_dim: int, dtype: mx.Dtype) -> None:
    """Check new keys/values (and optional queries) against the state they update."""
    _check_array("keys", keys)
    _check_array("values", values)
    b, h, s, d = keys.shape
    if tuple(values.shape) != tuple(keys.shape):
        raise ValueError(f"values shape {tuple(values.shape)} differs from keys shape {tuple(keys.shape)}")
    if s == 0:
        raise ValueError("keys hold s=0 new tokens; an update needs at least one")
    if b != batch:
        raise ValueError(f"keys have batch {b}, the state holds batch {batch}")
    if h != heads:
        raise ValueError(f"keys have {h} kv heads, the state holds {heads}")
    if d != head_dim:
        raise ValueError(f"keys have head_dim {d}, the state holds head_dim {head_dim}")
    if keys.dtype != dtype or values.dtype != dtype:
        raise ValueError(
            f"keys/values dtype {_dtype_name(keys.dtype)}/{_dtype_name(values.dtype)} "
            f"differs from the state's {_dtype_name(dtype)}")
    if queries is None:
        return
    _check_array("queries", queries)
    qb, hq, qs, qd = queries.shape
    if qb != b or qs != s or qd != d:
        raise ValueError(
            f"queries shape {tuple(queries.shape)} must be [b={b}, q, s={s}, d={d}]")
    if hq == 0 or hq % h:
        raise ValueError(f"queries have {hq} heads, not a positive multiple of the {h} kv heads")


def check_query_heads(queries: mx.array, keys: mx.array) -> None:
    """Check the queries an ``attend`` takes: rank 4 ``[b, q, s, d]`` with ``q`` a positive
    multiple of the kv heads of ``keys [b, h, s, d]`` (shape reads only: no evaluation)."""
    if not isinstance(queries, mx.array) or queries.ndim != 4:
        got = tuple(queries.shape) if isinstance(queries, mx.array) else type(queries).__name__
        raise ValueError(f"queries must be an mx.array of rank 4 [b, q, s, d], got {got}")
    if not isinstance(keys, mx.array) or keys.ndim != 4:
        _check_array("keys", keys)  # raises: not an array of rank 4
    hq, h = queries.shape[1], keys.shape[1]
    if hq == 0 or hq % h:
        raise ValueError(f"queries have {hq} heads, not a positive multiple of the {h} kv heads")
