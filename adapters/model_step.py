"""The whole model's decode step, compiled once: ``(token, states) -> (logits, states)``.

mlx-lm runs a decode step as the model's forward, layer by layer, each layer's cache called
from Python (``update_and_fetch``, then attention). At batch 1 that host work, not the device,
bounds the speed of a small cache. A velox cache whose state is *steady* (a bounded method
at its full size: every single-token step keeps every array's shape,
``velox.decode.steady_rows``) needs none of it: its step is a pure function of arrays
(``velox.decode.split_step``), so the forward of every layer with its step can be traced
once and compiled as one function of the token, the RoPE offset (an array) and the states.
Each later step is one call, with no retrace.

How it plugs into mlx-lm: :func:`install` (``make_cache`` calls it, unless ``compile=False``)
wraps the model class's ``__call__``. A call takes the compiled step when it is a single-token
step (``inputs [b, 1]``, nothing but ``cache=`` given) and every layer's cache offers a
steady state (:meth:`SteppedCache.steady_state`); any other call, and every call with other
caches (mlx-lm's own), runs the original ``__call__`` unchanged. So ``mlx_lm.generate``,
``stream_generate``, ``generate_step`` and ``velox serve`` use it with no change to the
caller, and the tokens are those of the layer-by-layer path (``tests/test_model_step.py``).

Inside the trace each layer's cache is a :class:`StepShell`: ``update_and_fetch`` hands the
new rows back, and the wrapped attention (``velox.adapters.mlxlm``'s, which routes any
:class:`Attends` cache to its ``attention``) runs ``split_step`` over the shell's state: the
pending row of the last step written first (in place: the caller lets go of the old state),
attention with the method's scores from its weights, the update, the new row left for the
next step. Each layer's output is made to depend on its new state (``velox.decode.with_state``),
so mlx-lm's one evaluation of the logits computes every state.

A cross-layer method's model-level record (:meth:`SteppedCache.record_step`) is one more
input and output: the layers' shells thread it through their ``layer_update`` in order
inside the trace (``velox.decode.record_form`` says which of their states are steady).

The model's weights are constants of the compiled function (a model whose weights change
after its first compiled step needs :func:`reset`).
"""

from __future__ import annotations

import abc
import weakref
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from velox.decode import arrays, attend, split_step, split_step_with_row, with_state
from velox.registry import Method

__all__ = ["Attends", "SteppedCache", "StepShell", "install", "uninstall", "reset",
           "compiled_steps", "decode_steps"]


class Attends(_BaseCache, metaclass=abc.ABCMeta):
    """A cache whose layer's attention velox's wrapper of mlx-lm's attention hands to its
    ``attention``."""

    @abc.abstractmethod
    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                  mask, sinks=None) -> mx.array:
        """This layer's attention output for ``queries`` over what the cache holds and the
        step's ``keys``/``values`` (what ``update_and_fetch`` handed out)."""


class SteppedCache(Attends):
    """A cache that can hand its state to the compiled whole-model step and take the result."""

    @abc.abstractmethod
    def steady_state(self) -> tuple[Method, Any, Any, int] | None:
        """``(method, state, pending row, offset)`` where the next single-token step may run
        compiled with the whole model, else ``None``."""

    @abc.abstractmethod
    def stepped(self, state, row) -> None:
        """Take the state and pending row a compiled step left (one token more)."""

    def record_step(self) -> tuple[Any, int] | None:
        """A cross-layer method's ``(holder, layer)``: the object whose ``record`` attribute
        holds the model-level record this layer's update threads (every layer of the model
        the same one; ``holder.keep(record)`` takes the new one), and the layer's index;
        ``None`` for a method without a record."""
        return None


class StepShell(Attends):
    """One layer's cache inside the traced whole-model step: its state, pending row and the
    offset (an array); after the forward, ``new`` holds ``(state, row)``."""

    def __init__(self, method: Method, state, row, offset: mx.array, record: "_Box | None" = None,
                 index: int = 0):
        self.method, self.held, self.row, self._offset = method, state, row, offset
        self.record, self.index = record, index
        self.new: tuple | None = None

    @property
    def offset(self) -> mx.array:  # the RoPE offset: an array, so no retrace per step
        return self._offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values  # the attention wrapper takes the step

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None  # one query: it sees every stored row and itself

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                  mask, sinks=None) -> mx.array:
        if sinks is not None or mask is not None or queries.shape[2] != 1:
            raise ValueError("the compiled decode step takes one token, no mask and no "
                             "attention sinks")
        if self.record is not None:  # a cross-layer method: attention, then layer_update
            out = attend(self.method, self.held, queries, keys, values, scale=scale)
            self.record.value, new = self.method.layer_update(
                self.record.value, self.index, self.held, keys, values, queries=queries)
            self.new = (new, None)
            return with_state(out, arrays(new) + arrays(self.record.value))
        if self.row is None:
            out, new, row = split_step(self.method, self.held, queries, keys, values, scale)
        else:
            out, new, row = split_step_with_row(self.method, self.held, self.row, queries, keys,
                                                values, scale)
        self.new = (new, row)
        return with_state(out, arrays(new) + arrays(row))


# --- the model hook -------------------------------------------------------------------

_ORIGINAL_CALL: dict[type, Callable] = {}
# per model (by id, with a weak reference to tell a reused id): compiled steps by the layers'
# (method, backend, row present), how many times each was traced, and the single-token
# calls on velox caches by how they ran (:func:`decode_steps`)
_STEPS: dict[int, tuple[weakref.ref, dict[tuple, Callable], dict[tuple, int], dict[str, int]]] = {}


def install(model) -> None:
    """Wrap ``type(model).__call__`` so that single-token calls on steady velox caches run the
    compiled whole-model step (idempotent; other calls run the original unchanged)."""
    cls = type(model)
    if cls in _ORIGINAL_CALL or not callable(getattr(cls, "__call__", None)):
        return
    original = cls.__call__

    def __call__(self, *args, **kwargs):
        out = _compiled_call(self, original, args, kwargs)
        return original(self, *args, **kwargs) if out is None else out

    __call__.__doc__ = original.__doc__
    __call__.__wrapped__ = original
    _ORIGINAL_CALL[cls] = original
    cls.__call__ = __call__


def uninstall(model_or_class) -> None:
    """Restore the original ``__call__`` of a model class :func:`install` wrapped."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    original = _ORIGINAL_CALL.pop(cls, None)
    if original is not None:
        cls.__call__ = original


def reset(model) -> None:
    """Drop the compiled steps of ``model`` (after its weights changed)."""
    _STEPS.pop(id(model), None)


def compiled_steps(model) -> dict[tuple, int]:
    """How many times each compiled step of ``model`` was traced (one entry per layout of
    methods; a step retraced per token would count up with the tokens)."""
    hit = _STEPS.get(id(model))
    return {} if hit is None or hit[0]() is not model else dict(hit[2])


def decode_steps(model) -> dict[str, int]:
    """How ``model``'s single-token calls on velox caches ran since its first (or since
    :func:`reset`): ``compiled`` (the whole model's compiled step) and ``layer_by_layer``
    (a state not steady yet, or not steady at all: ``velox.decode.not_steady_because``)."""
    hit = _STEPS.get(id(model))
    counts = {} if hit is None or hit[0]() is not model else hit[3]
    return {"compiled": counts.get("compiled", 0), "layer_by_layer": counts.get("layer_by_layer", 0)}


def _steps(model) -> tuple[dict[tuple, Callable], dict[tuple, int], dict[str, int]]:
    hit = _STEPS.get(id(model))
    if hit is None or hit[0]() is not model:
        hit = _STEPS[id(model)] = (weakref.ref(model), {}, {}, {})
        # the compiled steps hold the model weakly and go with it (their traces hold its
        # weights as constants)
        weakref.finalize(model, _drop, id(model), hit[0])
    return hit[1], hit[2], hit[3]


def _drop(key: int, ref: weakref.ref) -> None:
    if _STEPS.get(key, (None,))[0] is ref:
        del _STEPS[key]


def _compiled_call(model, original: Callable, args: tuple, kwargs: dict) -> mx.array | None:
    """The logits of the compiled whole-model step, or ``None`` where it does not apply."""
    if len(args) != 1 or kwargs.get("input_embeddings") is not None:
        return None
    caches = kwargs.get("cache")
    inputs = args[0]
    if (not isinstance(caches, (list, tuple)) or not caches or set(kwargs) - {"cache", "input_embeddings"}
            or not isinstance(inputs, mx.array) or inputs.ndim != 2 or inputs.shape[1] != 1):
        return None
    if not isinstance(caches[0], SteppedCache):
        return None  # mlx-lm's own caches
    fns, traces, counts = _steps(model)
    layers = []
    for c in caches:
        got = c.steady_state() if isinstance(c, SteppedCache) else None
        if got is None:
            break
        layers.append(got)
    if len(layers) < len(caches) or any(x[3] != layers[0][3] for x in layers):
        counts["layer_by_layer"] = counts.get("layer_by_layer", 0) + 1
        return None
    steps = [c.record_step() for c in caches]
    holders = {id(x[0]) for x in steps if x is not None}
    if len(holders) > 1 or (holders and any(x is None for x in steps)):
        counts["layer_by_layer"] = counts.get("layer_by_layer", 0) + 1
        return None  # one model-level record, threaded through every layer, or none
    counts["compiled"] = counts.get("compiled", 0) + 1
    offset = layers[0][3]
    indices = None if not holders else tuple(x[1] for x in steps)
    key = (tuple((m.key, st.backend, row is None) for m, st, row, _ in layers), indices)
    fn = fns.get(key)
    if fn is None:
        fn = fns[key] = mx.compile(_step_function(model, original, [x[0] for x in layers], key,
                                                  traces, indices))
    record = None if not holders else steps[0][0].record
    if inputs.dtype != mx.uint32 and not mx.issubdtype(inputs.dtype, mx.floating):
        inputs = inputs.astype(mx.uint32)  # the sampler's dtype: a prompt's int32 last token
        # would trace the step a second time
    logits, news, record = fn(inputs, mx.array(offset, dtype=mx.int32),
                              [x[1] for x in layers], [x[2] for x in layers], record)
    if holders:
        steps[0][0].keep(record)
    for c, (state, row) in zip(caches, news):
        c.stepped(state, row)
    return logits


class _Box:
    """The model-level record while the compiled step is traced: each layer's shell reads it
    and leaves the one its ``layer_update`` returns, in layer order."""

    def __init__(self, value):
        self.value = value


def _step_function(model, original: Callable, methods: list[Method], key: tuple,
                   traces: dict[tuple, int], indices: tuple[int, ...] | None) -> Callable:
    ref = weakref.ref(model)

    def step(inputs, offset, states, rows, record):
        traces[key] = traces.get(key, 0) + 1  # runs only while tracing
        box = None if indices is None else _Box(record)
        shells = [StepShell(m, s, r, offset, box, 0 if indices is None else indices[i])
                  for i, (m, s, r) in enumerate(zip(methods, states, rows))]
        logits = original(ref(), inputs, cache=shells)
        return logits, [sh.new for sh in shells], None if box is None else box.value
    return step
