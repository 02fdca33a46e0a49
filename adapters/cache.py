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
from velox import evict, wrap
from velox.decode import (StepInfo, arrays as _arrays, compiled, compiled_form, fill_token,
                          layer_step, step_info, steady_rows, steady_token,
                          with_empty_slots as _with_empty_slots, with_state as _with_state,
                          write_row as _write_row)
from velox.adapters import guards, model_step
from velox.adapters.batch import VeloxBatchCache
from velox.adapters.routing import (KV_BITS as _KV_BITS, Mode, _check_mode, _choose_mode,
                                    capture_installed as _capture_installed,
                                    install_query_capture, query_capture,
                                    routes_attention as _routes_attention, tap_queries,
                                    uninstall_query_capture)
from velox.adapters.model_step import SteppedCache
from velox.backend import resolve_backend
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


@dataclass
class _Step:
    """Tokens one ``update_and_fetch`` took, before the method's update absorbs them.

    ``keys``/``values`` are the call's tokens. In deferred mode a step is pending until the
    wrapped attention completes it: ``fused`` says the wrapper runs the compiled attention +
    update (or the fill step), ``new_only`` that ``update_and_fetch`` handed out only the
    call's tokens, and ``filled`` the state after a fill step (the token written into an empty
    slot by the backend's ``fill``) when that was decided at the call.
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    fused: bool = False
    new_only: bool = False
    filled: Any = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def arrays(self) -> list[mx.array]:
        return [x for x in (self.keys, self.values) if x is not None]


class _Split(_Step):
    """A verify call waiting for its attention (rollback, deferred mode): the wrapper runs it
    as the one-token steps it stands for (:meth:`VeloxCache._verify`)."""

    def __init__(self, keys: mx.array, values: mx.array):
        super().__init__(keys, values, new_only=True)


class _Shared:
    """A step observer held by a cache: copies of the cache share it (``copy.deepcopy``
    returns it as is, so a bound method's object is never copied)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn

    def __deepcopy__(self, memo: dict) -> "_Shared":
        return self


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
    """mlx-lm cache protocol around one layer's velox state (any registered method).

    Configuration (fixed at construction): ``method``, ``params``, ``backend``, ``layer``,
    ``compile``, ``real_queries``, ``decode``, ``decode_cap`` and ``mode``. State: the
    method's state, the offset, the append-mode tail (and its queries) and, in deferred mode
    between ``update_and_fetch`` and the wrapped attention, the pending step.
    ``last_step`` says how the last step ran (``"proxy"``, ``"deferred"``, ``"fused"``,
    ``"fill"``: a steady step into an empty slot of amortized eviction, or ``"tail"``);
    nothing reads it to choose a path.

    ``observe`` (``None``, the default, or ``fn(layer, info)``): called after every update of
    the method's state with the step's ``velox.decode.StepInfo`` (tokens held and dropped,
    bytes, the quantization error of the step's rows), the seed's observers' figures. An
    observed cache decodes layer by layer (never in the whole model's compiled step, whose
    updates run inside one compiled call) and writes each step's row at once; copies of the
    cache (``copy.deepcopy``, mlx-lm's batching) share the same ``fn``. Off, it costs nothing.
    """

    def __init__(self, method: str, params: dict[str, Any] | None = None, *,
                 backend: str = "auto", layer: int = 0, model: _Model | None = None,
                 compile: bool = True, real_queries: bool = True, decode: str = "evict",
                 decode_cap: int = DECODE_CAP, mode: Mode | str = Mode.PROXY,
                 artifact: dict[str, Any] | None = None, rollback: int = 0,
                 observe: Callable[[int, StepInfo], Any] | None = None):
        _check_settings(decode, decode_cap, rollback, compile, real_queries, backend)
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer={layer!r} must be an integer >= 0")
        self.decode = decode
        self.decode_cap = decode_cap
        self.method = get_method(method)
        # The method the cache steps: in append mode the method behind its decode tail
        # (velox.wrap.with_tail; a cap of 1 holds no tail: the method itself).
        self._m = wrap.with_tail(self.method, decode_cap) if decode == "append" else self.method
        if rollback:  # and behind its journal (velox.wrap.with_rollback), which trim reads
            self._m = wrap.with_rollback(self._m, rollback)
        self.mode = _check_mode(mode)
        if self.mode is Mode.PROXY and self.method.attend is not None:
            raise ValueError(f"{self.method.key} attends through its own hook: it needs "
                             "mode='deferred' (a model whose attention calls mlx-lm's "
                             "scaled_dot_product_attention)")
        if rollback and self.method.layer_update is not None:
            raise ValueError(
                f"rollback={rollback}: {self.method.key} updates a model-level record shared by "
                "every layer, layer by layer, which neither a layer's journal restores nor a "
                "verify call split inside each layer reproduces; use rollback=0")
        self.params = dict(params or {})
        self._full_params = validate_params(self.method.spec, self.params)
        if artifact is not None and self.method.calibrate is None:
            raise ValueError(f"{self.method.key} takes no calibration artifact")
        # This layer's calibration arrays, installed into the state when it is created.
        self.artifact = artifact
        self.backend = backend
        self.layer = layer
        self._model = model
        self.compile = compile
        self.real_queries = real_queries
        self.last_step: str | None = None
        # Loaded without its model: the first forward confirms the deferred mode.
        self._route_unknown = False
        self._state: tuple | None = None
        self._fast: tuple | None = None  # the state held, while the fast path holds for it
        self._pending: _Step | None = None
        self._offset = 0
        self.rollback = rollback
        self.observe = observe

    @property
    def observe(self) -> Callable[[int, StepInfo], Any] | None:
        """The step observer (see the class docstring), or ``None``."""
        held = self.__dict__.get("_observe")
        return None if held is None else held.fn

    @observe.setter
    def observe(self, fn: Callable[[int, StepInfo], Any] | None) -> None:
        if fn is not None and not callable(fn):
            raise ValueError(f"observe={fn!r} must be None or a function fn(layer, info)")
        self.__dict__["_observe"] = None if fn is None else _Shared(fn)
        self.__dict__["_fast"] = None  # the fast path is decided again, with or without it

    def _observed(self, before, keys: mx.array, values: mx.array) -> None:
        """Call the observer with the StepInfo of an update from ``before`` taking ``keys``
        and ``values`` to the state held now."""
        held = self.__dict__.get("_observe")
        if held is not None and before is not None:
            held.fn(self.layer, step_info(self._m, before, self._state, keys, values))

    # -- the state, and a decode step's row not yet written into its slot -----------
    @property
    def _state(self) -> tuple | None:
        """The method's state, with a decode step's row written into its slot if one is
        pending (:func:`_split_step`): the write is built here, before anything reads the
        rows, so MLX does it in place. The written state keeps the fast path (``_fast``):
        the same slots, one row's values changed."""
        d = self.__dict__
        row = d.get("_row")
        if row is not None:
            held = d["_held"]
            d["_row"] = None
            d["_held"] = _write_row(held, row)
            if d.get("_fast") is held:
                d["_fast"] = d["_held"]
        return d.get("_held")

    @_state.setter
    def _state(self, value: tuple | None) -> None:
        d = self.__dict__
        d["_held"], d["_row"] = value, None
        if d.get("_fast") is not value:  # another state: the fast path ends (and lets go of it)
            d["_fast"] = None

    def _note_fast(self) -> None:
        """After a fused decode step: whether the next single-token step may skip
        :meth:`update_and_fetch`'s checks. ``_fast`` is ``None`` or the very state held
        (``_held``) it was decided for: replacing the state ends it (the setter), writing a
        pending row keeps it (the getter), so it never holds a state the cache has left
        behind (whose arrays would stay alive, and which would stop MLX from writing the row
        in place). It may where nothing but the fused step can run next: no rollback
        journal, no append tail, the wrapper routing attention, a method without a
        model-level record, and the state still at its steady size."""
        ok = (self._plain_steps()
              and self._m.kv_slots(self.__dict__["_held"])[0].shape[2] == self.__dict__.get("_steady_rows"))
        self.__dict__["_fast"] = self.__dict__["_held"] if ok else None

    def _plain_steps(self) -> bool:
        """Whether a single-token step of this cache is the method's step alone: no rollback
        journal, ``decode="evict"`` with no append tail, no observer, the wrapper known to
        route attention, and no model-level record (what both the fast path and the
        compiled step of chunked storage need)."""
        return (not self.rollback and self._m is self.method
                and self.__dict__.get("_observe") is None and not self._route_unknown
                and self.method.layer_update is None)

    # -- protocol (getters: none of them updates) ----------------------------------
    @property
    def offset(self) -> int:
        """Absolute position of the next token (RoPE offset), never the stored count."""
        return self._offset

    @offset.setter
    def offset(self, value: int) -> None:
        raise AttributeError("the offset of a velox cache follows the tokens it absorbed")

    def size(self) -> int:
        """Tokens held: stored (after the last update, the append-mode tail included) and
        the tokens of a pending step (deferred mode, before its attention)."""
        return self._stored_count() + self._pending_len()

    def empty(self) -> bool:
        return self._state is None and self._pending is None

    @property
    def tail(self) -> tuple[mx.array, mx.array] | None:
        """Append mode: the decoded ``(keys, values)`` ``[b, h, t, d]`` not yet compressed
        (``None`` when there are none)."""
        st = self._tail_state()
        return None if st is None else (st.keys, st.values)

    @property
    def tail_queries(self) -> mx.array | None:
        """Append mode: the real queries of the tail's tokens (``None`` when there is no tail,
        or one of its steps came without its query: the tail is then absorbed with the
        key-as-query proxy)."""
        st = self._tail_state()
        return None if st is None else st.queries

    def positions(self) -> mx.array:
        """Absolute positions ``[b, h, n]`` of what the cache holds: stored (the tail last),
        then the tokens of a pending step."""
        if self._state is None:
            return mx.zeros((1, 1, 0), mx.int32)
        pos = self._m.positions(self._state)
        t = self._pending_len()
        if not t:
            return pos
        b, h = pos.shape[:2]
        new = mx.arange(self._offset - t, self._offset, dtype=pos.dtype)
        return mx.concatenate([pos, mx.broadcast_to(new, (b, h, t))], axis=2)

    def is_trimmable(self) -> bool:
        """Whether ``trim`` can remove tokens: the cache declares a rollback depth (``rollback
        > 0``)."""
        return self.rollback > 0

    def trimmable_tokens(self) -> int:
        """The most tokens :meth:`trim` removes now: those of the journaled steps (0 without
        rollback)."""
        st = self.__dict__.get("_held")
        return wrap.trimmable_tokens(st) if isinstance(st, wrap.JournalState) else 0

    def can_trim(self, n: int) -> bool:
        """Whether ``trim(n)`` is exact now: ``n`` is 0 or the token count of the newest
        ``k`` journaled steps for some ``k`` (any ``n <= rollback`` once decoding, as every
        decode step and every token of a verify call is a step of its own). Reads only the
        journal's step counts."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            return False
        st = self.__dict__.get("_held")
        return n == 0 or (isinstance(st, wrap.JournalState) and wrap.can_trim(st, n))

    @_BatchMerge
    def merge(cls, caches: list) -> "velox.adapters.batch.VeloxBatchCache":
        """mlx-lm's batch protocol: one batch cache of these single-sequence caches, in order
        (``velox.adapters.batch.VeloxBatchCache``: each row runs exactly as alone).

        A classmethod. A cache made for a model whose attention does not reach the adapter's
        wrapper (``make_cache`` found it unrouted) has no ``merge`` attribute at all: mlx-lm
        decides from ``hasattr(cache, "merge")`` whether a model batches, so its server and
        ``BatchGenerator`` then serve that model one request at a time instead of failing
        at the second request."""
        return VeloxBatchCache.merge(caches)

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens exactly, and return ``n``.

        The cache returns to its fields before those tokens' steps (method state, tail and its
        queries, offset), as the same cache that never saw them holds; the journal keeps the
        older steps. Raises ``ValueError`` when ``can_trim(n)`` is false (never a partial
        trim: mlx-lm ignores what ``trim`` returns). Without rollback (``rollback=0``) nothing
        is removed and 0 is returned, as ``is_trimmable()`` is ``False``.
        """
        if not self.rollback:
            return 0
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"trim({n!r}): n must be an integer >= 0")
        if n == 0:
            return 0
        if not self.can_trim(n):
            st = self.__dict__.get("_held")
            steps = list(st.steps) if isinstance(st, wrap.JournalState) else []
            ends = [sum(steps[len(steps) - j:]) for j in range(1, len(steps) + 1)]
            raise ValueError(
                f"trim({n}): this cache (rollback={self.rollback}) can remove exactly "
                f"{', '.join(map(str, ends)) or 'no'} tokens now (its journaled steps end at "
                f"offset {self._offset}); {n} is not a step boundary within its depth. For "
                "speculative decoding make the model's caches with rollback >= num_draft_tokens")
        self._state = wrap.trim(self._state, n)
        self._offset -= n
        self._pending = None
        return n

    def _splits(self, keys: mx.array) -> bool:
        """Whether a call is a verify call to run as one-token steps (:meth:`_verify`): 2 to
        ``rollback + 1`` tokens on a cache holding tokens, in deferred mode with the wrapper
        known to run for this layer."""
        s = keys.shape[2]
        return (1 < s <= self.rollback + 1 and self._offset > 0 and self.mode is Mode.DEFERRED
                and not self._route_unknown and _capture_installed())

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("velox caches do not support sliding-window attention layers")
        if N == 1:
            return None
        if return_array:
            return _mlx_base.create_causal_mask(N, offset=self._stored_count())
        return "causal"

    @property
    def to_quantized(self):
        """Refused: mlx-lm's ``kv_bits`` would swap this cache for a plain quantized one."""
        raise ValueError(_KV_BITS)

    @property
    def nbytes(self) -> int:
        """Bytes the velox state really holds (the append-mode tail's keys, values and kept
        queries, and the arrays of the rollback journal's states that the current one does
        not hold, included), plus new tokens not yet absorbed."""
        total = 0 if self._state is None else self._m.nbytes(self._state)  # (row written)
        if self._pending is not None:
            total += sum(x.nbytes for x in self._pending.arrays())
        return total

    @property
    def state(self) -> list[mx.array]:
        """Every array of the velox state (the tail's included) and of a pending step (mlx-lm
        evaluates these)."""
        if self._state is None:
            return []
        pending = [] if self._pending is None else self._pending.arrays()
        return _arrays(self._state) + pending

    @state.setter
    def state(self, v) -> None:
        raise AttributeError("set a velox cache's state with load_cache")

    @property
    def velox_state(self) -> tuple | None:
        """The method's state record (without the append-mode tail and a pending step's
        tokens)."""
        st = self._state
        if isinstance(st, wrap.JournalState):
            st = st.inner
        return st.inner if isinstance(st, wrap.TailState) else st

    # -- the compiled whole-model step (velox.adapters.model_step) -------------------
    def steady_state(self) -> tuple | None:
        """``(method, state, pending row, offset)`` while the next single-token step may run
        in the whole model's compiled step: the fast path holds for the state (a steady
        state after a fused step: no rollback journal, no append tail, the wrapper routing
        attention, no model-level record), nothing is pending, and no slot is empty (the
        layout the compiled step was traced for; amortized eviction's fill steps run layer
        by layer); an observed cache never offers it.

        A state of chunked storage (the codecs: ``velox.decode.steady_room``) is steady while
        its next token fits an empty row of its arrays: the same conditions, read from the
        cache (no rollback journal, no append tail, the wrapper routing attention, the
        compiled path allowed), and no step that would grow the arrays (those run layer by
        layer); nothing is read from the device: the state holds the cache's offset in
        tokens, and its arrays' shapes say their rows. The compiled step takes its record
        with the count of empty rows left to the arrays (``velox.decode.steady_form``): the
        same record from token to token, so one trace for each size of the arrays."""
        d = self.__dict__
        held, m = d.get("_held"), self._m
        if (held is None or self._pending is not None or not _capture_installed()
                or d.get("_observe") is not None):
            return None
        form = compiled_form(m, held, self._offset, steady=d.get("_fast") is held,
                             plain=self.compile and self._plain_steps(), row=d.get("_row"))
        return None if form is None else (m, form, d.get("_row"), self._offset)

    def stepped(self, state, row) -> None:
        """Take the state and pending row of a compiled whole-model step: one token more, the
        fast path kept for the new state."""
        d = self.__dict__
        d["_held"], d["_row"], d["_fast"] = state, row, state
        self._offset += 1
        self.last_step = "compiled"

    # -- updates -------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Take this step's keys/values; return what its attention reads (stored + new).

        Proxy mode runs the method's update here (after building what it returns). Deferred
        mode (while the wrapper is installed) leaves the step to the wrapped attention; when
        the wrapper does the work itself (the method's ``attend`` hook, or the fused compiled
        decode step) only the new tokens are returned, as the wrapper ignores what it is
        handed. In append mode the method is behind its decode tail (``velox.wrap.with_tail``):
        what is stored includes the tail, and a single-token step below the cap joins it.

        With ``rollback=d`` (deferred mode), a call of 2 to ``d + 1`` tokens on a cache that
        holds tokens (a speculative verify call) waits whole for the wrapper, which runs it as
        the one-token steps it stands for (:meth:`_verify`).
        """
        d = self.__dict__
        fast = d.get("_fast")
        if (fast is not None and fast is d.get("_held") and keys.shape[2] == 1
                and self._pending is None and _capture_installed()):
            # the steady decode step after a fused one (:meth:`_note_fast`): nothing else to
            # check, and the pending row is written inside the next fused step
            self._offset += 1
            self._pending = _Step(keys, values, fused=True, new_only=True)
            return keys, values
        if self._route_unknown and self._pending is None:
            install_query_capture()  # loaded without its model: its modules are imported now
        self._settle()
        if self._splits(keys):
            self._offset += keys.shape[2]  # (getters count the waiting tokens)
            self._pending = _Split(keys, values)
            return keys, values
        return self._fetch(keys, values)

    def _fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """:meth:`update_and_fetch` of one step."""
        step = self._take(keys, values)
        if self.mode is Mode.DEFERRED and _capture_installed():
            # until the first forward shows the wrapper runs, hand out what attention reads
            wrapper_attends = self._m.attend is not None and not self._route_unknown
            step.fused = self._steady(keys) or self._fills(step)
            step.new_only = wrapper_attends or (step.fused and not self._route_unknown)
            self._pending = step
            if step.new_only:
                return keys, values
            k, v = self._stored_rows(True)  # (lazy: never computed if the wrapper attends itself)
            return evict.append_rows(k, keys), evict.append_rows(v, values)
        k, v = self._stored_rows(False)
        out = evict.append_rows(k, keys), evict.append_rows(v, values)
        self._absorb(step, None)
        self.last_step = self._kind("proxy")
        return out

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                  mask, sinks=None) -> mx.array:
        """This step's attention (plain, fused, or the method's ``attend``), then the update
        of a pending step with the real queries; plain attention when none is pending."""
        self._route_unknown = False  # the model's attention reaches the wrapper
        step, self._pending = self._pending, None
        if step is None:  # proxy mode: the update already ran in update_and_fetch
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                        mask=mask, sinks=sinks)
        if isinstance(step, _Split):
            return self._verify(step, queries, scale=scale, sinks=sinks)
        m = self._m
        if step.fused and sinks is None and mask is None:
            d = self.__dict__
            before = self._state if d.get("_observe") is not None else None  # (row written)
            held, row = d["_held"], d["_row"]
            steady = d.get("_fast") is held  # decided for this state: a fused step keeps it so
            out, new, row, self.last_step = layer_step(m, held, row, queries, step.keys,
                                                       step.values, scale, filled=step.filled)
            self._state, self._row = new, row
            self._observed(before, step.keys, step.values)
            if steady:  # nothing _note_fast reads changes in a fused step (same rows, same cache)
                d["_fast"] = new
            else:
                self._note_fast()
            return _with_state(out, self._new_arrays())
        if m.attend is not None:
            if sinks is not None:
                raise ValueError(f"{m.key} does not support attention sinks")
            if (step.keys.shape[2] == queries.shape[2] and m.layer_update is None
                    and not self._steady(step.keys)):
                # attention and update in one call (a method's decode kernels do both)
                before = self._state
                out, self._state = m.attend_update(before, queries, step.keys, step.values,
                                                   scale=scale, mask=mask)
                self._observed(before, step.keys, step.values)
                self.last_step = self._kind("deferred")
                return _with_state(out, self._new_arrays())
            out = m.attend(self._state, queries, step.keys, step.values, scale=scale, mask=mask)
        else:
            if step.new_only:  # handed the new tokens only; rebuild what attention reads
                k, v, _ = m.kv_slots(self._state)
                keys, values = evict.append_rows(k, step.keys), evict.append_rows(v, step.values)
            mask = _with_empty_slots(mask, self._empty_mask(), queries, keys.shape[2])
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                       mask=mask, sinks=sinks)
        self._absorb(step, queries, evaluate=False)
        self.last_step = self._kind("deferred")
        return _with_state(out, self._new_arrays())

    def _kind(self, kind: str) -> str:
        """``last_step`` of an update: ``"tail"`` where the step's token joined the tail."""
        return "tail" if self._tail_state() is not None else kind

    def _tail_state(self) -> wrap.TailState | None:
        """Append mode: the tail's state (inside the journal's, with rollback) while it
        holds tokens."""
        st = self.__dict__.get("_held")
        if isinstance(st, wrap.JournalState):
            st = st.inner
        return st if isinstance(st, wrap.TailState) and st.tail_len else None

    def _verify(self, step: _Split, queries: mx.array, *, scale: float, sinks) -> mx.array:
        """A verify call as the one-token steps it stands for: token ``i``'s update and
        attention (each journaled) run before token ``i + 1``'s, so each token sees the cache
        it sees in a one-token-per-step run, and a trim of any of its tokens restores exactly.
        The model's projections and MLPs stay batched over the call."""
        s = step.length
        self._offset -= s
        out = []
        for i in range(s):
            keys, values = self._fetch(step.keys[:, :, i:i + 1], step.values[:, :, i:i + 1])
            out.append(self.attention(queries[:, :, i:i + 1], keys, values, scale=scale,
                                      mask=None, sinks=sinks))
        return mx.concatenate(out, axis=2)

    def absorb(self, keys: mx.array, values: mx.array, *, queries: mx.array | None = None) -> None:
        """Feed keys/values (and the queries to score them with) straight into the state.

        For callers that computed a layer's keys/values themselves, e.g. a prefill whose
        scoring queries come from another pass (KVzip's context reconstruction).
        """
        self._settle()
        self._absorb(self._take(keys, values), queries)

    def _settle(self) -> None:
        """Complete a pending step whose attention never reached the wrapper (the last
        forward did not call mlx-lm's scaled_dot_product_attention for this layer): its
        tokens are absorbed with the proxy, as proxy mode would have.

        This is also where a cache loaded without its model settles its mode. Until its first
        forward shows the wrapper runs (``attention`` clears ``_route_unknown``), a step hands
        out what attention reads, so either path works; a step still pending here shows the
        model's attention does not call the wrapper: the cache turns to proxy mode (a method
        with ``attend`` refuses such a model).
        """
        step = self._pending
        if step is None:
            return
        if self._route_unknown:
            self._route_unknown = False
            self.mode = _choose_mode(self._m, real_queries=self.real_queries, routed=False)
        if step.new_only:
            raise RuntimeError(
                f"{self.method.key} attends through mlx-lm's scaled_dot_product_attention, "
                "but the last forward did not call it for this layer")
        self._pending = None
        if step.keys is not None:
            self._absorb(step, None)

    def _take(self, keys: mx.array, values: mx.array) -> _Step:
        """Create the state on the first tokens, advance the offset, and return the step."""
        if self.__dict__.get("_held") is None:
            b, h, _, d = keys.shape
            self._state = self._m.init(b, h, d, dtype=keys.dtype, backend=self.backend, **self.params)
            if self.artifact is not None:
                self._state = self._m.calibrate(self._state, self.artifact)
        self._offset += keys.shape[2]
        return _Step(keys, values)

    def _absorb(self, step: _Step, queries: mx.array | None, *, evaluate: bool = True) -> None:
        """The method's update of ``step``'s tokens; its evaluation started here unless the
        caller ties the new state to the step's attention output (``evaluate=False``,
        :func:`_with_state`)."""
        keys, values = step.keys, step.values
        before = self._state if self.__dict__.get("_observe") is not None else None
        m = self._m
        if m.layer_update is not None and self._model is not None:
            model = self._model
            if model.record is None:
                model.record = m.model_init(model.layer_params)
            model.record, self._state = m.layer_update(model.record, self.layer, self._state,
                                                       keys, values, queries=queries)
            mx.async_eval(_arrays(model.record))
        elif not self._steady(keys):
            self._state = m.update(self._state, keys, values, queries=queries)
        elif queries is None:
            self._state, self._row = compiled(m, "update", self._state.backend)(self._state, keys, values)
        else:
            update = compiled(m, "update+queries", self._state.backend)
            self._state, self._row = update(self._state, keys, values, queries)
        self._observed(before, keys, values)
        if evaluate:
            mx.async_eval(self._new_arrays())

    def _new_arrays(self) -> list[mx.array]:
        """The arrays of the state and pending row an update just made."""
        return _arrays(self.__dict__["_held"]) + _arrays(self._row)

    def _pending_len(self) -> int:
        return 0 if self._pending is None else self._pending.length

    def _steady(self, keys: mx.array) -> bool:
        """A single-token step at a full bounded cache: shapes repeat, so compiling pays."""
        rows = self.__dict__.get("_steady_rows", False)
        if rows is False:  # the rows of a full state, or None: the parameters never change
            rows = self.__dict__["_steady_rows"] = steady_rows(self._m, self._full_params)
        return steady_token(self._m, self._state, keys, rows, compile=self.compile)

    def _fills(self, step: _Step) -> bool:
        """Whether a single-token step of a state that is not at a steady size (a
        prefill-bounded method's decode steps) goes into an empty slot by the backend's
        ``fill``: then the fill step runs in :meth:`attention` (``step.filled``, the state
        after it). Steady states (amortized eviction) decide it there; ``compile=False`` keeps
        the plain path."""
        step.filled = fill_token(self._m, self._state, step.keys, step.values, compile=self.compile)
        return step.filled is not None

    def _stored_count(self) -> int:
        return 0 if self._state is None else int(self._m.positions(self._state).shape[2])

    def _stored_rows(self, wrapped: bool) -> tuple[mx.array, mx.array]:
        """The stored rows attention reads: ``kv_slots`` (storage order; attention does not
        depend on the order of the stored rows). With empty slots the wrapped attention
        masks them (:meth:`_empty_mask`); mlx-lm's own attention cannot, so it gets
        ``get_kv``'s gather of the filled slots."""
        k, v, filled = self._m.kv_slots(self._state)
        if filled is not None and not wrapped:
            k, v = self._m.get_kv(self._state)
        return k, v

    def _empty_mask(self) -> mx.array | None:
        """``kv_slots``' mask of the filled slots ``[b, h, n]`` (``None``: no empty slot)."""
        return None if self._state is None else self._m.kv_slots(self._state)[2]


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
            ``ValueError``. Without one a calibrated method runs its documented
            data-oblivious fallback.
        rollback: the steps ``trim`` can undo exactly (a journal of the cache's fields before
            each of its last ``rollback`` steps; 0, the default, keeps none and ``trim``
            removes nothing), at most :data:`ROLLBACK_MAX` (64). With ``rollback=d``, a call
            of 2 to ``d + 1`` tokens on a cache holding tokens (speculative decoding's verify
            call) runs as one-token steps, so ``draft_model=`` with ``num_draft_tokens <= d``
            gives the greedy tokens of the run without a draft. The journal costs up to ``d``
            states beyond the cache's own in ``decode="evict"`` (each step makes a new
            state), hence the bound. Refused for cross-layer methods.
        observe: ``fn(layer, info)`` called after every update of a layer's state with the
            step's ``velox.decode.StepInfo`` (tokens held and dropped, bytes, the step's
            quantization error); observed caches decode layer by layer. Also settable later
            (``cache.observe = fn``; ``None`` turns it off).
        **params: the method's parameters; a list gives one value per attention layer.
            Methods with a schedule (``layer_params``) derive per-layer values themselves.
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
    if artifacts is None and m.calibrate is not None and method not in _FALLBACK_SAID:
        _FALLBACK_SAID.add(method)
        warnings.warn(f"{method}: no calibration artifact (artifacts=FILE, from velox calibrate "
                      f"--method {method}); using its data-oblivious fallback", stacklevel=2)
    if artifacts is not None:
        from .artifacts import layer_arrays, load_artifact
        if m.calibrate is None:
            raise ValueError(f"{method} takes no calibration artifact")
        arrays, _ = load_artifact(artifacts, method=method, model=model)
        if len(next(iter(arrays.values()))) != n:
            raise ValueError(f"{artifacts} holds {len(next(iter(arrays.values())))} layers; the "
                             f"model has {n} layers with a plain KV cache")
        fitted = [layer_arrays(arrays, i) for i in range(n)]
    caches = list(base)
    for layer, slot in enumerate(slots):
        caches[slot] = VeloxCache(method, per_layer[layer], backend=backend, layer=layer,
                                  model=shared, compile=compile, real_queries=real_queries,
                                  decode=decode, decode_cap=decode_cap, mode=mode,
                                  artifact=None if fitted is None else fitted[layer],
                                  rollback=rollback, observe=observe)
        caches[slot]._routed = routed  # merge batches B > 1 rows only through the wrapper
    guards.install()
    if compile and mode is Mode.DEFERRED:
        model_step.install(model)
    return caches


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
