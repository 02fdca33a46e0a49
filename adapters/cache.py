"""The mlx-lm cache: one generic cache class that wraps any velox method's state.

(:mod:`velox.adapters.mlxlm` is the public face: this module's names and
:mod:`velox.adapters.cache_files`'s ``save_cache`` / ``load_cache``.)

``make_cache(model, "tova", budget=256)`` returns one :class:`VeloxCache` per layer for
``mlx_lm.generate``, ``stream_generate`` and ``generate_step`` (``prompt_cache=``). The class
holds no per-method code: it calls the method's functions through the registry.

Protocol facts this class honours:

* ``offset`` is the absolute position of the next token (the model reads it for RoPE);
  ``size()`` is the number of stored tokens.
* Deferred eviction: ``update_and_fetch`` returns stored + new tokens, and the method's
  update (eviction, quantization) applies after this step's attention.
* Two modes, one value per cache (:class:`Mode`, ``VeloxCache.mode``), chosen once by
  :func:`make_cache`:

  - ``Mode.PROXY``: ``update_and_fetch`` runs the update at once, scoring the new tokens
    with their keys as queries (the key-as-query proxy), and returns stored + new: the
    one-call shape mlx-lm expects of a cache.
  - ``Mode.DEFERRED``: ``update_and_fetch`` only takes the new tokens; mlx-lm's
    ``scaled_dot_product_attention``, wrapped (for velox caches only; other caches take the
    original path), runs this step's attention (or the method's ``attend`` hook) and then the
    update with the step's real queries, as one compiled graph at a full bounded cache.

  ``make_cache`` picks ``DEFERRED`` when the method wants queries (``real_queries=True``, or
  an ``attend`` hook) and the model's attention goes through the wrapped function, else
  ``PROXY`` (a method with ``attend`` refuses such a model). ``save_cache`` writes the mode;
  ``load_cache`` checks it against the model, or, loaded without it, a deferred cache learns
  from its first forward whether the wrapper runs for it (``VeloxCache._settle``).
* Getters never update: ``size()``, ``state``, ``positions()``, ``nbytes`` and
  ``velox_state`` report what the cache holds. In deferred mode tokens are pending only from
  ``update_and_fetch`` to the wrapped attention of the same layer (or, when a forward never
  reached the wrapper, until the next ``update_and_fetch`` completes them with the proxy);
  meanwhile ``size()`` and ``positions()`` count them, ``state`` and ``nbytes`` include
  their arrays, and ``velox_state`` is the method's state without them.
* ``make_mask`` answers ``None`` for one query and ``"causal"`` for a chunk (every kept token
  precedes the chunk, so MLX's causal mask aligned to the last keys is right).
* No ``bits`` attribute, and ``to_quantized`` raises: mlx-lm can neither route around the
  cache nor swap it for its own quantized one (``kv_bits``). ``generate_step``'s ``kv_bits``
  and ``max_kv_size`` (which a given prompt cache ignores) are refused at the first step.
* Rollback (``rollback=d``, default 0): the cache steps ``velox.wrap.with_rollback(method,
  d)``, whose state journals the method's states before each of its last ``d`` updates
  (references: states are never changed in place); ``trim(n)`` restores the one ``n`` tokens
  back exactly (``velox.wrap.trim``) or raises ``ValueError`` (never a partial trim),
  ``is_trimmable()`` is ``d > 0``, ``can_trim(n)`` and ``trimmable_tokens()`` say what
  ``trim`` accepts now. A call of 2 to ``d + 1`` tokens on a cache holding tokens (a
  speculative verify call) runs as one-token steps in deferred mode. With ``rollback=0``
  ``is_trimmable()`` is ``False`` and ``trim`` removes nothing: an evicting or quantizing
  state cannot forget tokens without a journal.
* Every array of the state is scheduled for evaluation after each update, so lazy graphs
  never accumulate over a long decode.
* Decode modes (``decode=``): ``"evict"`` runs the method's update at every call, decode
  steps included. ``"append"`` compresses multi-token calls (prefill chunks) as ``"evict"``
  does, but appends single-token steps uncompressed to a tail of at most ``decode_cap``
  tokens, which attention reads after the stored tokens; the step that fills the tail hands
  it to the method as one chunk (with the tail's real queries), after its attention. A
  multi-token call takes the tail with it the same way: one update of tail + chunk. The tail
  is a method of its own, ``velox.wrap.with_tail(method, decode_cap)``, which the cache steps
  (``_m``); ``velox_state`` is the method's state inside it.
* ``save_cache`` / ``load_cache``: one ``.safetensors`` file whose checksum covers its
  metadata and arrays; a loaded cache is checked against its method (and a given model's
  dims) and decodes as the saved one would have.
* Compiled steps (a steady decode update, the fused attention + update) live in one bounded
  cache keyed by method, kind of step and backend (``velox.decode.compiled``); a steady
  step's choice between the fill step and the fused one is ``velox.decode.layer_step``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models import base as _mlx_base
from mlx_lm.models.cache import KVCache

import velox
from velox import layer as _layer, wrap
from velox.decode import StepInfo, arrays as _arrays, step_info, with_state as _with_state
from velox.layer import Held, Pending
from velox.adapters import guards, model_step
from velox.adapters.batch import VeloxBatchCache
from velox.adapters.routing import (KV_BITS as _KV_BITS, Mode, _check_mode, _choose_mode,
                                    capture_installed as _capture_installed,
                                    install_query_capture, query_capture,
                                    routes_attention as _routes_attention, tap_queries,
                                    uninstall_query_capture)
from velox.adapters.model_step import SteppedCache
from velox.adapters.sharding import check_method, model_heads, pipeline_stages, shard_artifact
from velox.backend import resolve_backend
from velox.distributed import LOCAL, Heads, check_heads
from velox.registry import Method, get_method
from velox.spec import validate_params
from velox.state_dims import method_dims

__all__ = ["VeloxCache", "Mode", "make_cache", "cache_nbytes", "cache_fp16_bytes", "default_layout",
           "install_query_capture", "uninstall_query_capture", "query_capture", "tap_queries",
           "reconstruction_prefill", "ROLLBACK_MAX"]


# --- shared model-level record for cross-layer methods --------------------------------

@dataclass
class _Model:
    """What the caches of one model share: the method and its cross-layer record."""

    method: Method
    layer_params: list[dict[str, Any]]
    record: tuple | None = None
    n_layers: int = 0

    def record_of(self, m: Method) -> Any:
        """The cross-layer record ``m`` steps (made on first use); ``None`` for a method
        without one."""
        if m.layer_update is None:
            return None
        if self.record is None:
            self.record = m.model_init(self.layer_params)
        return _layer.token_record(self.record)

    def keep(self, record: Any) -> None:
        """Take the record a layer's update returned (its arrays scheduled for evaluation)."""
        if record is not None:
            self.record = _layer.kept_record(self.record, record)
            mx.async_eval(_arrays(record))

    def at_token(self, i: int, s: int, layer: int) -> None:
        """Layer ``layer`` of a verify call of ``s`` tokens steps its token ``i``: the record
        of that token (``velox.layer.at_token``)."""
        self.record = _layer.at_token(self.record, i, s, layer == self.n_layers - 1)

    def after_split(self, layer: int) -> None:
        """Layer ``layer`` stepped every token of a verify call (``velox.layer.after_split``)."""
        self.record = _layer.after_split(self.record, layer == self.n_layers - 1)


class _NoModel:
    """The record holder of a method without a model-level record: nothing to thread."""

    def at_token(self, i: int, s: int, layer: int) -> None:
        return None

    def after_split(self, layer: int) -> None:
        return None


_NO_MODEL = _NoModel()


# --- the cache ------------------------------------------------------------------------

DECODE_MODES = ("evict", "append")
DECODE_CAP = 64  # append mode: decoded tokens held uncompressed before the method absorbs them


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


def _check_decode(decode: Any, decode_cap: Any) -> None:
    if decode not in DECODE_MODES:
        raise ValueError(f"decode={decode!r} must be one of {', '.join(map(repr, DECODE_MODES))}")
    if isinstance(decode_cap, bool) or not isinstance(decode_cap, int) or decode_cap < 1:
        raise ValueError(f"decode_cap={decode_cap!r} must be an integer >= 1")


class _Shared:
    """A step observer held by a cache: copies of the cache share it (``copy.deepcopy``
    returns it as is, so a bound method's object is never copied)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn

    def __deepcopy__(self, memo: dict) -> "_Shared":
        return self


class _Observer:
    """A cache's ``observe``: ``None`` or ``fn(layer, info)``, held as a :class:`_Shared`;
    setting it makes the cache decide its fast path again."""

    def __get__(self, obj, cls=None) -> Callable[[int, StepInfo], Any] | None:
        held = None if obj is None else obj.__dict__.get("_observe")
        return None if held is None else held.fn

    def __set__(self, obj, fn: Callable[[int, StepInfo], Any] | None) -> None:
        if fn is not None and not callable(fn):
            raise ValueError(f"observe={fn!r} must be None or a function fn(layer, info)")
        obj.__dict__["_observe"] = None if fn is None else _Shared(fn)
        obj.held = obj.held._replace(fast=False)  # decided again, with or without it


ROLLBACK_MAX = wrap.ROLLBACK_MAX  # the most steps a cache journals (``rollback=``)


def _check_rollback(rollback: Any) -> None:
    if isinstance(rollback, bool) or not isinstance(rollback, int) or not 0 <= rollback <= ROLLBACK_MAX:
        raise ValueError(
            f"rollback={rollback!r} must be an integer from 0 to ROLLBACK_MAX={ROLLBACK_MAX} (the "
            "steps trim can undo; the journal holds up to that many states, and calls of up to "
            "rollback + 1 tokens run as one-token steps)")


def _check_settings(decode: Any, decode_cap: Any, rollback: Any, compile: Any, real_queries: Any,
                    backend: Any) -> None:
    """The settings every velox cache of a model shares, checked (a ``ValueError`` names the
    first bad one): by :func:`make_cache` once, and by :class:`VeloxCache` made directly."""
    _check_decode(decode, decode_cap)
    _check_rollback(rollback)
    _check_flag("compile", compile)
    _check_flag("real_queries", real_queries)
    if not isinstance(backend, str):
        raise ValueError(f"backend={backend!r} must be a backend name (a str)")


def _check_layer(m: Method, mode: Mode, layer: Any, rollback: int, params: dict[str, Any],
                 artifact: Any) -> dict[str, Any]:
    """The settings of one layer's cache that depend on its method, checked: the parameters
    validated (every one, defaults filled in)."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer={layer!r} must be an integer >= 0")
    if mode is Mode.PROXY and m.attend is not None:
        raise ValueError(f"{m.key} attends through its own hook: it needs mode='deferred' (a "
                         "model whose attention calls mlx-lm's scaled_dot_product_attention)")
    full = validate_params(m.spec, params)
    if artifact is not None and m.calibrate is None:
        raise ValueError(f"{m.key} takes no calibration artifact")
    return full


def _plan(m: Method, mode: Mode, layer: Any, params: dict[str, Any], artifact: Any, *,
          backend: str, decode: str, decode_cap: int, rollback: int, compile: bool,
          heads: Heads) -> _layer.Plan:
    """One layer's plan (``velox.layer.plan``), its settings that depend on the method and
    the heads checked first."""
    check_heads(heads)
    full = _check_layer(m, mode, layer, rollback, params, artifact)
    return _layer.plan(m, params, full, backend=backend, rollback=rollback, artifact=artifact,
                       tail=decode_cap if decode == "append" else None, compile=compile,
                       heads=heads)


class _BatchMerge:
    """``merge`` as a classmethod, hidden on an instance known to be unrouted (its
    ``_routed`` is ``False``): ``hasattr(cache, "merge")`` is then false."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls=None):
        if obj is not None and obj.__dict__.get("_routed") is False:
            raise AttributeError(f"{type(obj).__name__} of a model whose attention does not reach "
                                 "velox's wrapper does not batch (no merge)")
        return self.fn.__get__(cls if cls is not None else type(obj), type)


class VeloxCache(SteppedCache):
    """mlx-lm's cache protocol over one layer's ``velox.layer.Held`` record (``held``), each
    step a function of ``velox.layer`` (module doc: the protocol's facts). Settings are fixed
    at construction; ``last_step`` says how the last step ran; ``observe`` (:class:`_Observer`)
    gets every update's ``velox.decode.StepInfo`` (observed, a cache decodes layer by layer)."""

    def __init__(self, method: str, params: dict[str, Any] | None = None, *,
                 backend: str = "auto", layer: int = 0, model: _Model | None = None,
                 compile: bool = True, real_queries: bool = True, decode: str = "evict",
                 decode_cap: int = DECODE_CAP, mode: Mode | str = Mode.PROXY,
                 artifact: dict[str, Any] | None = None, rollback: int = 0,
                 observe: Callable[[int, StepInfo], Any] | None = None, heads: Heads = LOCAL):
        _check_settings(decode, decode_cap, rollback, compile, real_queries, backend)
        self.method, self.params, self.mode = get_method(method), dict(params or {}), _check_mode(mode)
        self._plan = _plan(self.method, self.mode, layer, self.params, artifact, backend=backend,
                           decode=decode, decode_cap=decode_cap, rollback=rollback,
                           compile=compile, heads=heads)
        self._m = self._plan.m  # the method it steps: behind a decode tail, then a journal
        self.decode, self.decode_cap, self.rollback, self.artifact = decode, decode_cap, rollback, artifact
        self.backend, self.layer, self._model, self.compile = backend, layer, model, compile
        self.real_queries, self.heads, self.last_step, self.held = real_queries, heads, None, Held()
        self._route_unknown = False  # loaded without its model: its first forward says
        self.observe = observe

    observe = _Observer()

    @property
    def _state(self) -> tuple | None:
        """The stepped method's state, its pending row written (once: the record is kept)."""
        self.held = _layer.written(self.held)
        return self.held.state

    @_state.setter
    def _state(self, value: tuple | None) -> None:
        h = self.held
        self.held = h._replace(state=value, row=None, fast=h.fast and value is h.state)

    # -- protocol (getters: none of them updates) ----------------------------------
    @property
    def offset(self) -> int:
        """Absolute position of the next token (RoPE offset), never the stored count."""
        return self.held.offset

    @offset.setter
    def offset(self, value: int) -> None:
        raise AttributeError("the offset of a velox cache follows the tokens it absorbed")

    def size(self) -> int:
        """Tokens held: stored (an append-mode tail included) and those of a pending step."""
        return _layer.tokens(self._m, self.held)

    def empty(self) -> bool:
        return self.held.state is None and self.held.pending is None

    @property
    def tail(self) -> tuple[mx.array, mx.array] | None:
        """Append mode: the decoded ``(keys, values)`` not yet compressed, or ``None``."""
        st = _layer.tail_state(self.held.state)
        return None if st is None else (st.keys, st.values)

    @property
    def tail_queries(self) -> mx.array | None:
        """Append mode: the tail's real queries (``None`` also where a step gave none)."""
        st = _layer.tail_state(self.held.state)
        return None if st is None else st.queries

    def positions(self) -> mx.array:
        """Absolute positions ``[b, h, n]``: stored (a tail last), then a pending step's."""
        return _layer.positions(self._m, self.held)

    def is_trimmable(self) -> bool:
        return self.rollback > 0

    def trimmable_tokens(self) -> int:
        return _layer.trimmable_tokens(self.held.state)

    def can_trim(self, n: int) -> bool:
        return _layer.can_trim(self.held.state, n)

    @_BatchMerge
    def merge(cls, caches: list) -> "velox.adapters.batch.VeloxBatchCache":
        """mlx-lm's batch protocol (absent where the model's attention misses the wrapper)."""
        return VeloxBatchCache.merge(caches)

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens exactly and return ``n`` (``ValueError`` where
        ``can_trim(n)`` is false); without rollback nothing, and 0."""
        if self.rollback:
            self.held = _layer.trim(self.held, n, self.rollback)
            if self._model is not None and n:  # the record it left then (the last layer's stands)
                self._model.record = _layer.left_record(self.held.state)
        return n if self.rollback else 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("velox caches do not support sliding-window attention layers")
        if N == 1:
            return None
        return _mlx_base.create_causal_mask(N, offset=self.size()) if return_array else "causal"

    @property
    def to_quantized(self):
        raise ValueError(_KV_BITS)

    @property
    def nbytes(self) -> int:
        """Bytes the state holds (a tail, its queries, a journal) and a pending step's."""
        p, held = self.held.pending, 0 if self.held.state is None else self._m.nbytes(self._state)
        return held + (0 if p is None else p.keys.nbytes + p.values.nbytes)

    @property
    def state(self) -> list[mx.array]:
        """Every array of the state and of a pending step (mlx-lm evaluates these)."""
        if self.held.state is None:
            return []
        self.held = _layer.written(self.held)
        return _layer.held_arrays(self.held)

    @state.setter
    def state(self, v) -> None:
        raise AttributeError("set a velox cache's state with load_cache")

    @property
    def velox_state(self) -> tuple | None:
        """The method's own state (no tail, no journal, no pending step)."""
        return _layer.inner_state(self._state)

    # -- the compiled whole-model step (velox.adapters.model_step) -------------------
    def steady_state(self) -> tuple | None:
        if not _capture_installed() or self.observe or self.held.state is None or self.held.pending:
            return None
        record, alone = self.record_step() is not None, self._alone()  # record: no row
        self.held, form = _layer.steady(self._plan, self.held, alone=alone, record=record,
                                        plain=alone and self.method.layer_update is None)
        return None if form is None else (self._m, form, self.held.row, self.held.offset)

    def record_step(self) -> tuple[Any, int] | None:
        m = self._m
        if self._model is None or m.layer_update is None or self.mode is not Mode.DEFERRED:
            return None
        return (self._model, self.layer) if self._model.record_of(m) is not None else None

    def stepped(self, state, row) -> None:
        fast = self.record_step() is None  # a record's layer takes its checked path next
        self.held, self.last_step = Held(state, row, self.held.offset + 1, None, fast), "compiled"

    # -- updates -------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Take this step's tokens; return what its attention reads (stored + new, or the new
        ones alone where the wrapper attends by itself; a verify call waits whole for it)."""
        if self._route_unknown and self.held.pending is None:
            install_query_capture()  # loaded without its model: its modules are imported now
        self._settle()
        held = _layer.waits(self.held, keys, values, rollback=self.rollback, wrapped=self._wrapped())
        if held is None:
            return self._fetch(keys, values)
        if held.pending.split and self._model is not None:  # a cross-layer record: refused
            _layer.check_verify(self._m, keys.shape[2], self.rollback)  # where it cannot split
            self._model.record_of(self._m)  # (made on first use)
        self.held = held
        return keys, values

    def _fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        wrapped = self.mode is Mode.DEFERRED and _capture_installed()
        self.held, step, out = _layer.fetch(self._plan, self.held, keys, values, wrapped=wrapped,
                                            routed=not self._route_unknown)
        if not wrapped:
            self._absorb(step, None)
            self.last_step = _layer.kind(self.held.state, "proxy")
        return out

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                  mask, sinks=None) -> mx.array:
        """This step's attention and the update of a pending step with the real queries
        (``velox.layer.attend``); plain attention when none is pending."""
        self._route_unknown = False  # the model's attention reaches the wrapper
        step = self.held.pending
        if step is None:  # proxy mode: the update already ran in update_and_fetch
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                        mask=mask, sinks=sinks)
        if step.split:  # a verify call: the one-token steps it stands for, each journaled
            s, model = step.keys.shape[2], self._model or _NO_MODEL
            self.held = self.held._replace(offset=self.held.offset - s, pending=None)
            outs = []
            for i in range(s):  # each token with its own model-level record, where there is one
                model.at_token(i, s, self.layer)
                k, v = self._fetch(step.keys[:, :, i:i + 1], step.values[:, :, i:i + 1])
                outs.append(self.attention(queries[:, :, i:i + 1], k, v, scale=scale, mask=None,
                                           sinks=sinks))
            model.after_split(self.layer)
            return mx.concatenate(outs, axis=2)
        before = self._state if self.observe else None
        out, self.held, self.last_step, record = _layer.attend(
            self._plan, self.held, queries, keys, values, scale=scale, mask=mask, sinks=sinks,
            plain=self._plain(), record=self._record(), index=self.layer)
        self._updated(before, step, record)
        return _with_state(out, _layer.new_arrays(self.held))

    def absorb(self, keys: mx.array, values: mx.array, *, queries: mx.array | None = None) -> None:
        """Feed rows (and their queries) straight into the state (KVzip's reconstruction)."""
        self._settle()
        self.held, step = _layer.take(self._plan, self.held, keys, values)
        self._absorb(step, queries)

    def _settle(self) -> None:
        """Complete with the proxy a pending step whose attention missed the wrapper (a
        cache loaded without its model then learns its mode is proxy)."""
        if self.held.pending is not None and self._route_unknown:
            self._route_unknown = False
            self.mode = _choose_mode(self._m, real_queries=self.real_queries, routed=False)
        self.held, step = _layer.missed(self.method, self.held)
        if step is not None:
            self._absorb(step, None)

    def _absorb(self, step: Pending, queries: mx.array | None) -> None:
        before = self._state if self.observe else None
        self.held, record = _layer.absorb(self._plan, self.held, step, queries,
                                          record=self._record(), index=self.layer)
        self._updated(before, step, record)
        mx.async_eval(_layer.new_arrays(self.held))

    def _record(self) -> Any:
        return None if self._model is None else self._model.record_of(self._m)

    def _updated(self, before, step: Pending, record) -> None:
        """After an update: keep the model-level record, call the observer."""
        if record is not None:
            self._model.keep(record)
        held = self.__dict__.get("_observe")
        if held is not None and before is not None:
            held.fn(self.layer, step_info(self._m, before, self._state, step.keys, step.values))

    def _alone(self) -> bool:
        """No journal, tail, observer or unknown route: a step is the method's own."""
        return (not self.rollback and self._m is self.method and not self.observe
                and not self._route_unknown)

    def _plain(self) -> bool:
        """:meth:`_alone`, no model-level record: the fast path and the compiled step."""
        return self._alone() and self.method.layer_update is None

    def _wrapped(self) -> bool:
        return self.mode is Mode.DEFERRED and not self._route_unknown and _capture_installed()


# --- construction ---------------------------------------------------------------------

def _expand(params: dict[str, Any], n_layers: int) -> list[dict[str, Any]] | None:
    """Per-layer dicts when some parameter is a list (one value per layer), else ``None``."""
    lists = {k: v for k, v in params.items() if isinstance(v, (list, tuple))}
    if not lists:
        return None
    for k, v in lists.items():
        if len(v) != n_layers:
            raise ValueError(f"{k} has {len(v)} values for a model with {n_layers} attention layers")
    return [{k: (v[i] if k in lists else v) for k, v in params.items()} for i in range(n_layers)]


# Calibrated methods run without an artifact: each says so once per process.
_FALLBACK_SAID: set[str] = set()


def make_cache(model, method: str, *, backend: str = "auto", real_queries: bool = True,
               compile: bool = True, decode: str = "evict", decode_cap: int = DECODE_CAP,
               artifacts: str | Path | None = None, rollback: int = 0,
               observe: Callable[[int, StepInfo], Any] | None = None, **params: Any) -> list:
    """One cache per layer of ``model``: velox caches where the model keeps a plain KV cache.

    Every argument is checked here, before any cache exists (a ``ValueError`` names it), so
    what :func:`save_cache` writes of these caches :func:`load_cache` accepts.

    Args:
        model: an mlx-lm model.
        method: a registered method key (``velox.method_keys()``).
        backend: ``auto`` or a backend name the method has and this machine runs (checked
            here; ``auto`` is resolved per layer at the first token).
        real_queries: ``True`` or ``False``: score with the model's real queries (deferred
            mode: wraps mlx-lm's attention for velox caches); ``False`` uses the key-as-query
            proxy.
        compile: ``True`` or ``False``: compile single-token updates once the cache is full,
            and (deferred mode) run a steady decode step of the whole model as one compiled
            call (``velox.adapters.model_step``: wraps the model class's ``__call__``, which
            takes that path only for single-token calls on steady velox caches).
        decode: ``"evict"``: every call runs the method's update, decode steps included.
            ``"append"``: multi-token calls are compressed as in ``"evict"``; single-token
            steps join an uncompressed tail that attention reads, and the step that fills it
            to ``decode_cap`` tokens hands it to the method as one chunk (with its queries).
        decode_cap: append mode's tail length at which the method absorbs it (1 updates at
            every step, as ``"evict"`` does).
        artifacts: a calibration artifact of ``method`` fitted on this model (``velox
            calibrate``; ``velox.adapters.artifacts``): checked against the model (layers, kv
            heads, head dim) and installed layer by layer; a missing or mismatched file is a
            ``ValueError``. Without one a calibrated method runs what its spec's
            ``contract.uncalibrated`` says (a warning names it), or its shipped fit.
        rollback: the steps ``trim`` can undo exactly (a journal of the cache's fields before
            each of its last ``rollback`` steps; 0, the default, keeps none and ``trim``
            removes nothing), at most :data:`ROLLBACK_MAX` (64). With ``rollback=d``, a call
            of 2 to ``d + 1`` tokens on a cache holding tokens (speculative decoding's verify
            call) runs as one-token steps, so ``draft_model=`` with ``num_draft_tokens <= d``
            gives the greedy tokens of the run without a draft. The journal costs up to ``d``
            states beyond the cache's own in ``decode="evict"`` (each step makes a new
            state), hence the bound. A cross-layer method's journal restores its model-level
            record too; a verify call of MiniCache, which cannot split per layer, raises.
        observe: ``fn(layer, info)`` called after every update of a layer's state with the
            step's ``velox.decode.StepInfo`` (tokens held and dropped, bytes, the step's
            quantization error); observed caches decode layer by layer. Also settable later
            (``cache.observe = fn``; ``None`` turns it off).
        **params: the method's parameters; a list gives one value per attention layer.
            Methods with a schedule (``layer_params``) derive per-layer values themselves.
    A tensor-parallel model (mlx-lm's ``model.shard(group)``, ``sharded_load``): each process
    makes its caches over the kv heads it holds (``velox.adapters.sharding.model_heads``), every
    decision a method takes over a layer's heads reduced across the group
    (``velox.distributed``), so each process keeps what one process holding every head would;
    a calibration artifact (fitted on the whole model) is cut to the process's heads. Refused:
    heads that do not divide among the processes, a method whose spec says ``heads =
    "unshardable"``, a cross-layer method on a pipelined model.

    Returns:
        A list for ``prompt_cache=`` (layers whose default cache is not a plain ``KVCache``,
        e.g. recurrent or sliding-window layers, keep their default cache). Every velox
        cache has the same ``mode``: ``Mode.DEFERRED`` when the method wants queries
        (``real_queries``, or an ``attend`` hook) and the model's attention calls mlx-lm's
        ``scaled_dot_product_attention``, else ``Mode.PROXY``.
    """
    _check_settings(decode, decode_cap, rollback, compile, real_queries, backend)
    if not isinstance(method, str):
        raise ValueError(f"method={method!r} must be a method key (a str)")
    m = get_method(method)
    resolve_backend(backend, m.key, m.backends)  # an unknown or unavailable backend, now
    heads = model_heads(model)  # a tensor-parallel model's: this process's kv heads
    check_method(m, heads, pipeline_stages(model))
    if artifacts is not None and not isinstance(artifacts, (str, Path)):
        raise ValueError(f"artifacts={artifacts!r} must be a path (str or pathlib.Path) or None")
    base = default_layout(model)
    slots = [i for i, c in enumerate(base) if type(c) is KVCache]
    n = len(slots)
    per_layer = _expand(params, n)
    if per_layer is None:
        validate_params(m.spec, params)
        per_layer = m.per_layer_params(n, params)
    per_layer = [validate_params(m.spec, p) for p in per_layer]  # full, validated dicts
    shared = _Model(method=m, layer_params=per_layer, n_layers=n) if m.layer_update else None
    if real_queries or m.attend is not None:
        install_query_capture()
    routed = _routes_attention(model)
    mode = _choose_mode(m, real_queries=real_queries, routed=routed, model=type(model).__name__)
    fitted = None
    without = m.spec.contract.get("uncalibrated", "its documented fallback")
    if (artifacts is None and m.calibrate is not None and without != "shipped"
            and method not in _FALLBACK_SAID):
        _FALLBACK_SAID.add(method)
        warnings.warn(f"{method}: no calibration artifact (artifacts=FILE, from velox calibrate "
                      f"--method {method}); using {without}", stacklevel=2)
    if artifacts is not None:
        from .artifacts import layer_arrays, load_artifact
        if m.calibrate is None:
            raise ValueError(f"{method} takes no calibration artifact")
        arrays, _ = load_artifact(artifacts, method=method, model=model)
        if len(next(iter(arrays.values()))) != n:
            raise ValueError(f"{artifacts} holds {len(next(iter(arrays.values())))} layers; the "
                             f"model has {n} layers with a plain KV cache")
        local = _local_kv_heads(model)
        fitted = [shard_artifact(layer_arrays(arrays, i), heads, local) for i in range(n)]
    caches = list(base)
    for i, slot in enumerate(slots):
        caches[slot] = VeloxCache(method, per_layer[i], backend=backend, layer=i,
                                  model=shared, compile=compile, real_queries=real_queries,
                                  decode=decode, decode_cap=decode_cap, mode=mode,
                                  artifact=None if fitted is None else fitted[i],
                                  rollback=rollback, observe=observe, heads=heads)
        caches[slot]._routed = routed  # merge batches B > 1 rows only through the wrapper
    guards.install()
    if compile and mode is Mode.DEFERRED:
        model_step.install(model)
    return caches


def _local_kv_heads(model) -> int:
    """The kv heads each attention layer of ``model`` computes in this process."""
    attn = next(layer.self_attn for layer in model.layers if hasattr(layer, "self_attn"))
    return int(attn.n_kv_heads)


def default_layout(model) -> list:
    """The caches mlx-lm gives ``model`` by default (``make_prompt_cache``), read from the
    model's class: an instance ``model.make_cache`` hook (one returning velox caches, as
    ``velox serve`` installs) is not consulted, so building from it never recurses."""
    own = getattr(type(model), "make_cache", None)
    if own is not None:
        return own(model)
    return [KVCache() for _ in model.layers]


def cache_nbytes(caches: list) -> int:
    """Total bytes held by a prompt cache (velox caches report their real state bytes)."""
    return int(sum(c.nbytes for c in caches))


def cache_fp16_bytes(caches: list) -> int:
    """Bytes an uncompressed fp16 cache would need for the tokens the velox caches saw."""
    total = 0
    for c in caches:
        if isinstance(c, VeloxCache) and c.velox_state is not None:
            b, h, d, _ = _dims(c)
            total += velox.fp16_bytes(c.offset, b, h, d)
    return total


def _dims(c: VeloxCache) -> tuple[int, int, int, mx.Dtype]:
    return method_dims(c.method, c.velox_state)


# --- KVzip's context reconstruction pass ----------------------------------------------

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n\n"


def reconstruction_prefill(model, tokens, caches: list, *, prompt_tokens, step: int = 2048) -> None:
    """Prefill ``tokens`` into velox caches, scoring them with a context-reconstruction pass.

    KVzip's probe (arXiv:2505.23416): the context is prefilled with a plain cache, then the
    model reads ``prompt_tokens`` (e.g. the encoded :data:`REPEAT_PROMPT`) followed by the
    context again; the queries of that repetition, which attend to the cached context, are
    handed to each layer's update with the context's keys and values (``queries=``). The
    reconstruction pass's own keys/values are discarded. Afterwards the caches hold the
    compressed context at ``offset == len(tokens)``, ready for the question and decoding.
    """
    tokens = mx.array(tokens).reshape(-1)
    prompt = mx.array(prompt_tokens).reshape(-1)
    plain = default_layout(model)
    for i in range(0, len(tokens), step):
        model(tokens[None, i:i + step], cache=plain)
        mx.eval([c.state for c in plain])
    n = len(tokens)
    kv = [c.state[:2] for c in plain]
    kv = [(k[:, :, :n], v[:, :, :n]) for k, v in kv]
    mx.eval(kv)
    with query_capture() as taps:
        model(mx.concatenate([prompt, tokens])[None], cache=plain)
        mx.eval(taps)
    velox_layers = [c for c in caches if isinstance(c, VeloxCache)]
    if len(taps) != len(velox_layers) or len(kv) != len(caches):
        raise ValueError("reconstruction_prefill needs one velox cache per attention layer")
    for c, (k, v), q in zip(velox_layers, kv, taps):
        c.absorb(k, v, queries=q[:, :, len(prompt):])
    mx.eval([c.state for c in velox_layers])
