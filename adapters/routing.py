"""Routing mlx-lm's attention to velox caches, and where a cache runs its method's update.

mlx-lm's models call ``mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values,
cache=..., scale=..., mask=...)`` (each model module holds its own reference to it).
:func:`install_query_capture` replaces that function, in ``base`` and in every loaded model
module, with a wrapper that hands the call to the cache when the cache attends itself
(``velox.adapters.model_step.Attends``: a velox layer cache, a batch of them, a layer inside
the compiled whole-model step) and runs the original otherwise. That is how a velox cache
sees a step's real queries (deferred mode, :class:`Mode`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from enum import Enum
from typing import Any, Iterator

import mlx.core as mx
from mlx_lm.models import base as _mlx_base

from velox.registry import Method

from .model_step import Attends

__all__ = ["Mode", "install_query_capture", "uninstall_query_capture", "query_capture",
           "tap_queries", "capture_installed", "KV_BITS", "untapped", "routes_attention"]


# --- modes ----------------------------------------------------------------------------

class Mode(str, Enum):
    """Where a velox cache runs the method's update during mlx-lm's forward."""

    PROXY = "proxy"        # in update_and_fetch, with the key-as-query proxy
    DEFERRED = "deferred"  # in the wrapped attention, after it, with the real queries


def _check_mode(mode: Any) -> Mode:
    try:
        return Mode(mode)
    except ValueError:
        raise ValueError(f"mode={mode!r} must be one of "
                         f"{', '.join(repr(m.value) for m in Mode)}") from None


def _choose_mode(m: Method, *, real_queries: bool, routed: bool, model: str | None = None) -> Mode:
    """The mode for method ``m``: deferred when it wants queries (``real_queries``, or an
    ``attend`` hook) and the model's attention goes through the wrapper (``routed``), else
    proxy; a method with ``attend`` refuses a model whose attention does not."""
    if m.attend is not None and not routed:
        raise ValueError(f"{m.key} needs a model whose attention calls mlx-lm's "
                         "scaled_dot_product_attention" + (f"; {model} does not" if model else ""))
    return Mode.DEFERRED if (real_queries or m.attend is not None) and routed else Mode.PROXY


KV_BITS = ("kv_bits does not apply to a velox cache: mlx-lm would replace it with its own "
            "quantized cache. Drop kv_bits and pick a quantizing velox method instead, e.g. "
            "make_cache(model, 'kivi', bits=4) or make_cache(model, 'tova+affine', bits=4)")



# --- real-query capture: wrap mlx-lm's attention for velox caches only --------------------

_ORIGINAL_SDPA = _mlx_base.scaled_dot_product_attention

_QUERY_TAPS: list[list[mx.array]] = []  # one list per open query_capture() body
_INSTALLED = False  # install_query_capture() holds the wrapper in place
_BODIES = 0         # open query_capture() bodies, which hold it too


def _velox_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None):
    if isinstance(cache, Attends):
        return cache.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    for tap in _QUERY_TAPS:
        tap.append(queries)
    return _ORIGINAL_SDPA(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def capture_installed() -> bool:
    return _mlx_base.scaled_dot_product_attention is _velox_sdpa


def _patch(new, old) -> None:
    """Set ``scaled_dot_product_attention`` to ``new`` in ``mlx_lm.models.base`` and in every
    loaded ``mlx_lm.models.*`` module whose copy is ``old``."""
    for name, mod in list(sys.modules.items()):
        if name == "mlx_lm.models.base" or name.startswith("mlx_lm.models."):
            if getattr(mod, "scaled_dot_product_attention", None) is old:
                mod.scaled_dot_product_attention = new


def install_query_capture() -> None:
    """Route mlx-lm's attention through velox caches (others keep the original path), until
    :func:`uninstall_query_capture`.

    Patches ``scaled_dot_product_attention`` in ``mlx_lm.models.base`` and in every loaded
    ``mlx_lm.models.*`` module that imported it. Idempotent; :func:`make_cache` calls it for
    methods that want queries.
    """
    global _INSTALLED
    _INSTALLED = True
    _patch(_velox_sdpa, _ORIGINAL_SDPA)


def uninstall_query_capture() -> None:
    """Restore mlx-lm's original attention function everywhere it was patched (at the end of
    the outermost :func:`query_capture` body if one is open). Deferred-mode caches then run
    their updates as proxy mode does."""
    global _INSTALLED
    _INSTALLED = False
    if not _BODIES:
        _patch(_ORIGINAL_SDPA, _velox_sdpa)


@contextmanager
def query_capture() -> Iterator[list[mx.array]]:
    """Install the attention wrapper for the body of a ``with`` block, then restore what was
    there before (nesting-safe; a global :func:`install_query_capture` made meanwhile stays).

    Yields a list that records, in call order, the queries of every attention call on a
    non-velox cache in the body (one entry per layer per forward).
    """
    global _BODIES
    _BODIES += 1
    _patch(_velox_sdpa, _ORIGINAL_SDPA)
    queries: list[mx.array] = []
    _QUERY_TAPS.append(queries)
    try:
        yield queries
    finally:
        _QUERY_TAPS.remove(queries)
        _BODIES -= 1
        if not _BODIES and not _INSTALLED:
            _patch(_ORIGINAL_SDPA, _velox_sdpa)


tap_queries = query_capture  # the earlier name


@contextmanager
def untapped() -> Iterator[None]:
    """A body whose attention calls no open :func:`query_capture` records."""
    taps = _QUERY_TAPS[:]
    _QUERY_TAPS.clear()
    try:
        yield
    finally:
        _QUERY_TAPS[:] = taps


def routes_attention(model) -> bool:
    """Whether every module class in ``model`` that uses mlx-lm's attention function uses the
    wrapped one (so velox caches see their queries)."""
    modules = {sys.modules.get(type(mod).__module__) for _, mod in model.named_modules()}
    users = [mod for mod in modules if mod is not None and hasattr(mod, "scaled_dot_product_attention")]
    return bool(users) and all(mod.scaled_dot_product_attention is _velox_sdpa for mod in users)
