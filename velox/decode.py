"""The decode step, as pure functions of a method's state: attention of a step's queries over
what the state holds and the step's new rows, and the method's update with those queries.

``step(m, state, queries, keys, values, scale=...) -> (out, state)`` is one step of any
method (a generic one: attention over the stored rows, or the method's own ``attend`` over
its codes, then ``update``; a steady single-token step takes the fused path below).
:func:`split_step` is the fused form a decode loop runs: the output from the weights the
method scores by (or the backend's kernel), the update, and the new row's slot write left
for the next step (``(out, state, row)``, :func:`write_row`), so that MLX writes one row in
place instead of copying the cache. Nothing here holds state; the mlx-lm adapter calls these
functions layer by layer (``velox.adapters.mlxlm``) or for a whole model at once, compiled
(``velox.adapters.model_step``). The design and its measurements: ``docs/design/decode.md``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import mlx.core as mx

from . import evict
from .attention import candidate_weights, scoring_queries
from .registry import Method
from .spec import validate_params

__all__ = ["step", "StepInfo", "step_info", "attend", "split_step", "split_step_with_row", "split_update", "write_row",
           "weights_attention", "attended_step", "with_empty_slots", "with_state", "arrays",
           "steady_rows", "slot_count", "slack", "not_steady_because", "chunked", "steady_room",
           "steady_form", "layer_step", "fill_output", "compiled", "steady_token", "fill_token",
           "compiled_form", "COMPILED_STEPS_MAX"]


class StepInfo(NamedTuple):
    """What one step did, beside its state (``step(..., info=True)``; arrays are lazy, so an
    info nobody reads costs nothing to evaluate, and ``info=False``, the default, builds none).

    ``stored [b, h]``: tokens the state holds after the step; ``evicted [b, h]``: tokens it
    dropped in this step (held before, plus the step's, less held after); ``nbytes``: the
    state's bytes after the step; ``key_error`` / ``value_error [b, h]``: the largest
    absolute difference between the step's rows as given and as the state returns them
    (``get_kv``), over the step's tokens it still holds (0 where it holds none, or holds them
    exactly): the quantization error a quantizer's observer reports."""

    stored: mx.array
    evicted: mx.array
    nbytes: int
    key_error: mx.array
    value_error: mx.array


def step_info(m: Method, before, after, keys: mx.array, values: mx.array) -> StepInfo:
    """:class:`StepInfo` of a step of ``m`` from ``before`` to ``after`` taking ``keys`` and
    ``values [b, h, s, d]`` (the step's tokens are the ``s`` positions after ``before``'s)."""
    held = lambda st: (m.positions(st) >= 0).sum(axis=-1)  # noqa: E731
    stored = held(after)
    evicted = held(before) + keys.shape[2] - stored
    pos = m.positions(after)  # [b, h, n]: the rows get_kv returns, in order
    k, v = m.get_kv(after)
    s = keys.shape[2]
    if pos.shape[-1] == 0:
        zero = mx.zeros(stored.shape, mx.float32)
        return StepInfo(stored, evicted, m.nbytes(after), zero, zero)
    idx = pos - before.next_pos[..., None]  # the row's index among the step's tokens, if one
    mine = (idx >= 0) & (idx < s)
    take = mx.clip(idx, 0, s - 1)[..., None]
    errs = []
    for got, given in ((k, keys), (v, values)):
        want = mx.take_along_axis(given.astype(mx.float32), take, axis=2)
        diff = mx.abs(got.astype(mx.float32) - want).max(axis=-1)
        errs.append(mx.where(mine, diff, 0.0).max(axis=-1))
    return StepInfo(stored, evicted, m.nbytes(after), *errs)


def step(m: Method, state, queries: mx.array, keys: mx.array, values: mx.array, *,
         scale: float, mask=None, steady: bool = False, info: bool = False):
    """One step of method ``m``: the attention of ``queries [b, hq, s, d]`` over what ``state``
    holds and the step's ``keys``/``values [b, h, s, d]`` (each query sees every stored row
    and the new rows up to its own, or as ``mask`` says), then ``m.update`` of the new rows
    with those queries: ``(out, state)``.

    ``steady=True`` (a single token at a full bounded state, or a single token of chunked
    storage, the steps a decode loop compiles) takes :func:`split_step` with its row written at once: the same result (the
    contract suite holds both to attention-then-update). ``info=True`` returns
    ``(out, state, info)`` with the step's :class:`StepInfo`."""
    if steady:
        if queries.shape[2] != 1 or keys.shape[2] != 1:
            raise ValueError(f"steady=True takes one token, got {keys.shape[2]}")
        out, new, row = split_step(m, state, queries, keys, values, scale)
        new = new if row is None else write_row(new, row)
    else:
        out = attend(m, state, queries, keys, values, scale=scale, mask=mask)
        new = m.update(state, keys, values, queries=queries)
    if info:
        return out, new, step_info(m, state, new, keys, values)
    return out, new


def attend(m: Method, state, queries: mx.array, keys: mx.array, values: mx.array, *,
           scale: float, mask=None) -> mx.array:
    """The attention of ``queries`` over what ``state`` holds followed by the new rows: the
    method's ``attend`` hook where it has one (codecs scoring queries against their codes),
    else MLX's attention over the stored slots (empty slots masked out) and the new rows, the
    new rows causal among themselves unless ``mask`` says otherwise."""
    if m.attend is not None:
        return m.attend(state, queries, keys, values, scale=scale,
                        mask=mask if mask is not None or keys.shape[2] == 1 else "causal")
    k, v, filled = m.kv_slots(state)
    if filled is None and mask is None and queries.shape[2] > 1:
        mask = "causal"
    mask = with_empty_slots(mask, filled, queries, k.shape[2] + keys.shape[2])
    return mx.fast.scaled_dot_product_attention(
        queries, evict.append_rows(k, keys), evict.append_rows(v, values), scale=scale, mask=mask)


def arrays(record: Any) -> list[mx.array]:
    """The arrays of ``record`` (nested tuples, lists and dicts), depth first, in
    ``mlx.utils.tree_flatten``'s order, without building its key strings: a decode step
    calls it twice per layer (a state record's fields in one pass)."""
    if isinstance(record, mx.array):
        return [record]
    if isinstance(record, dict):
        record = list(record.values())
    elif not isinstance(record, (tuple, list)):
        return []
    out = []
    for x in record:
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (tuple, list, dict)):
            out.extend(arrays(x))
    return out



def with_state(out: mx.array, arrays: list[mx.array]) -> mx.array:
    """A decode step's attention output, made to depend on the new state of its layer: the
    model's one evaluation of the step (its logits) computes the states too. An evaluation
    of each layer's state of its own costs a submission per layer (measured on the H200:
    docs/results/speed/README.md, "Split attention"), and a state left out of the logits'
    graph would wait, growing, for the next step."""
    return mx.depends(out, arrays) if arrays else out


def with_empty_slots(mask, filled: mx.array | None, queries: mx.array, total: int):
    """``mask`` (``None``, ``"causal"`` or an array) for ``queries [b, q, s, d]`` over the
    stored slots followed by the new tokens (``total`` keys), with the empty slots of
    ``filled`` (``kv_slots``' mask ``[b, h, n]``; ``None``: none, ``mask`` unchanged) left
    out: stored slots visible where filled, the new tokens as ``mask`` says (causal among
    themselves for ``"causal"``). Boolean, ``[b, q, s, total]``."""
    if filled is None:
        return mask
    b, hq, s, _ = queries.shape
    h, n = filled.shape[1], filled.shape[2]
    stored = mx.broadcast_to(filled[:, :, None, None, :], (b, h, hq // h, s, n)).reshape(b, hq, s, n)
    t = total - n  # the new tokens (a tail may precede the step's own)
    if isinstance(mask, str) or (mask is None and s > 1):
        new = mx.arange(t)[None, :] <= mx.arange(t - s, t)[:, None]
    else:
        new = mx.ones((s, t), mx.bool_)
    out = mx.concatenate([stored, mx.broadcast_to(new, (b, hq, s, t))], axis=-1)
    if isinstance(mask, mx.array):  # a given array mask (mlx-lm's causal one): both hold
        out = (out & mask) if mask.dtype == mx.bool_ else mx.where(out, mask, -mx.inf)
    return out


def split_update(m: Method, state, keys, values, queries):
    """A decode step's update, with the new row's write into its slot left for the next
    step: ``(state, row)``. The rows of a state of slots are read (scores) before the
    step's slot write, and MLX writes in place only into a buffer nothing else holds, so a
    write in the same graph as the reads copies the whole cache; built at the start of the
    next step (the caller), before any read, it writes one row. ``row`` is
    ``(slot, keys, values)`` (the slot's row if the new token lost); ``None`` when the step
    writes no slot (a method without slots, a composed state, a chunk)."""
    backend = m.backends[state.backend]
    with_move = backend.with_move
    if with_move is None or not isinstance(getattr(state, "keys", None), mx.array):
        return m.update(state, keys, values, queries=queries), None
    return _deferred_row(state, *with_move(state, keys, values, queries), keys, values)


def _deferred_row(state, new, move, keys, values):
    """``(new, row)`` of :func:`split_update` from the update's ``(new, move)``."""
    if move.slot is not None and getattr(move, "rows", None) is not None:  # rows left unwritten
        return new._replace(keys=state.keys, values=state.values), (move.slot, *move.rows)
    if move.slot is None:
        return new, None
    rows = []
    for old, x in ((state.keys, keys), (state.values, values)):
        if move.write is not None:  # the new token lost: the slot keeps its row
            idx = move.slot[..., None]
            x = mx.where(move.write[..., None], x.astype(old.dtype), mx.take_along_axis(old, idx, axis=2))
        rows.append(x.astype(old.dtype))
    return new._replace(keys=state.keys, values=state.values), (move.slot, *rows)


def write_row(state, row) -> tuple:
    """``state`` with a pending row ``(slot, keys, values)`` written into its slot."""
    slot, k, v = row
    return state._replace(keys=evict.write_slot(state.keys, k, slot),
                          values=evict.write_slot(state.values, v, slot))


def split_step(m: Method, state, queries, keys, values, scale):
    """One decode step of a steady state (a single token at a full bounded cache, or into an
    empty row of chunked storage): this token's attention over stored + new, then the
    method's update with its query, the new row's slot write left for the next step
    (:func:`split_update`): ``(out, state, row)``.

    The output comes from the backend's fused kernel where it has one (the ``cuda`` evictors:
    :func:`attended_step`), else from the backend's own step where it has one (``steady_step``:
    chunked storage, the codecs, writing the row in place first and attending over the written
    arrays; no row left pending), else from the weights the method scores by (the CPU:
    :func:`weights_attention`), else the method's ``attend`` hook (codes read in place),
    else MLX's attention over the stored slots (empty ones masked) and the new row."""
    attended = attended_step(m, state, queries, keys, values, scale)
    if attended is not None:
        return attended
    own = m.backends[state.backend].steady_step
    if own is not None:  # chunked storage: the row written in place, then attention over it
        out, new = own(state, queries, keys, values, scale)
        return out, new, None
    if m.attend is not None:
        out = m.attend(state, queries, keys, values, scale=scale, mask=None)
    else:  # the stored rows in storage order, empty slots masked, then the new token
        k, v, filled = m.kv_slots(state)
        out = weights_attention(m, queries, k, v, filled, keys, values, scale)
        if out is None:
            mask = with_empty_slots(None, filled, queries, k.shape[2] + keys.shape[2])
            out = mx.fast.scaled_dot_product_attention(
                queries, evict.append_rows(k, keys), evict.append_rows(v, values), scale=scale,
                mask=mask)
    return (out, *split_update(m, state, keys, values, queries))


def split_step_with_row(m: Method, state, row, queries, keys, values, scale):
    """:func:`split_step` after writing the last step's pending row ``(slot, keys, values)``
    into its slot: the write comes first in the graph, before anything reads the rows, so MLX
    writes it in place when the caller lets go of the old state (under ``mx.compile`` too)."""
    return split_step(m, write_row(state, row), queries, keys, values, scale)


def weights_attention(m: Method, queries, k, v, filled, keys, values, scale):
    """On the CPU, for a method whose score is the step's attention weights over the stored
    keys as logits (``velox.evict.scores_by_logits``: TOVA, the heavy-hitter family): the
    decode step's attention output from the very weights the score computes
    (``velox.attention.candidate_weights`` of the newest query, the same expression, which
    ``mx.compile`` computes once), times the stored values plus the new token's: no
    stored + new concatenation and no second pass over the keys. ``None`` elsewhere (another
    device, empty slots, a scale other than ``head_dim ** -0.5``, coded keys)."""
    if (mx.default_device() != mx.cpu or filled is not None or not evict.scores_by_logits(m)
            or not isinstance(k, mx.array) or k.dtype != mx.float32 or queries.shape[2] != 1
            or not math.isclose(scale, keys.shape[-1] ** -0.5, rel_tol=1e-6)):
        return None
    b, hq, _, d = queries.shape
    h, n = k.shape[1], k.shape[2]
    w = candidate_weights(scoring_queries(keys, queries)[:, :, :, -1:], k, keys)  # [b, h, g, 1, n + 1]
    w = w.reshape(b, h, hq // h, n + 1)
    out = w[..., :n] @ v.astype(mx.float32) + w[..., n:] * values.astype(mx.float32)
    return out.reshape(b, hq, 1, d).astype(queries.dtype)


def attended_step(m: Method, state, queries, keys, values, scale):
    """The decode step of a backend that computes the attention output with its scores in
    one kernel (``with_attention``: the ``cuda`` backend of the score-and-keep evictors),
    ``(out, state, row)``; ``None`` where it does not apply (another backend, a state with
    empty slots, a scale other than ``head_dim ** -0.5``)."""
    fused = m.backends[state.backend].with_attention
    if fused is None or m.attend is not None or not isinstance(getattr(state, "keys", None), mx.array):
        return None
    if not math.isclose(scale, keys.shape[-1] ** -0.5, rel_tol=1e-6):
        return None
    res = fused(state, keys, values, queries)
    if res is None:
        return None
    out, new, move = res
    return (out, *_deferred_row(state, new, move, keys, values))




def slack(m: Method, params: dict[str, Any]) -> int:
    """Rows a state of ``m`` may hold beyond its capacity (``contract.slack``, ``velox.evict``)."""
    name = m.spec.contract.get("slack")
    return int(params.get(name, 0)) if name else 0


def steady_rows(m: Method, params: dict[str, Any]) -> int | None:
    """The slots of a full state of ``m`` with (validated) ``params``, where its single-token
    steps keep every shape (capacity plus slack); ``None`` where no state of ``m`` is steady
    at one size (:func:`not_steady_because` says why; chunked storage is steady at any size
    while its empty rows last: :func:`steady_room`)."""
    if not_steady_because(m, params) is not None or chunked(m):
        return None
    return m.spec.capacity(params) + slack(m, params)


def slot_count(m: Method, state) -> int:
    """Rows the state's arrays hold (its slots, empty ones included: ``kv_slots`` leaves out
    the empty slots, which are the last ones; chunked storage: its capacity)."""
    if chunked(m):
        return m.extras["capacity"](state)
    return int(m.kv_slots(state)[0].shape[2]) + evict.empty_slots(getattr(state, "policy", state))


def chunked(m: Method) -> bool:
    """Whether ``m`` holds its rows in chunks (``contract.storage = "chunked"``: the codec
    caches, ``velox.codec_cache``): arrays grown a chunk at a time, a token written in place
    into the next empty row."""
    return m.spec.contract.get("storage") == "chunked"


def steady_room(m: Method, state, held: int) -> int | None:
    """Empty rows of a state of chunked storage that holds ``held`` tokens (the caller's
    count, e.g. an mlx-lm cache's offset: nothing is read from the device; the rows from the
    arrays' shapes): its next ``room`` single-token steps keep every shape, and one more than
    that grows the arrays. ``None`` for any other method, or a backend without an in-place
    single-token step (``steady_step``: the ``reference`` backend)."""
    backend = m.backends.get(getattr(state, "backend", None))  # (ragged rows: no backend field)
    if not chunked(m) or backend is None or backend.steady_step is None:
        return None
    return m.extras["capacity"](state) - held


def steady_form(m: Method, state):
    """The record of ``state`` a compiled decode step is traced with: for chunked storage the
    same arrays with the count of empty rows left to them (``velox.codec_cache.uncounted``), so
    that the record stays the same from token to token; others as they are."""
    form = m.extras.get("uncounted") if chunked(m) else None
    return state if form is None else form(state)


def not_steady_because(m: Method, params: dict[str, Any] | None = None) -> str | None:
    """Why no state of ``m`` with (validated) ``params`` (default: the spec's defaults) is
    steady, so its decode steps cannot run in the whole model's compiled step
    (``velox.adapters.model_step``), or ``None`` where a full state is steady, or (chunked
    storage) a state with an empty row."""
    contract = m.spec.contract
    if m.layer_update is not None and not contract.get("record_steady", False):
        return "it updates a record shared by every layer, layer by layer"
    if not contract.get("compilable", True):
        return contract.get("not_compilable_because", "its update is not compilable")
    if not contract.get("steady", True):  # a method made of methods (velox.wrap)
        return contract["not_steady_because"]
    if contract.get("bound_phase", "all") != "all":
        return "it bounds its prefill only: every decode token is kept, so its state grows"
    if chunked(m):
        return None
    if m.spec.capacity(validate_params(m.spec, {}) if params is None else params) is None:
        why = contract.get("grows_because")  # a spec's word on why it appends
        return ("its state grows with the tokens (codes or rows appended at every step)"
                + (f": {why}" if why else ""))
    return None


# --- a layer's steady decode step, and the compiled steps it runs ---------------------------

def layer_step(m: Method, state, row, queries, keys, values, scale, *, filled=None):
    """A steady single-token decode step of one layer (a decode loop's step for a state its
    caller found steady, ``steady_rows``): ``(out, state, row, kind)``.

    ``kind`` is ``"fill"`` where the backend writes the token into an empty slot (amortized
    eviction's ``fill``; ``filled``, the state after it, when the caller already made it): no
    score, the row written in place, attention over the filled slots (the backend's
    ``fill_attention`` kernel reading the buffers in place, else MLX's over a view of the
    first slots, the steps of mlx-lm's own cache); else ``"fused"``: the compiled
    :func:`split_step` (with ``row``, the last step's pending slot write, written first, in
    place, inside the compiled step)."""
    backend = m.backends[state.backend]
    fill = backend.fill if row is None else None
    new = filled
    if new is None and fill is not None:
        new = fill(state, keys, values)
    if new is not None:
        return fill_output(m, state, new, queries, keys, values, scale), new, None, "fill"
    if row is None:
        out, new, row = compiled(m, "fused", state.backend)(state, queries, keys, values, scale)
    else:
        out, new, row = compiled(m, "fused+row", state.backend)(state, row, queries, keys, values, scale)
    return out, new, row, "fused"


def fill_output(m: Method, state, new, queries, keys, values, scale) -> mx.array:
    """The attention output of a fill step from ``state`` to ``new`` (the token written into
    an empty slot): the backend's ``fill_attention`` kernel, else MLX's attention over a view
    of ``new``'s filled first slots."""
    attend = m.backends[state.backend].fill_attention
    out = None if attend is None else attend(state, new, queries, keys, values, scale)
    if out is None:
        k, v = evict.filled_rows(new.keys, new.values, new.empty)
        out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)
    return out


_STEP_KINDS: dict[str, Callable[[Method], Callable]] = {
    "update": lambda m: lambda s, k, v: split_update(m, s, k, v, None),
    "update+queries": lambda m: lambda s, k, v, q: split_update(m, s, k, v, q),
    "fused": lambda m: lambda state, queries, keys, values, scale: split_step(
        m, state, queries, keys, values, scale),
    "fused+row": lambda m: lambda state, row, queries, keys, values, scale: split_step_with_row(
        m, state, row, queries, keys, values, scale)}
COMPILED_STEPS_MAX = 64  # compiled functions kept (least recently used dropped first)
_COMPILED: OrderedDict[tuple[str, str, str], tuple[Method, Callable]] = OrderedDict()


def compiled(m: Method, kind: str, backend: str) -> Callable:
    """The compiled step ``kind`` of method ``m`` for states on ``backend``: ``"update"``
    and ``"update+queries"`` (:func:`split_update`: ``(state, keys, values[, queries]) ->
    (state, row)``), ``"fused"`` (:func:`split_step`) and ``"fused+row"``
    (:func:`split_step_with_row`). Built once per (method key, kind, backend) and kept while
    that method object is the one registered under its key, in one bounded cache
    (``COMPILED_STEPS_MAX``, least recently used dropped first)."""
    key = (m.key, kind, backend)
    hit = _COMPILED.get(key)
    if hit is None or hit[0] is not m:
        hit = _COMPILED[key] = (m, mx.compile(_STEP_KINDS[kind](m)))
        while len(_COMPILED) > COMPILED_STEPS_MAX:
            _COMPILED.popitem(last=False)
    _COMPILED.move_to_end(key)
    return hit[1]


# --- which path a layer's single-token step takes -------------------------------------------

def steady_token(m: Method, state, keys, rows: int | None, *, compile: bool = True) -> bool:
    """Whether a step of ``keys`` is a steady single-token step of ``state``: one token at a
    full bounded state (``rows``: :func:`steady_rows` of its parameters; its slots, empty ones
    included, are that many), where shapes repeat and a compiled step pays. Never for the
    ``reference`` backend, a cross-layer method or ``compile=False``."""
    if (not compile or keys.shape[2] != 1 or state.backend == "reference"
            or m.layer_update is not None):
        return False
    return rows is not None and slot_count(m, state) == rows


def fill_token(m: Method, state, keys, values, *, compile: bool = True):
    """The state after a single token written into an empty slot by the backend's ``fill``
    (a prefill-bounded method's decode steps, amortized eviction's), or ``None`` where the
    step takes another path (no empty slot, no ``fill``, several tokens, a cross-layer
    method, ``compile=False``)."""
    if (not compile or keys.shape[2] != 1 or m.layer_update is not None
            or not evict.empty_slots(state)):
        return None
    fill = m.backends[state.backend].fill
    return None if fill is None else fill(state, keys, values)


def record_form(m: Method, state):
    """A cross-layer method's layer ``state`` where the whole model's compiled decode step
    takes it with the model-level record (``layer_update`` traced inside the step), or
    ``None``: its spec says a full state keeps every shape through ``layer_update``
    (``contract.record_steady``) and the state is full (its own capacity plus slack, no empty
    slot), not on the ``reference`` backend."""
    if (m.layer_update is None or not m.spec.contract.get("record_steady", False)
            or state.backend == "reference"):
        return None
    fields = state._asdict()
    cap = m.spec.capacity(fields)
    if cap is None or evict.empty_slots(state):
        return None
    return state if m.kv_slots(state)[0].shape[2] == cap + slack(m, fields) else None


def compiled_form(m: Method, state, held: int, *, steady: bool, plain: bool, row=None):
    """The record of ``state`` (holding ``held`` tokens) that the whole model's compiled
    decode step takes for its next token, or ``None`` where that token must run layer by
    layer. A state of slots: while it is ``steady`` (its caller's fast path holds for it)
    and no slot is empty (the layout the step was traced for). Chunked storage
    (:func:`steady_room`): while its next token fits an empty row, its caller's steps are
    ``plain`` (no journal, tail or observer) and no row is pending; the record then comes
    with the count of empty rows left (:func:`steady_form`)."""
    room = steady_room(m, state, held)
    if room is None:
        if not steady or evict.empty_slots(getattr(state, "policy", state)):
            return None
        return state
    if room < 1 or not plain or row is not None:
        return None
    return steady_form(m, state)
