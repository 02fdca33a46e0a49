"""Codecs as values: how a cache holds rows (keys or values) as codes.

A codec is a :class:`Codec` record of pure functions over its own record of codes:

* ``tables(head_dim, params) -> Tables``: the codec's static arrays (rotation, codebooks,
  sketch matrix), a deterministic function of ``head_dim`` and ``params`` (a seed among them);
  no batch or token axis; MLX arrays.
* ``encode(tables, rows) -> Codes``: rows ``[b, h, n, d]`` (any float dtype) to a ``NamedTuple``
  of arrays that all have leading ``[b, h, n]`` axes (one entry per token), packed for real:
  their ``nbytes`` are what the cache holds.
* ``decode(tables, codes) -> rows``: ``[b, h, n, d]`` float32 reconstruction.
* ``scores(tables, queries, codes) -> [b, h, m, n]``: float32 estimates of ``q . k`` for
  queries ``[b, h, m, d]`` (float32) read from the codes, without decoding the rows where the
  codec can (rotated query against centroids, sign sketches).
* ``encode_np``, ``decode_np``, ``scores_np``: the NumPy twins (tables as NumPy arrays,
  ``numpy_tables``), the executable spec, giving the same codes.
* ``params``: the names of the method parameters it reads; ``error``: its error statement
  (a bound, or unbiasedness with a variance bound); ``head``: one (batch row, kv head)'s
  tables, for a codec whose tables hold a fit a row and head (KVTC's prefill basis).

Codes of a cache grow along the token axis: :func:`append` and :func:`take` work on any codes
record. Codecs register by name (:func:`register_codec`, :func:`get_codec`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

__all__ = ["Codec", "register_codec", "get_codec", "codec_names", "append", "take",
           "numpy_tables", "codes_nbytes", "shipped_calibration"]


class Codec(NamedTuple):
    """One codec: its functions, the parameters it reads and its error statement."""

    name: str
    tables: Callable[[int, dict], Any]
    encode: Callable[[Any, mx.array], Any]
    decode: Callable[[Any, Any], mx.array]
    scores: Callable[[Any, mx.array, Any], mx.array]
    encode_np: Callable[[Any, np.ndarray], Any]
    decode_np: Callable[[Any, Any], np.ndarray]
    scores_np: Callable[[Any, np.ndarray, Any], np.ndarray]
    params: tuple[str, ...]
    error: str
    #: ``head(tables, i, j)``: batch row ``i``, kv head ``j``'s tables, where a codec's tables
    #: hold one fit a row and head (NumPy, a ``reference`` score's one head); ``None``: shared.
    head: Callable[[Any, int, int], Any] | None = None


_CODECS: dict[str, Codec] = {}


def register_codec(codec: Codec) -> Codec:
    """Add ``codec`` under its name; a name registers once."""
    if codec.name in _CODECS:
        raise ValueError(f"codec {codec.name!r} is already registered")
    _CODECS[codec.name] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The codec ``name``; unknown names raise ``ValueError``."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; registered: {', '.join(sorted(_CODECS))}") from None


def codec_names() -> tuple[str, ...]:
    return tuple(sorted(_CODECS))


def append(a, b):
    """Codes ``a ++ b`` along the token axis (axis 2) of every field."""
    return type(a)(*(mx.concatenate([x, y], axis=2) for x, y in zip(a, b)))


def take(codes, idx: mx.array):
    """Tokens ``idx [b, h, k]`` of every field (token axis 2)."""
    from ..evict import take_rows
    return type(codes)(*(take_rows(x, idx) for x in codes))


def numpy_tables(tables):
    """``tables`` with every MLX array as a NumPy array (for the ``*_np`` twins)."""
    return type(tables)(*(np.array(x) if isinstance(x, mx.array) else x for x in tables))


def shipped_calibration(method: str, shipped: dict[str, str], name: str) -> tuple[dict, dict]:
    """``(arrays, info)`` of the calibration ``name`` shipped for ``method`` (``shipped``:
    name -> ``.npz`` file in ``velox.adapters/data``, its provenance JSON under ``metadata``)."""
    import json
    from importlib import resources

    if name not in shipped:
        raise ValueError(f"no shipped {method} calibration {name!r}; shipped: {', '.join(shipped)}")
    with resources.as_file(resources.files("velox.adapters") / "data" / shipped[name]) as p:
        with np.load(p) as f:
            arrays = {k: f[k] for k in f.files if k != "metadata"}
            info = json.loads(str(f["metadata"]))
    return arrays, info


def codes_nbytes(codes) -> int:
    """Bytes the codes hold."""
    return int(sum(x.nbytes for x in codes))


# Every codec registers on import (after the definitions above, which the modules use).
from . import affine, polar, prod, qjl, spectral, turboquant, split  # noqa: E402,F401
from . import pq, vecinfer  # noqa: E402,F401
from . import kvtc  # noqa: E402,F401
from . import a2ats  # noqa: E402,F401
from . import svdq  # noqa: E402,F401
