"""mlx-lm adapter: one generic cache class that wraps any velox method's state.

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
* Rollback (``rollback=d``, default 0): the cache journals its fields before each of its
  last ``d`` steps (references: states are never changed in place), ``trim(n)`` restores the
  one ``n`` tokens back exactly or raises ``ValueError`` (never a partial trim),
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
  multi-token call takes the tail with it the same way: one update of tail + chunk.
* ``save_cache`` / ``load_cache``: one ``.safetensors`` file whose checksum covers its
  metadata and arrays; a loaded cache is checked against its method (and a given model's
  dims) and decodes as the saved one would have.
* Compiled steps (a steady decode update, the fused attention + update) live in one bounded
  cache keyed by method, kind of step and backend (``_compiled``).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as _mlx_base
from mlx_lm.models.cache import KVCache

import velox
from velox import evict
from velox.decode import (StepInfo, arrays as _arrays, slot_count, step_info, split_step, split_step_with_row, split_update,
                          steady_rows, slack as decode_slack,
                          with_empty_slots as _with_empty_slots, with_state as _with_state,
                          write_row as _write_row)
from velox.adapters import guards, model_step
from velox.adapters.batch import VeloxBatchCache
from velox.adapters.routing import (KV_BITS as _KV_BITS, Mode, _check_mode, _choose_mode,
                                    capture_installed as _capture_installed,
                                    install_query_capture, query_capture,
                                    routes_attention as _routes_attention, tap_queries,
                                    uninstall_query_capture, untapped)
from velox.adapters.model_step import SteppedCache
from velox.backend import BackendUnavailable, resolve_backend
from velox.registry import Method, get_method
from velox.spec import validate_params

__all__ = ["VeloxCache", "Mode", "make_cache", "save_cache", "load_cache", "cache_nbytes",
           "cache_fp16_bytes", "install_query_capture", "uninstall_query_capture",
           "query_capture", "tap_queries", "reconstruction_prefill", "ROLLBACK_MAX"]


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

    ``keys``/``values`` are what the update absorbs: an append-mode tail taken along
    (``prefix`` tokens, with ``prefix_q`` their queries, ``None`` for the proxy), then the
    call's tokens. In deferred mode a step is pending until the wrapped attention completes
    it; ``keys is None`` then means the call's token joined the tail (the wrapper attends and
    records its query), ``fused`` that the wrapper runs the compiled attention + update (or
    the fill step), ``new_only`` that ``update_and_fetch`` handed out only the call's tokens,
    and ``filled`` the state after a fill step (the token written into an empty slot by the
    backend's ``fill``) when that was decided at the call.
    """

    keys: mx.array | None = None
    values: mx.array | None = None
    prefix: int = 0
    prefix_q: mx.array | None = None
    fused: bool = False
    new_only: bool = False
    filled: Any = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def arrays(self) -> list[mx.array]:
        return [x for x in (self.keys, self.values, self.prefix_q) if x is not None]


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


class _Entry(NamedTuple):
    """Rollback: a cache's fields before one step. Every field is a reference: states, tails
    and rows are never changed in place (MLX writes into a buffer in place only when nothing
    else holds it, and the journal holds these)."""

    held: tuple | None             # the method's state, as stored (its pending row not written)
    row: tuple | None              # a decode step's slot write left for the next step
    offset: int
    tail: tuple[mx.array, mx.array] | None
    tail_q: mx.array | None


# The most steps a cache journals (``rollback=``). Speculative decoding trims at most
# ``num_draft_tokens`` (mlx-lm's default 2) and drafts rarely exceed a few tens of tokens,
# while the journal's cost grows with its depth: in decode="evict" every entry holds a whole
# state (up to ``rollback + 1`` states live), and a call of 2 to ``rollback + 1`` tokens runs
# as one-token steps.
ROLLBACK_MAX = 64


def _check_rollback(rollback: Any) -> None:
    if isinstance(rollback, bool) or not isinstance(rollback, int) or not 0 <= rollback <= ROLLBACK_MAX:
        raise ValueError(
            f"rollback={rollback!r} must be an integer from 0 to ROLLBACK_MAX={ROLLBACK_MAX} (the "
            "steps trim can undo; the journal holds up to that many states, and calls of up to "
            "rollback + 1 tokens run as one-token steps)")


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
        _check_decode(decode, decode_cap)
        _check_rollback(rollback)
        _check_flag("compile", compile)
        _check_flag("real_queries", real_queries)
        if not isinstance(backend, str):
            raise ValueError(f"backend={backend!r} must be a backend name (a str)")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer={layer!r} must be an integer >= 0")
        self.decode = decode
        self.decode_cap = decode_cap
        self.method = get_method(method)
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
        # Append mode: decoded tokens not yet handed to the method, and their queries (None
        # once a step's query is missing).
        self._tail: tuple[mx.array, mx.array] | None = None
        self._tail_q: mx.array | None = None
        # Rollback: the cache's fields before each of its last ``rollback`` steps.
        self.rollback = rollback
        self._journal: list[_Entry] = []
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
            held.fn(self.layer, step_info(self.method, before, self._state, keys, values))

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
              and self.method.kv_slots(self.__dict__["_held"])[0].shape[2] == self.__dict__.get("_steady_rows"))
        self.__dict__["_fast"] = self.__dict__["_held"] if ok else None

    def _plain_steps(self) -> bool:
        """Whether a single-token step of this cache is the method's step alone: no rollback
        journal, ``decode="evict"`` with no append tail, no observer, the wrapper known to
        route attention, and no model-level record (what both the fast path and the
        compiled step of chunked storage need)."""
        return (not self.rollback and self.decode == "evict" and self._tail is None
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
        """Tokens held: stored (after the last update), the append-mode tail, and the tokens
        of a pending step (deferred mode, before its attention)."""
        return self._stored_count() + self._tail_len() + self._pending_len()

    def empty(self) -> bool:
        return self._state is None and self._pending is None and self._tail is None

    @property
    def tail(self) -> tuple[mx.array, mx.array] | None:
        """Append mode: the decoded ``(keys, values)`` ``[b, h, t, d]`` not yet compressed."""
        return self._tail

    def positions(self) -> mx.array:
        """Absolute positions ``[b, h, n]`` of what the cache holds: stored, then the tail,
        then the tokens of a pending step."""
        if self._state is None:
            return mx.zeros((1, 1, 0), mx.int32)
        pos = self.method.positions(self._state)
        t = self._tail_len() + self._pending_len()
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
        return self._offset - self._journal[0].offset if self._journal else 0

    def can_trim(self, n: int) -> bool:
        """Whether ``trim(n)`` is exact now: ``n`` is 0 or the token count of the newest
        ``k`` journaled steps for some ``k`` (any ``n <= rollback`` once decoding, as every
        decode step and every token of a verify call is a step of its own). Reads only the
        journal's offsets."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            return False
        return n == 0 or any(e.offset == self._offset - n for e in self._journal)

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
        for k in range(len(self._journal) - 1, -1, -1):
            e = self._journal[k]
            if e.offset == self._offset - n:
                del self._journal[k:]
                self.__dict__.update(_held=e.held, _row=e.row, _fast=None)
                self._offset, self._tail, self._tail_q = e.offset, e.tail, e.tail_q
                self._pending = None
                return n
        steps = [self._offset - e.offset for e in reversed(self._journal)]
        raise ValueError(
            f"trim({n}): this cache (rollback={self.rollback}) can remove exactly "
            f"{', '.join(map(str, steps)) or 'no'} tokens now (its journaled steps end at "
            f"offset {self._offset}); {n} is not a step boundary within its depth. For "
            "speculative decoding make the model's caches with rollback >= num_draft_tokens")

    def _splits(self, keys: mx.array) -> bool:
        """Whether a call is a verify call to run as one-token steps (:meth:`_verify`): 2 to
        ``rollback + 1`` tokens on a cache holding tokens, in deferred mode with the wrapper
        known to run for this layer."""
        s = keys.shape[2]
        return (1 < s <= self.rollback + 1 and self._offset > 0 and self.mode is Mode.DEFERRED
                and not self._route_unknown and _capture_installed())

    def _remember(self) -> None:
        """Journal the cache's fields before a step (references: nothing is copied), keeping
        the last ``rollback`` entries."""
        if not self.rollback:
            return
        d = self.__dict__
        self._journal.append(_Entry(d.get("_held"), d.get("_row"), self._offset, self._tail,
                                    self._tail_q))
        if len(self._journal) > self.rollback:
            del self._journal[0]

    def _journal_nbytes(self) -> int:
        """Bytes of the journal's arrays that the current fields do not hold."""
        if not self._journal:
            return 0
        own = {id(x) for x in _arrays((self.__dict__.get("_held"), self.__dict__.get("_row"),
                                       self._tail, self._tail_q))}
        seen: dict[int, int] = {}
        for e in self._journal:
            for x in _arrays((e.held, e.row, e.tail, e.tail_q)):
                if id(x) not in own:
                    seen[id(x)] = x.nbytes
        return sum(seen.values())

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("velox caches do not support sliding-window attention layers")
        if N == 1:
            return None
        if return_array:
            return _mlx_base.create_causal_mask(N, offset=self._stored_count() + self._tail_len())
        return "causal"

    @property
    def to_quantized(self):
        """Refused: mlx-lm's ``kv_bits`` would swap this cache for a plain quantized one."""
        raise ValueError(_KV_BITS)

    @property
    def nbytes(self) -> int:
        """Bytes the velox state really holds, plus new tokens not yet absorbed, the
        append-mode tail (its keys, values and kept queries) and the rollback journal's arrays
        that the current fields do not hold."""
        total = 0 if self._state is None else self.method.nbytes(self._state)  # (row written)
        if self._pending is not None and self._pending.keys is not None:
            total += self._pending.keys.nbytes + self._pending.values.nbytes
        return total + sum(x.nbytes for x in self._tail_arrays()) + self._journal_nbytes()

    @property
    def state(self) -> list[mx.array]:
        """Every array of the velox state, of the tail and of a pending step (mlx-lm
        evaluates these)."""
        if self._state is None:
            return []
        pending = [] if self._pending is None else self._pending.arrays()
        return _arrays(self._state) + self._tail_arrays() + pending

    @state.setter
    def state(self, v) -> None:
        raise AttributeError("set a velox cache's state with load_cache")

    @property
    def velox_state(self) -> tuple | None:
        """The method's state record (without the tail and a pending step's tokens)."""
        return self._state

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
        held, m = d.get("_held"), self.method
        if (held is None or self._pending is not None or not _capture_installed()
                or d.get("_observe") is not None):
            return None
        room = velox.decode.steady_room(m, held, self._offset)
        if room is None:
            if d.get("_fast") is not held or evict.empty_slots(getattr(held, "policy", held)):
                return None
        elif room < 1 or not self.compile or not self._plain_steps() or d.get("_row") is not None:
            return None
        else:
            held = velox.decode.steady_form(m, held)
        return m, held, d.get("_row"), self._offset

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
        handed. In append mode a single-token step below the cap joins the tail and the
        method's update does not run.

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
        """:meth:`update_and_fetch` of one step (journaled first, with ``rollback``)."""
        self._remember()
        m = self.method
        defer = self.mode is Mode.DEFERRED and _capture_installed()
        # Until the first forward shows the wrapper runs, hand out what attention reads.
        wrapper_attends = m.attend is not None and not self._route_unknown
        if (self.decode == "append" and keys.shape[2] == 1
                and self._tail_len() + 1 < self.decode_cap):
            self._append(keys, values)
            if defer:
                self._pending = _Step(new_only=wrapper_attends)
                if wrapper_attends:
                    return keys, values
            else:
                self.last_step = "tail"
            k, v = self._stored_rows(defer)
            tk, tv = self._tail
            return evict.append_rows(k, tk), evict.append_rows(v, tv)
        step = self._take(keys, values)
        if defer:
            step.fused = self._steady(step.keys) or self._fills(step)
            step.new_only = wrapper_attends or (step.fused and not self._route_unknown)
            self._pending = step
            if step.new_only:
                return keys, values
        # Stored + new (lazy: never computed if the wrapper attends itself).
        k, v = self._stored_rows(defer)
        out = evict.append_rows(k, step.keys), evict.append_rows(v, step.values)
        if not defer:
            self._absorb(step, None)
            self.last_step = "proxy"
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
        m = self.method
        if step.keys is None:  # append mode: a decode step that joined the tail
            if m.attend is not None:
                if sinks is not None:
                    raise ValueError(f"{m.key} does not support attention sinks")
                out = self._attend(queries, *self._tail, mask, scale=scale)
            else:
                mask = _with_empty_slots(mask, self._empty_mask(), queries, keys.shape[2])
                out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                           mask=mask, sinks=sinks)
            self._keep_query(queries)
            self.last_step = "tail"
            return out
        if step.fused and sinks is None and mask is None:
            d = self.__dict__
            before = self._state if d.get("_observe") is not None else None  # (row written)
            held, row = d["_held"], d["_row"]
            steady = d.get("_fast") is held  # decided for this state: a fused step keeps it so
            backend = m.backends[held.backend]
            fill = backend.fill if row is None else None
            new = step.filled
            if new is None and fill is not None:
                new = fill(held, step.keys, step.values)
            if new is not None:  # a token into an empty slot (amortized eviction): no score,
                # the row written in place and attention over the filled slots: the backend's
                # kernel reading the buffers in place (cuda), else MLX's over a view of the
                # first slots (kv_slots'; the steps of mlx-lm's own cache)
                attend = backend.fill_attention
                out = None if attend is None else attend(held, new, queries, step.keys, step.values, scale)
                if out is None:
                    k, v = evict.filled_rows(new.keys, new.values, new.empty)
                    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)
                self._state = new
                self._observed(before, step.keys, step.values)
                self.last_step = "fill"
                if steady:
                    d["_fast"] = new
                else:
                    self._note_fast()
                return _with_state(out, self._new_arrays())
            if row is None:
                fused = _compiled(m, "fused", held.backend)
                out, new, row = fused(held, queries, step.keys, step.values, scale)
            else:  # the last step's row is written first, in place, inside the compiled step
                fused = _compiled(m, "fused+row", held.backend)
                out, new, row = fused(held, row, queries, step.keys, step.values, scale)
            self._state, self._row = new, row
            self._observed(before, step.keys, step.values)
            self.last_step = "fused"
            if steady:  # nothing _note_fast reads changes in a fused step (same rows, same cache)
                d["_fast"] = new
            else:
                self._note_fast()
            return _with_state(out, self._new_arrays())
        if m.attend is not None:
            if sinks is not None:
                raise ValueError(f"{m.key} does not support attention sinks")
            if (not step.prefix and step.keys.shape[2] == queries.shape[2]
                    and m.layer_update is None and not self._steady(step.keys)):
                # attention and update in one call (a method's decode kernels do both)
                before = self._state
                out, self._state = m.attend_update(before, queries, step.keys, step.values,
                                                   scale=scale, mask=mask)
                self._observed(before, step.keys, step.values)
                self.last_step = "deferred"
                return _with_state(out, self._new_arrays())
            out = self._attend(queries, step.keys, step.values, mask, scale=scale)
        else:
            if step.new_only:  # handed the new tokens only; rebuild what attention reads
                k, v, _ = m.kv_slots(self._state)
                keys, values = evict.append_rows(k, step.keys), evict.append_rows(v, step.values)
            mask = _with_empty_slots(mask, self._empty_mask(), queries, keys.shape[2])
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                       mask=mask, sinks=sinks)
        self._absorb(step, queries, evaluate=False)
        self.last_step = "deferred"
        return _with_state(out, self._new_arrays())

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
        self._remember()
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
            self.mode = _choose_mode(self.method, real_queries=self.real_queries, routed=False)
        if step.new_only:
            raise RuntimeError(
                f"{self.method.key} attends through mlx-lm's scaled_dot_product_attention, "
                "but the last forward did not call it for this layer")
        self._pending = None
        if step.keys is not None:
            self._absorb(step, None)

    def _take(self, keys: mx.array, values: mx.array) -> _Step:
        """Create the state on the first tokens, advance the offset, and return the step:
        these tokens after the tail, which they take with them."""
        self._init_state(keys)
        self._offset += keys.shape[2]
        step = _Step(keys, values)
        if self._tail is not None:
            tk, tv = self._tail
            step.prefix, step.prefix_q = tk.shape[2], self._full_tail_queries()
            step.keys = mx.concatenate([tk, keys], axis=2)
            step.values = mx.concatenate([tv, values], axis=2)
            self._tail = self._tail_q = None
        return step

    def _append(self, keys: mx.array, values: mx.array) -> None:
        """Append mode: one decoded token joins the tail (the method's state is untouched)."""
        self._init_state(keys)
        self._offset += 1
        if self._tail is None:
            self._tail = (keys, values)
        else:
            tk, tv = self._tail
            self._tail = (mx.concatenate([tk, keys], axis=2), mx.concatenate([tv, values], axis=2))
        mx.async_eval(list(self._tail))

    def _init_state(self, keys: mx.array) -> None:
        if self.__dict__.get("_held") is None:
            b, h, _, d = keys.shape
            self._state = self.method.init(b, h, d, dtype=keys.dtype, backend=self.backend,
                                           **self.params)
            if self.artifact is not None:
                self._state = self.method.calibrate(self._state, self.artifact)

    def _keep_query(self, queries: mx.array) -> None:
        """Record the query of the token that just joined the tail (real-query mode)."""
        t = self._tail_len()
        if not self.real_queries:
            return
        if t == 1:
            self._tail_q = queries
        elif self._tail_q is not None and self._tail_q.shape[2] == t - 1:
            self._tail_q = mx.concatenate([self._tail_q, queries], axis=2)
        else:  # a step's query is missing: the tail is absorbed with the proxy
            self._tail_q = None
        if self._tail_q is not None:
            mx.async_eval(self._tail_q)

    def _full_tail_queries(self) -> mx.array | None:
        q = self._tail_q
        return q if q is not None and q.shape[2] == self._tail_len() else None

    def _attend(self, queries: mx.array, keys: mx.array, values: mx.array, mask, *,
                scale: float) -> mx.array:
        """The method's ``attend`` over stored + ``keys`` when ``keys`` may be longer than the
        queries (a tail before them): the queries are padded in front and the mask is causal,
        so each real query sees every stored token, the tail and the new tokens up to itself."""
        s, t = queries.shape[2], keys.shape[2]
        if t == s:
            return self.method.attend(self._state, queries, keys, values, scale=scale, mask=mask)
        b, q, _, d = queries.shape
        padded = mx.concatenate([mx.zeros((b, q, t - s, d), queries.dtype), queries], axis=2)
        out = self.method.attend(self._state, padded, keys, values, scale=scale, mask="causal")
        return out[:, :, t - s:]

    def _absorb(self, step: _Step, queries: mx.array | None, *, evaluate: bool = True) -> None:
        """The method's update of ``step``'s tokens (a tail taken along: its queries first,
        or none at all); its evaluation started here unless the caller ties the new state to
        the step's attention output (``evaluate=False``, :func:`_with_state`)."""
        keys, values = step.keys, step.values
        if step.prefix:
            queries = (None if queries is None or step.prefix_q is None
                       else mx.concatenate([step.prefix_q, queries], axis=2))
        before = self._state if self.__dict__.get("_observe") is not None else None
        m = self.method
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
            self._state, self._row = _compiled(m, "update", self._state.backend)(self._state, keys, values)
        else:
            update = _compiled(m, "update+queries", self._state.backend)
            self._state, self._row = update(self._state, keys, values, queries)
        self._observed(before, keys, values)
        if evaluate:
            mx.async_eval(self._new_arrays())

    def _new_arrays(self) -> list[mx.array]:
        """The arrays of the state and pending row an update just made."""
        return _arrays(self.__dict__["_held"]) + _arrays(self._row)

    def _pending_len(self) -> int:
        return 0 if self._pending is None else self._pending.length

    def _tail_len(self) -> int:
        return 0 if self._tail is None else int(self._tail[0].shape[2])

    def _tail_arrays(self) -> list[mx.array]:
        if self._tail is None:
            return []
        return [*self._tail] + ([] if self._tail_q is None else [self._tail_q])

    def _steady(self, keys: mx.array) -> bool:
        """A single-token step at a full bounded cache: shapes repeat, so compiling pays."""
        m = self.method
        if (not self.compile or keys.shape[2] != 1 or self._state.backend == "reference"
                or m.layer_update is not None):
            return False
        rows = self.__dict__.get("_steady_rows", False)
        if rows is False:  # the rows of a full state, or None: the parameters never change
            rows = self.__dict__["_steady_rows"] = steady_rows(m, self._full_params)
        return rows is not None and self._slot_count() == rows

    def _fills(self, step: _Step) -> bool:
        """Whether a single-token step of a state that is not at a steady size (a
        prefill-bounded method's decode steps) goes into an empty slot by the backend's
        ``fill``: then the fill step runs in :meth:`attention` (``step.filled``, the state
        after it). Steady states (amortized eviction) decide it there; ``compile=False`` keeps
        the plain path."""
        st, m = self._state, self.method
        if (not self.compile or step.prefix or step.keys.shape[2] != 1 or m.layer_update is not None
                or not evict.empty_slots(st)):
            return False
        fill = m.backends[st.backend].fill
        step.filled = None if fill is None else fill(st, step.keys, step.values)
        return step.filled is not None

    def _stored_count(self) -> int:
        return 0 if self._state is None else int(self.method.positions(self._state).shape[2])

    def _slot_count(self) -> int:
        return 0 if self._state is None else slot_count(self.method, self._state)

    def _stored_rows(self, wrapped: bool) -> tuple[mx.array, mx.array]:
        """The stored rows attention reads: ``kv_slots`` (storage order; attention does not
        depend on the order of the stored rows). With empty slots the wrapped attention
        masks them (:meth:`_empty_mask`); mlx-lm's own attention cannot, so it gets
        ``get_kv``'s gather of the filled slots."""
        k, v, filled = self.method.kv_slots(self._state)
        if filled is not None and not wrapped:
            k, v = self.method.get_kv(self._state)
        return k, v

    def _empty_mask(self) -> mx.array | None:
        """``kv_slots``' mask of the filled slots ``[b, h, n]`` (``None``: no empty slot)."""
        return None if self._state is None else self.method.kv_slots(self._state)[2]


# --- compiled steps: one bounded cache ------------------------------------------------

def _update_step(m: Method) -> Callable:
    return lambda s, k, v: split_update(m, s, k, v, None)


def _update_step_with_queries(m: Method) -> Callable:
    return lambda s, k, v, q: split_update(m, s, k, v, q)


def _fused_step(m: Method) -> Callable:
    """``velox.decode.split_step`` of ``m``: ``(state, queries, keys, values, scale) ->
    (out, state, row)``."""
    return lambda state, queries, keys, values, scale: split_step(m, state, queries, keys,
                                                                   values, scale)


def _fused_step_with_row(m: Method) -> Callable:
    return lambda state, row, queries, keys, values, scale: split_step_with_row(
        m, state, row, queries, keys, values, scale)


_STEP_KINDS: dict[str, Callable[[Method], Callable]] = {
    "update": _update_step, "update+queries": _update_step_with_queries, "fused": _fused_step,
    "fused+row": _fused_step_with_row}
COMPILED_STEPS_MAX = 64  # compiled functions kept (least recently used dropped first)
_COMPILED: OrderedDict[tuple[str, str, str], tuple[Method, Callable]] = OrderedDict()


def _compiled(m: Method, kind: str, backend: str) -> Callable:
    """The compiled step ``kind`` (``"update"``, ``"update+queries"``, ``"fused"``) of
    method ``m`` for states on ``backend``: built once per (method key, kind, backend), kept
    while that method object is the one registered under its key."""
    key = (m.key, kind, backend)
    hit = _COMPILED.get(key)
    if hit is None or hit[0] is not m:
        hit = _COMPILED[key] = (m, mx.compile(_STEP_KINDS[kind](m)))
        while len(_COMPILED) > COMPILED_STEPS_MAX:
            _COMPILED.popitem(last=False)
    _COMPILED.move_to_end(key)
    return hit[1]


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
    _check_decode(decode, decode_cap)
    _check_rollback(rollback)
    _check_flag("real_queries", real_queries)
    _check_flag("compile", compile)
    if not isinstance(method, str):
        raise ValueError(f"method={method!r} must be a method key (a str)")
    m = get_method(method)
    if not isinstance(backend, str):
        raise ValueError(f"backend={backend!r} must be a backend name (a str)")
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
    st = c.velox_state
    if c.method.dims is not None:
        return c.method.dims(st)
    b, h, _, d = st.keys.shape
    return b, h, d, st.keys.dtype


# --- save / load ----------------------------------------------------------------------

# File formats (``0.format``; ``format`` in version 1). Version 3's ``0.sha256`` covers the
# whole file: every metadata entry (layers, layer_params, record, user, format, and the names
# the layers give their arrays) and every array under its name. Version 2's covered the array
# data only, version 1 had none: both still load, with a UserWarning, after every other check.
_VERSION = 3
_FORMAT = f"velox-prompt-cache-{_VERSION}"
_FORMAT_V2 = "velox-prompt-cache-2"  # a checksum of the array data only; loads with a warning
_FORMAT_V1 = "velox-prompt-cache-1"  # written before the checksum; loads with a warning
_DIGEST = "0.sha256"
_MARKER = "__velox__"
_LOAD_WITH = "a velox prompt cache: load it with velox.adapters.mlxlm.load_cache(path)"


def _split(value: Any, name: str, arrays: dict[str, mx.array]) -> Any:
    """JSON-able description of a state field; arrays go to ``arrays`` under ``name``."""
    if isinstance(value, mx.array):
        arrays[name] = value
        return {"__array__": name}
    if isinstance(value, dict):
        return {"__dict__": {k: _split(v, f"{name}.{k}", arrays) for k, v in value.items()}}
    if hasattr(value, "_fields"):  # a nested record (a composed method's policy state)
        return {"__record__": {k: _split(v, f"{name}.{k}", arrays) for k, v in value._asdict().items()}}
    return value


def _save_record(record: tuple, prefix: str, arrays: dict[str, mx.array]) -> dict[str, Any]:
    return {k: _split(v, f"{prefix}.{k}", arrays) for k, v in record._asdict().items()}


def _array_bytes(x: mx.array) -> bytes:
    if x.dtype == mx.bfloat16:  # NumPy has no bfloat16: hash the same bits as uint16
        x = x.view(mx.uint16)
    return np.ascontiguousarray(np.array(x)).tobytes()


def _digest(arrays: dict[str, mx.array], meta: dict[str, str]) -> str:
    """The SHA-256 of a version-3 file: every metadata entry but the digest itself (key and
    text, in sorted key order), then every array (name, dtype, shape, bytes, in sorted name
    order), each part preceded by its length so that no two files share an encoding."""
    h = hashlib.sha256()

    def put(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    for key in sorted(meta):
        if key != _DIGEST:
            put(key.encode())
            put(str(meta[key]).encode())
    for name in sorted(arrays):
        x = arrays[name]
        put(name.encode())
        put(f"{x.dtype}|{tuple(x.shape)}".encode())
        put(_array_bytes(x))
    return h.hexdigest()


def _checksum(arrays: dict[str, mx.array]) -> str:
    """The SHA-256 of a version-2 file: every array (name, dtype, shape, bytes), in sorted
    name order; its metadata is not covered."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        x = arrays[name]
        h.update(f"{name}|{x.dtype}|{tuple(x.shape)}|".encode())
        h.update(_array_bytes(x))
    return h.hexdigest()


def _save_tail(c: VeloxCache, i: int, arrays: dict[str, mx.array]) -> dict[str, Any] | None:
    if c.tail is None:
        return None
    q = c._full_tail_queries()
    parts = {"keys": c.tail[0], "values": c.tail[1], "queries": q}
    return {k: None if x is None else _split(x, f"tail.{i}.{k}", arrays) for k, x in parts.items()}


def _save_dims(c: VeloxCache) -> dict[str, Any] | None:
    """What a layer's state says of the model it ran in (``None`` before its first token):
    checked by :func:`load_cache` against the state and against a given model."""
    if c.velox_state is None:
        return None
    b, h, d, dtype = _dims(c)
    return {"batch": int(b), "kv_heads": int(h), "head_dim": int(d), "dtype": _dtype_name(dtype)}


def _save_artifact(c: VeloxCache, i: int, arrays: dict[str, mx.array]) -> dict[str, Any] | None:
    """The cache's calibration artifact (its layer's arrays): a loaded cache installs it at
    its first token as this one would, and a state calibrated with it is checked against a
    fresh state calibrated the same way."""
    if c.artifact is None:
        return None
    return {k: _split(mx.array(np.asarray(v)), f"artifact.{i}.{k}", arrays)
            for k, v in c.artifact.items()}


def save_cache(path: str | Path, caches: list, metadata: dict[str, str] | None = None) -> None:
    """Save velox caches (every array and static field) to one ``.safetensors`` file.

    The file carries a SHA-256 of everything :func:`load_cache` reads (the metadata, and the
    array data under their names), checked at load, and is laid out so that mlx-lm's
    ``load_prompt_cache`` refuses it with a message naming :func:`load_cache`. Each layer's
    entry records its mode (``"proxy"``, ``"deferred"``), its rollback depth, the dims of its
    state (batch, kv heads, head dim, dtype: what ``load_cache(path, model)`` compares with
    the model) and its layer's calibration artifact (``make_cache(..., artifacts=)``); append
    mode's tail (keys, values, queries) is saved with its layer. A step still pending because
    its forward never reached the attention wrapper is absorbed first, with the key-as-query
    proxy, as the cache's next call would.
    """
    arrays: dict[str, mx.array] = {}
    layers = []
    shared = None
    for i, c in enumerate(caches):
        if not isinstance(c, VeloxCache):
            raise ValueError(f"layer {i} holds a {type(c).__name__}; save_cache stores velox caches only")
        c._settle()  # a step whose forward never reached the wrapper, as the next call would
        st = c.velox_state
        entry = {"method": c.method.key, "params": c.params, "backend": c.backend,
                 "layer": c.layer, "offset": c.offset, "compile": c.compile,
                 "real_queries": c.real_queries, "mode": c.mode.value,
                 "state": None if st is None else _save_record(st, str(i), arrays),
                 "decode": c.decode, "decode_cap": c.decode_cap, "tail": _save_tail(c, i, arrays),
                 "rollback": c.rollback, "dims": _save_dims(c),
                 "artifact": _save_artifact(c, i, arrays)}
        layers.append(entry)
        if c._model is not None and shared is None:
            shared = c._model
    record = None
    if shared is not None and shared.record is not None:
        record = _save_record(shared.record, "record", arrays)
    arrays[_MARKER] = mx.array([_VERSION], dtype=mx.uint8)
    mx.eval(arrays)
    fields = {"format": _FORMAT, "layers": json.dumps(layers),
              "layer_params": json.dumps(shared.layer_params if shared else None),
              "record": json.dumps(record), "user": json.dumps(metadata or {})}
    # mlx-lm's load_prompt_cache reads [metadata, class names, scalars]; its scalar loop
    # raises "Unknown type <_LOAD_WITH>" on the marker before it looks up any class.
    meta = {f"0.{k}": v for k, v in fields.items()}
    meta.update({f"1.{i}": "VeloxCache" for i in range(max(len(caches), 1))})
    meta.update({"2.0": "", "2.1.0": _MARKER, "2.1.1": _LOAD_WITH})
    meta[_DIGEST] = _digest(arrays, meta)
    mx.save_safetensors(str(path), arrays, metadata=meta)


def load_cache(path: str | Path, model=None, *,
               backend: str | None = None) -> tuple[list, dict[str, str]]:
    """Load caches saved by :func:`save_cache`: ``(caches, user_metadata)``.

    The file is checked before any cache is built, and every problem raises ``ValueError``
    naming it: the checksum (of the whole file: any change to its metadata, to an array, or
    to which array a layer names is refused), the method, its parameters (types, ranges,
    constraints), the offset, the backend, the rollback depth, each array's presence, dtype
    and shape against a fresh state of those parameters, and the arrays against each other
    (positions, stored count, ``get_kv``, one dry update). A file of a newer format is
    refused as such. Files of older formats load after the other checks, with a
    ``UserWarning``: ``velox-prompt-cache-2``, whose checksum covers the array data only,
    and ``velox-prompt-cache-1``, written before the checksum existed.

    Args:
        path: a file written by :func:`save_cache`.
        model: the mlx-lm model the caches will run in. Its layers are checked against the
            file's: their count, and each saved state's kv heads, head dim and dtype against
            the keys the model's own cache of that layer receives (a cache saved for another
            model is refused here, naming what differs). A saved deferred mode is kept only
            if its attention goes through velox's wrapper, as in :func:`make_cache`. Without
            it, each deferred cache confirms its mode at its first forward (proxy if that
            forward never calls the wrapper). A file written before modes were saved gets the
            mode make_cache would choose.
        backend: run the states on this backend (``"auto"``, ``"mlx"``, ...) rather than
            the one they were saved with. Without it, a state saved on a backend this
            machine lacks (``cuda`` on a CPU) raises ``velox.backend.BackendUnavailable``.
    Returns:
        The caches, which decode exactly as the saved ones would have (real queries, fused
        compiled decode step, backend), and the user metadata.
    """
    where = str(path)
    try:
        arrays, raw = mx.load(where, return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{where} is not a velox prompt cache: {e}") from None
    meta = _read_meta(where, raw, arrays)
    layers, layer_params, record_meta = meta["layers"], meta["layer_params"], meta["record"]
    used: set[str] = set()
    shared = None
    caches = []
    for i, entry in enumerate(layers):
        c = _load_layer(f"{where}: layer {i}", i, entry, arrays, used, backend)
        if c.method.layer_update is not None:
            if shared is None:
                shared = _Model(method=c.method, layer_params=layer_params, n_layers=len(layers))
            c._model = shared
        caches.append(c)
    if shared is not None:
        _check_layer_params(where, shared, caches)
        if record_meta is not None:
            fresh = shared.method.model_init(layer_params)
            rec = _build(f"{where}: cross-layer record", type(fresh), record_meta, arrays, used)
            # What the record learnt (e.g. reallocated budgets) differs from a fresh one.
            _compare(f"{where}: cross-layer record", rec, fresh, static_values=False)
            shared.record = rec
    elif record_meta is not None or layer_params is not None:
        raise ValueError(f"{where}: holds a cross-layer record but no layer's method uses one")
    extra = sorted(set(arrays) - used)
    if extra:
        raise ValueError(f"{where}: arrays {', '.join(extra)} belong to no layer")
    _route(where, caches, model)
    guards.install()
    if model is not None and any(c.compile and c.mode is Mode.DEFERRED for c in caches
                                 if isinstance(c, VeloxCache)):
        model_step.install(model)
    return caches, meta["user"]


def _format_version(name: Any) -> int | None:
    """N of a format name ``velox-prompt-cache-N``, else ``None``."""
    prefix = "velox-prompt-cache-"
    if isinstance(name, str) and name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return None


def _read_meta(where: str, raw: dict[str, str], arrays: dict[str, mx.array]) -> dict[str, Any]:
    """The file's velox metadata, parsed; the checksum checked (and the marker dropped)."""
    version = _format_version(raw.get("0.format", raw.get("format")))
    if version is not None and version > _VERSION:
        raise ValueError(f"{where} was saved by a newer velox format {version}; this velox "
                         f"reads up to {_VERSION} (velox-prompt-cache-{_VERSION}): load it with a "
                         "newer velox")
    if version in (2, 3) and "0.format" in raw:
        fields = {k[2:]: v for k, v in raw.items() if k.startswith("0.")}
        if "sha256" not in fields:
            raise ValueError(f"{where}: velox-prompt-cache-{version} file without its sha256 "
                             "checksum")
        if version == 3:
            digest, covers = _digest(arrays, raw), "metadata or array data"
        else:
            digest, covers = _checksum(arrays), "array data"
        if digest != fields["sha256"]:
            raise ValueError(f"{where}: the {covers} do not match the sha256 checksum written at "
                             f"save ({fields['sha256'][:16]}... recorded, {digest[:16]}... read): "
                             "the file was changed or is corrupted")
        if _MARKER not in arrays:
            raise ValueError(f"{where}: the {_MARKER} array is missing")
        del arrays[_MARKER]
        if version == 2:
            warnings.warn(f"{where} was saved by velox format 2 (velox-prompt-cache-2), whose "
                          "checksum covers the array data only: its metadata (methods, "
                          "parameters, modes, which arrays each layer holds) cannot be "
                          "verified; save it again to cover them", UserWarning, stacklevel=3)
    elif version == 1 and raw.get("format") == _FORMAT_V1:
        fields = dict(raw)
        warnings.warn(f"{where} was written before velox prompt caches carried a checksum: its "
                      "array data cannot be verified (save it again to add one)", UserWarning,
                      stacklevel=3)
    else:
        hint = (" (it looks like mlx-lm's own prompt cache: load it with "
                "mlx_lm.models.cache.load_prompt_cache)" if any(k.startswith("1.") for k in raw) else "")
        raise ValueError(f"{where} is not a velox prompt cache{hint}")
    out: dict[str, Any] = {}
    for name, kind in (("layers", list), ("layer_params", (list, type(None))),
                       ("record", (dict, type(None))), ("user", dict)):
        try:
            out[name] = json.loads(fields[name])
        except KeyError:
            raise ValueError(f"{where}: the metadata lacks {name!r}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: the metadata {name!r} is not valid JSON ({e})") from None
        if not isinstance(out[name], kind):
            raise ValueError(f"{where}: the metadata {name!r} is a {type(out[name]).__name__}")
    return out


_ENTRY = {"method": str, "params": dict, "backend": str, "layer": int, "offset": int,
          "compile": bool, "real_queries": bool, "state": (dict, type(None))}
# Written since decode modes exist; files without all three load as decode="evict".
_DECODE_ENTRY = {"decode": str, "decode_cap": int, "tail": (dict, type(None))}
# Written since modes are explicit; a file without it gets the mode make_cache would choose
# (deferred for a method that wants queries), checked against the model as any mode is.
_MODE_ENTRY = {"mode": str}
# Written since rollback exists (the depth, not the journal); a file without it loads with 0.
_ROLLBACK_ENTRY = {"rollback": int}
# Written since format 3: the state's dims (compared with a given model) and the layer's
# calibration artifact; a file without them loads as before (the dims are read off the state).
_V3_ENTRY = {"dims": (dict, type(None)), "artifact": (dict, type(None))}


def _load_layer(where: str, i: int, entry: Any, arrays: dict[str, mx.array], used: set[str],
                backend: str | None) -> VeloxCache:
    fields = dict(_ENTRY)
    if isinstance(entry, dict) and set(_DECODE_ENTRY) & set(entry):
        fields.update(_DECODE_ENTRY)
    if isinstance(entry, dict) and "mode" in entry:
        fields.update(_MODE_ENTRY)
    if isinstance(entry, dict) and "rollback" in entry:
        fields.update(_ROLLBACK_ENTRY)
    if isinstance(entry, dict):
        fields.update({k: v for k, v in _V3_ENTRY.items() if k in entry})
    if not isinstance(entry, dict) or set(entry) != set(fields):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{where}: the entry must have the fields {', '.join(_ENTRY)} (and "
                         f"{', '.join(_DECODE_ENTRY)} together; mode, rollback, dims and "
                         f"artifact optional); got {got}")
    for name, kind in fields.items():
        value = entry[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}: {name}={value!r} is not a {getattr(kind, '__name__', kind)}")
    if entry["layer"] != i:
        raise ValueError(f"{where}: the entry says layer {entry['layer']}")
    offset = entry["offset"]
    if offset < 0:
        raise ValueError(f"{where}: offset={offset} is negative")
    decode = dict(decode=entry.get("decode", "evict"), decode_cap=entry.get("decode_cap", DECODE_CAP))
    desc, tail = entry["state"], entry.get("tail")
    artifact = _load_artifact(where, entry.get("artifact"), arrays, used)
    try:
        m = get_method(entry["method"])
        mode = (entry["mode"] if "mode" in entry  # else as make_cache would, checked later
                else _choose_mode(m, real_queries=entry["real_queries"], routed=True))
        c = VeloxCache(entry["method"], entry["params"], backend=backend or entry["backend"],
                       layer=i, compile=entry["compile"], real_queries=entry["real_queries"],
                       mode=mode, rollback=entry.get("rollback", 0), artifact=artifact, **decode)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if tail is not None and c.decode != "append":
        raise ValueError(f"{where}: decode={c.decode!r} but the entry holds an append-mode tail")
    if desc is None:
        if offset != 0:
            raise ValueError(f"{where}: offset={offset} but the cache holds no state")
        if tail is not None:
            raise ValueError(f"{where}: a tail but no state")
        if entry.get("dims") is not None:
            raise ValueError(f"{where}: dims {entry['dims']} but the cache holds no state")
        if c.backend != "auto":
            _resolve(where, c.backend, m, saved=backend is None)
        return c
    saved = desc.get("backend")
    if not isinstance(saved, str):
        raise ValueError(f"{where}: the state records no backend")
    run_on = _resolve(where, backend or saved, m, saved=backend is None)
    desc = _with_backend(desc, run_on)
    if (isinstance(desc, dict) and "empty" not in desc and "empty" in getattr(m.state_type, "_fields", ())
            and "slack" not in m.spec.params):
        # saved before the method's state held empty slots (the grown decode slots of SnapKV,
        # PyramidKV and NestedKV): every slot filled, which _check_state checks against the
        # positions
        desc = {**desc, "empty": 0}
    st = _build(where, m.state_type, desc, arrays, used)
    tk = tv = tq = None
    if tail is not None:
        tk, tv, tq = _load_tail(where, tail, arrays, used, st, m, c.decode_cap, offset)
    t = 0 if tk is None else tk.shape[2]
    _check_state(where, m, st, entry["params"], offset, t, artifact)
    c._state, c._offset = st, offset
    if tk is not None:
        c._tail, c._tail_q = (tk, tv), tq
    if "dims" in entry and entry["dims"] != _save_dims(c):
        raise ValueError(f"{where}: dims {entry['dims']}, but the state holds {_save_dims(c)}")
    return c


def _load_artifact(where: str, desc: dict | None, arrays: dict[str, mx.array],
                   used: set[str]) -> dict[str, np.ndarray] | None:
    """A saved calibration artifact: its arrays by name."""
    if desc is None:
        return None
    out = {}
    for name, d in desc.items():
        if not (isinstance(d, dict) and set(d) == {"__array__"} and d["__array__"] in arrays):
            raise ValueError(f"{where}: artifact {name} {d!r} names no array of the file")
        used.add(d["__array__"])
        out[name] = np.array(arrays[d["__array__"]])
    return out


def _load_tail(where: str, tail: dict, arrays: dict[str, mx.array], used: set[str], st: tuple,
               m: Method, cap: int, offset: int) -> tuple[mx.array, mx.array, mx.array | None]:
    """The tail's arrays, checked against the state's dims, the cap and the offset."""
    if set(tail) != {"keys", "values", "queries"}:
        raise ValueError(f"{where}: the tail must have the fields keys, values, queries; "
                         f"got {sorted(tail)}")
    got = {}
    for name, d in tail.items():
        if d is None and name == "queries":
            got[name] = None
            continue
        if not (isinstance(d, dict) and set(d) == {"__array__"} and d["__array__"] in arrays):
            raise ValueError(f"{where}: tail {name} {d!r} names no array of the file")
        used.add(d["__array__"])
        got[name] = arrays[d["__array__"]]
    try:
        b, h, d, dtype = m.dims(st) if m.dims is not None else (*st.keys.shape[:2], st.keys.shape[3],
                                                               st.keys.dtype)
    except Exception as e:
        raise ValueError(f"{where}: cannot read the state's dims ({type(e).__name__}: {e})") from None
    k, v, q = got["keys"], got["values"], got["queries"]
    t = k.shape[2] if k.ndim == 4 else -1
    for name, x in (("keys", k), ("values", v)):
        if tuple(x.shape) != (b, h, t, d) or x.dtype != dtype:
            raise ValueError(f"{where}: tail {name} is {_dtype_name(x.dtype)} {tuple(x.shape)}; "
                             f"the state holds {_dtype_name(dtype)} ({b}, {h}, t, {d})")
    if not 1 <= t < cap:
        raise ValueError(f"{where}: the tail holds {t} tokens; decode_cap={cap} keeps 1 to {cap - 1}")
    if t > offset:
        raise ValueError(f"{where}: the tail holds {t} tokens, more than offset={offset}")
    if q is not None and (q.ndim != 4 or q.shape[0] != b or q.shape[1] % h or q.shape[2:] != (t, d)
                          or q.dtype != dtype):
        raise ValueError(f"{where}: tail queries are {_dtype_name(q.dtype)} {tuple(q.shape)}; "
                         f"expected {_dtype_name(dtype)} ({b}, a multiple of {h}, {t}, {d})")
    return k, v, q


def _resolve(where: str, name: str, m: Method, *, saved: bool) -> str:
    try:
        return resolve_backend(name, m.key, m.backends)
    except BackendUnavailable as e:
        hint = "; load_cache(path, backend='mlx') runs it on MLX instead" if saved else ""
        raise BackendUnavailable(f"{where}: {e}{hint}") from None


def _with_backend(desc: Any, backend: str) -> Any:
    """``desc`` with every static ``backend`` field (nested records included) set to ``backend``."""
    if isinstance(desc, dict) and "__dict__" in desc:
        return {"__dict__": _with_backend(desc["__dict__"], backend)}
    if isinstance(desc, dict) and "__array__" not in desc:
        return {k: (backend if k == "backend" and isinstance(v, str) else _with_backend(v, backend))
                for k, v in desc.items()}
    return desc


def _build(where: str, record_type: type, desc: dict, arrays: dict[str, mx.array],
           used: set[str]) -> tuple:
    fields = set(record_type._fields)
    missing, extra = sorted(fields - set(desc)), sorted(set(desc) - fields)
    if missing or extra:
        raise ValueError(f"{where}: {record_type.__name__} fields missing: {', '.join(missing) or '-'}; "
                         f"unknown: {', '.join(extra) or '-'}")

    def join(d: Any, name: str, kind: Any = None) -> Any:
        if isinstance(d, dict) and "__array__" in d:
            key = d["__array__"]
            if key not in arrays:
                raise ValueError(f"{where}: array {key!r} ({name}) is missing from the file")
            used.add(key)
            return arrays[key]
        nested = hasattr(kind, "_fields")  # the field holds a record
        if isinstance(d, dict) and ("__record__" in d or "__dict__" in d) and nested:
            # (files saved before nested records were: the record's fields as a dict)
            return _build(f"{where}: {name}", kind, d.get("__record__", d.get("__dict__")), arrays, used)
        if isinstance(d, dict) and "__dict__" in d:
            return {k: join(v, f"{name}.{k}") for k, v in d["__dict__"].items()}
        if isinstance(d, dict):
            raise ValueError(f"{where}: {name} is an unknown description {d!r}")
        return tuple(d) if isinstance(d, list) else d

    kinds = getattr(record_type, "__annotations__", {})
    return record_type(**{k: join(v, k, kinds.get(k)) for k, v in desc.items()})


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def _leaves(record: tuple) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(name: str, v: Any) -> None:
        if hasattr(v, "_fields"):
            v = v._asdict()
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{name}.{k}", x)
        else:
            out[name] = v

    for k, v in record._asdict().items():
        walk(k, v)
    return out


def _compare(where: str, stored: tuple, fresh: tuple, *, static_values: bool = True) -> None:
    """Same fields, same static values (or types only), arrays of the same dtype and rank
    whose shapes match on every axis a fresh (empty) record already fixes."""
    a, b = _leaves(stored), _leaves(fresh)
    if set(a) != set(b):
        raise ValueError(f"{where}: fields {sorted(set(a) ^ set(b))} do not match the method's record")
    for name, f in b.items():
        s = a[name]
        if isinstance(f, mx.array) or isinstance(s, mx.array):
            if not (isinstance(f, mx.array) and isinstance(s, mx.array)):
                raise ValueError(f"{where}: {name} must be an array")
            want = "(" + ", ".join(str(n) if n else "*" for n in f.shape) + ")"
            if s.dtype != f.dtype:
                raise ValueError(f"{where}: array {name} is {_dtype_name(s.dtype)}, the method "
                                 f"holds {_dtype_name(f.dtype)}")
            if s.ndim != f.ndim or any(n and n != m for n, m in zip(f.shape, s.shape)):
                raise ValueError(f"{where}: array {name} has shape {tuple(s.shape)}, expected {want}")
        elif type(s) is not type(f) or (static_values and s != f and name.rsplit(".", 1)[-1] != "empty"):
            # (``empty`` counts a state's empty slots, not a parameter: _check_slots checks it)
            raise ValueError(f"{where}: {name}={s!r} in the state, but its parameters give {f!r}")


def _check_slots(where: str, m: Method, st: tuple, b: int, h: int, d: int) -> None:
    """A state of slots (``velox.evict``): its stored arrays agree with its slot positions,
    which hold each token once and exactly ``empty`` empty slots (-1) per row, the last ones."""
    keys, values = st.keys, st.values
    raw = st.positions
    n = raw.shape[-1]
    if tuple(raw.shape) != (b, h, n) or {tuple(keys.shape), tuple(values.shape)} != {(b, h, n, d)}:
        raise ValueError(f"{where}: the state's arrays disagree with each other: slot positions "
                         f"{tuple(raw.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    p = np.sort(np.array(raw), axis=-1)
    empty = getattr(st, "empty", 0)
    if not isinstance(empty, int) or not 0 <= empty <= n:
        raise ValueError(f"{where}: empty={empty!r} must count the state's empty slots (0 to {n})")
    if (p[..., :empty] != -1).any() or (p[..., empty:] < 0).any():
        raise ValueError(f"{where}: each row must hold empty={empty} empty slots (position -1)")
    if empty and (np.array(raw[..., n - empty:]) != -1).any():
        raise ValueError(f"{where}: the empty slots must be the last {empty} of each row "
                         "(velox.evict: amortized eviction keeps them last)")
    if (np.diff(p[..., empty:], axis=-1) == 0).any():
        raise ValueError(f"{where}: stored positions must be unique (a token in two slots)")


def _check_state(where: str, m: Method, st: tuple, params: dict[str, Any], offset: int,
                 tail: int = 0, artifact: dict[str, np.ndarray] | None = None) -> None:
    """Parameters, dims, arrays and offset of a loaded state, against each other (the state
    has seen ``offset - tail`` tokens: the append-mode tail holds the rest), and against a
    fresh state of its parameters (calibrated with ``artifact`` when the cache has one)."""
    said = f"offset={offset}" + (f" less the tail's {tail}" if tail else "")
    offset -= tail
    try:
        b, h, d, dtype = m.dims(st) if m.dims is not None else (*st.keys.shape[:2], st.keys.shape[3],
                                                               st.keys.dtype)
    except Exception as e:
        raise ValueError(f"{where}: cannot read the state's dims ({type(e).__name__}: {e})") from None
    if m.layer_update is not None:  # the cross-layer record may reset a layer's parameters
        params = {**params, **{k: getattr(st, k) for k in m.spec.params if k in st._fields}}
    try:
        full = validate_params(m.spec, params, dims=dict(batch=b, kv_heads=h, head_dim=d))
        fresh = m.init(b, h, d, dtype=dtype, backend=st.backend, **params)
        if artifact is not None:
            fresh = m.calibrate(fresh, artifact)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    _compare(where, st, fresh)
    if "next_pos" in st._fields and not bool(mx.all(st.next_pos == offset)):
        raise ValueError(f"{where}: {said} but the state has seen "
                         f"{sorted(set(np.array(st.next_pos).ravel().tolist()))} tokens")
    try:
        pos = m.positions(st)
        keys, values = m.get_kv(st)
        one = mx.zeros((b, h, 1, d), dtype)
        later = m.update(st, one, one)  # lazy: shapes only, nothing is computed
        m.get_kv(later), m.positions(later)
    except Exception as e:
        raise ValueError(f"{where}: the state's arrays disagree with each other "
                         f"({type(e).__name__}: {e})") from None
    n = pos.shape[-1] if pos.ndim == 3 else -1
    if tuple(pos.shape) != (b, h, n) or not {tuple(keys.shape), tuple(values.shape)} == {(b, h, n, d)}:
        raise ValueError(f"{where}: the state's arrays disagree with each other: positions "
                         f"{tuple(pos.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    if "mlx" in m.backends and m.backends["mlx"].slots:
        _check_slots(where, m, st, b, h, d)
    p = np.array(pos)
    if p.size and (p.min() < 0 or p.max() >= offset or (np.diff(p, axis=-1) <= 0).any()):
        bound = f"{offset}) ({said})" if tail else f"offset={offset})"
        raise ValueError(f"{where}: stored positions must increase within [0, {bound}")
    cap = m.spec.capacity(full)
    phase = m.spec.contract.get("bound_phase", "all")
    slack = decode_slack(m, full)
    low, high = (offset, offset) if cap is None else (
        (min(cap, offset), offset) if phase == "prefill" else (min(cap, offset), min(cap + slack, offset)))
    if not low <= n <= high:
        want = f"{low}" if low == high else f"{low} to {high}"
        raise ValueError(f"{where}: the state holds {n} tokens; after {offset} its parameters keep "
                         f"{want}" + (f" ({said})" if tail else ""))


def _check_layer_params(where: str, shared: _Model, caches: list) -> None:
    lp = shared.layer_params
    mine = [c for c in caches if c._model is shared]
    if not isinstance(lp, list) or len(lp) != len(mine) or len(mine) != len(caches):
        raise ValueError(f"{where}: the cross-layer parameters do not cover the {len(caches)} layers")
    for c in mine:
        if lp[c.layer] != c.params:
            raise ValueError(f"{where}: layer {c.layer}'s parameters {c.params} differ from the "
                             f"cross-layer record's {lp[c.layer]}")


def _model_dims(model) -> list[tuple[int, int, str] | None] | None:
    """``(kv_heads, head_dim, dtype)`` of the keys each layer's own cache receives from
    ``model`` (``None`` for a layer without a plain ``KVCache``), read from one token's forward
    over the model's default caches. MLX is lazy: the forward is only built, never computed
    (shapes and dtypes are known without it). ``None`` when the model does not run on one
    token."""
    base = default_layout(model)
    try:
        with untapped():  # an open query_capture() body records none of the probe's queries
            model(mx.zeros((1, 1), mx.int32), cache=base)
    except Exception:
        return None
    out = []
    for c in base:
        k = getattr(c, "keys", None) if type(c) is KVCache else None
        out.append(None if not isinstance(k, mx.array) or k.ndim != 4
                   else (int(k.shape[1]), int(k.shape[3]), _dtype_name(k.dtype)))
    return out


def _check_model_dims(where: str, caches: list, model) -> None:
    """Refuse caches whose states were made for another model: each layer's kv heads, head dim
    and dtype against the keys ``model`` gives that layer's cache."""
    probe = _model_dims(model)
    if probe is None:
        return
    for c, want in zip(caches, probe):
        if want is None or c.velox_state is None:
            continue
        _, h, d, dtype = _dims(c)
        got = (int(h), int(d), _dtype_name(dtype))
        diff = [f"{name} {g} (the model's: {w})"
                for name, g, w in zip(("kv_heads", "head_dim", "dtype"), got, want) if g != w]
        if diff:
            raise ValueError(f"{where}: layer {c.layer} was saved for another model: it holds "
                             f"{', '.join(diff)}; {type(model).__name__} gives its layer "
                             f"{c.layer} keys of kv_heads={want[0]}, head_dim={want[1]}, "
                             f"dtype={want[2]}")


def _route(where: str, caches: list, model) -> None:
    """Confirm the loaded caches' modes: a deferred cache stays deferred where the model's
    attention calls the wrapper (which is installed), and runs as proxy where it does not
    (a method with ``attend`` refuses such a model); without the model, each deferred cache
    confirms its mode at its first forward (``VeloxCache._settle``)."""
    if any(c.mode is Mode.DEFERRED for c in caches):
        install_query_capture()
    if model is None:
        for c in caches:
            c._route_unknown = c.mode is Mode.DEFERRED
        return
    base = default_layout(model)
    slots = [c for c in base if type(c) is KVCache]
    if len(slots) != len(base) or len(base) != len(caches):
        raise ValueError(f"{where} holds {len(caches)} velox layers; {type(model).__name__} has "
                         f"{len(slots)} plain KV layers of {len(base)}")
    _check_model_dims(where, caches, model)
    routed = _routes_attention(model)
    for c in caches:
        c._routed = routed
        if c.mode is Mode.DEFERRED:
            c.mode = _choose_mode(c.method, real_queries=c.real_queries, routed=routed,
                                  model=type(model).__name__)


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
