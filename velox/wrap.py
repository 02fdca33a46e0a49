"""Methods made of methods: an uncompressed decode tail, and a rollback journal.

    tail = velox.wrap.with_tail(velox.get_method("tova"), 64)     # key "tova@tail64"
    state = tail.init(1, 8, 128, budget=256)
    state = tail.update(state, k, v, queries=q)   # one token: joins the tail, tova untouched

    back = velox.wrap.with_rollback(velox.get_method("kivi"), 4)  # key "kivi@rollback4"
    state = back.update(back.update(state0, k1, v1), k2, v2)
    state = velox.wrap.trim(state, 1)             # exactly back.update(state0, k1, v1)

Each returns a registered method like any other: a state record (:class:`TailState`,
:class:`JournalState`) holding the wrapped method's state, and ``init`` / ``update`` /
``get_kv`` / ``positions`` / ``kv_slots`` / ``nbytes`` (and ``attend`` where the wrapped
method has one) as pure functions of it, checked by the contract suite. Their spec is the
wrapped method's with a new key (and, for the tail, a capacity ``cap - 1`` tokens larger).

``with_tail(m, cap)``: single-token steps append their rows, uncompressed, to a tail of at
most ``cap - 1`` tokens, which attention reads after what ``m`` stores; the step that would
fill it (the ``cap``-th token) hands tail + token to ``m.update`` as one chunk, with the tail's
real queries where every one of its steps gave one (else none: the key-as-query proxy). A
multi-token step takes the tail along the same way. ``cap=1`` never holds a tail: the wrapper
is ``m`` itself. A tail's length changes every step, so its states are not steady
(``velox.decode.not_steady_because``): decode loops run its updates one by one.

``with_rollback(m, depth)``: the state keeps ``m``'s states before each of its last ``depth``
updates (references: states are never changed in place), and :func:`trim` removes the newest
tokens exactly, back to a step boundary, or raises. Journaled bytes are real: ``nbytes``
counts every distinct array the current and journaled states hold. Its states are steady
where the wrapped method's are: a steady decode step is the wrapped method's
(``velox.decode.split_step``), its row written at once, journaled.

A cross-layer method (``m.layer_update``: a model-level record every layer's update reads and
returns) keeps its record in the journal too: each layer's state holds the record it left at
its newest update (``JournalState.record``) and the one it had left before each journaled
update (``records``), references again. :func:`trim` restores that record with the state, so
trimming every layer in order, as a step updates them, ends on the last layer's: the model's
record at that token, exactly (``velox.layer.left_record``). Its ``nbytes`` counts each state
as ``m`` does (an array the layer holds of another layer, a group's shared codes or basis, is
that layer's) and each array once; the journaled records hold arrays of the layers' states
(and small ones of their own, ChunkKV's selection), uncounted as the model's record is.
``layer_update``, ``model_init`` and ``layer_params`` are the wrapped method's, journaled.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, NamedTuple

import mlx.core as mx

from .backend import Backend
from .decode import arrays, chunked, fill_output, split_step, write_row
from .registered import _REGISTRY
from .registry import Method, register
from .state_dims import method_dims

__all__ = ["with_tail", "with_rollback", "TailState", "JournalState", "trim", "can_trim",
           "trimmable_tokens", "wrapped", "TAIL_CAP_MAX", "ROLLBACK_MAX"]

TAIL_CAP_MAX = 4096  # the tail is held uncompressed: beyond a few thousand tokens, no cache
# The most steps a journal holds. Each entry may hold a whole state of the wrapped method
# (an evictor's slot arrays are copied by the step after), so memory grows with the depth.
ROLLBACK_MAX = 64


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} must be an integer from {lo} to {hi}")


def _empty(b: int, h: int, d: int, dtype) -> mx.array:
    return mx.zeros((b, h, 0, d), dtype)


def _cat(a: mx.array, b: mx.array) -> mx.array:
    if a.shape[2] == 0:
        return b
    if b.shape[2] == 0:
        return a
    return mx.concatenate([a, b.astype(a.dtype)], axis=2)


def _spec(m: Method, key: str, contract: dict[str, Any], deviation: str):
    spec = m.spec
    return dataclasses.replace(spec, key=key, contract={**spec.contract, **contract},
                               deviations=(*spec.deviations, deviation))


def _init_params(m: Method) -> list[inspect.Parameter]:
    sig = inspect.signature(getattr(m.init, "__wrapped__", m.init))
    return list(sig.parameters.values())


def _forwarding_init(m: Method, make):
    """An ``init`` with ``m.init``'s signature (the registry reads the parameters from it)
    that builds ``m``'s state and wraps it with ``make(inner, batch, kv_heads, head_dim,
    dtype)``."""
    params = _init_params(m)

    def init(*args: Any, **kwargs: Any):
        bound = inspect.Signature(params).bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        for p in params:  # **extra of the wrapped init, if it has one
            if p.kind is p.VAR_KEYWORD:
                given.update(given.pop(p.name, {}))
        inner = m.init(**given)
        return make(inner, given["batch"], given["kv_heads"], given["head_dim"], given["dtype"])

    init.__signature__ = inspect.Signature(params)
    init.__doc__ = m.init.__doc__
    init.__module__ = __name__
    return init


def wrapped(m: Method) -> Method | None:
    """The method a wrapper method wraps (``None`` for any other method)."""
    return m.extras.get("wraps")


# --- the uncompressed decode tail -------------------------------------------------------

class TailState(NamedTuple):
    """``with_tail``'s state: the wrapped method's state, then the tail's rows
    ``keys``/``values [b, h, t, d]`` (``t < cap``, in position order, every one after what
    ``inner`` stores) and ``queries [b, q, t, d]``, the real queries of the tail's steps
    (``None`` when some step came without one, or the tail is empty)."""

    inner: Any
    keys: mx.array
    values: mx.array
    queries: mx.array | None

    @property
    def backend(self) -> str:
        return self.inner.backend

    @property
    def tail_len(self) -> int:
        return int(self.keys.shape[2])

    @property
    def next_pos(self) -> mx.array:
        return self.inner.next_pos + self.tail_len


def with_tail(m: Method, cap: int) -> Method:
    """``m`` behind an uncompressed tail of single-token steps (see the module docstring):
    the method registered as ``f"{m.key}@tail{cap}"`` (made once), or ``m`` itself for
    ``cap=1``. ``cap`` is an integer from 1 to ``TAIL_CAP_MAX``."""
    _check_int("cap", cap, 1, TAIL_CAP_MAX)
    if cap == 1:
        return m
    key = f"{m.key}@tail{cap}"
    if key in _REGISTRY:
        return _REGISTRY[key]
    own = type(f"TailState_{m.key}_{cap}".replace("+", "_").replace("@", "_"), (TailState,),
               {"__slots__": (), "__doc__": TailState.__doc__})
    def make(inner, b, h, d, dtype):
        return own(inner, _empty(b, h, d, dtype), _empty(b, h, d, dtype), None)

    def joined(state, keys, values, queries):
        """Tail + new rows, and their queries (``None`` unless every one has its query)."""
        t = state.tail_len
        if queries is not None and t:
            queries = None if state.queries is None else _cat(state.queries, queries)
        return _cat(state.keys, keys), _cat(state.values, values), queries

    def absorbs(state, keys) -> bool:
        return keys.shape[2] > 1 or state.tail_len + 1 >= cap

    def update(state, keys, values, queries):
        k, v, q = joined(state, keys, values, queries)
        if not absorbs(state, keys):  # one token joins the tail
            return state._replace(keys=k, values=v, queries=q)
        b, h, _, d = k.shape
        return make(m.update(state.inner, k, v, queries=q), b, h, d, state.keys.dtype)

    def get_kv(state):
        k, v = m.get_kv(state.inner)
        return _cat(k, state.keys), _cat(v, state.values)

    def positions(state):
        pos = m.positions(state.inner)
        t = state.tail_len
        if not t:
            return pos
        new = state.inner.next_pos[..., None] + mx.arange(t, dtype=mx.int32)
        return mx.concatenate([pos, new.astype(pos.dtype)], axis=2)

    def kv_slots(state):
        k, v, filled = m.kv_slots(state.inner)
        t = state.tail_len
        if not t:
            return k, v, filled
        if filled is not None:
            b, h = filled.shape[:2]
            filled = mx.concatenate([filled, mx.ones((b, h, t), mx.bool_)], axis=2)
        return _cat(k, state.keys), _cat(v, state.values), filled

    def nbytes(state):
        own_bytes = state.keys.nbytes + state.values.nbytes
        if state.queries is not None:
            own_bytes += state.queries.nbytes
        return m.nbytes(state.inner) + own_bytes

    def dims(state):
        return method_dims(m, state.inner)

    extra: dict[str, Any] = {}
    if m.error_bound is not None:
        def error_bound(state):
            bk, bv = m.error_bound(state.inner)
            return _cat(bk, mx.zeros_like(state.keys)), _cat(bv, mx.zeros_like(state.values))
        extra["error_bound"] = error_bound
    if m.attend is not None:
        def attend(state, queries, keys, values, *, scale, mask=None):
            t = state.tail_len
            if not t:
                return m.attend(state.inner, queries, keys, values, scale=scale, mask=mask)
            b, q, s, d = queries.shape
            if s == 1 and mask is None and chunked(m):
                # one query sees every row: the tail's and the new ones follow the stored codes
                # as new rows (scored exactly), the stored ones read from their codes
                return m.attend(state.inner, queries, _cat(state.keys, keys),
                                _cat(state.values, values), scale=scale, mask=None)
            # the tail's rows go before the new ones: queries padded in front, causal, so
            # each real query sees what inner stores, the tail, and the new rows up to its own
            padded = mx.concatenate([mx.zeros((b, q, t, d), queries.dtype), queries], axis=2)
            out = m.attend(state.inner, padded, _cat(state.keys, keys),
                           _cat(state.values, values), scale=scale, mask="causal")
            return out[:, :, t:]
        extra["attend"] = attend

        def attend_update(state, queries, keys, values, *, scale, mask=None):
            if state.tail_len or not absorbs(state, keys):
                return None  # attend then update
            out, inner = m.attend_update(state.inner, queries, keys, values, scale=scale, mask=mask)
            return out, state._replace(inner=inner)
        extra["attend_update"] = attend_update
    if m.calibrate is not None:
        extra["calibrate"] = lambda state, arrays: state._replace(inner=m.calibrate(state.inner, arrays))
    if m.layer_update is not None:
        def layer_update(record, layer, state, keys, values, *, queries=None):
            if not absorbs(state, keys):
                return record, update(state, keys, values, queries)
            k, v, q = joined(state, keys, values, queries)
            record, inner = m.layer_update(record, layer, state.inner, k, v, queries=q)
            b, h, _, d = k.shape
            return record, make(inner, b, h, d, state.keys.dtype)
        extra.update(layer_update=layer_update, model_init=m.model_init, layer_params=m.layer_params)

    capacity = m.spec.contract.get("capacity")
    contract = {"steady": False, "tail": cap,
                "not_steady_because": "the tail's length changes from step to step",
                "capacity": None if capacity is None else f"({capacity}) + {cap - 1}"}
    if "storage" in m.spec.contract:
        contract["storage"] = "tail"
    backends = {name: Backend(update=update) for name in m.backends}
    return register(
        key, own, _forwarding_init(m, make), backends, get_kv=get_kv, nbytes=nbytes,
        positions=positions, kv_slots=kv_slots, dims=dims,
        spec=_spec(m, key, contract, f"Decoded tokens are held uncompressed in a tail of up to "
                                     f"{cap - 1} tokens before {m.key} absorbs them as one chunk."),
        wraps=m, tail_cap=cap, **extra)


# --- the rollback journal -----------------------------------------------------------------

class JournalState(NamedTuple):
    """``with_rollback``'s state: the wrapped method's state, its states before each of the
    last journaled updates (oldest first) and the token count of each of those updates; for a
    cross-layer method also the model-level record its layer left at its newest update
    (``record``: ``None`` before its first, the record ``model_init`` makes) and the one it
    had left before each journaled update (``records``, parallel to ``past``)."""

    inner: Any
    past: tuple
    steps: tuple
    record: Any = None
    records: tuple = ()

    @property
    def backend(self) -> str:
        return self.inner.backend

    @property
    def next_pos(self) -> mx.array:
        return self.inner.next_pos

    @property
    def empty(self) -> int:
        """The wrapped state's empty slots (amortized eviction's; a composition's policy's)."""
        return getattr(getattr(self.inner, "policy", self.inner), "empty", 0)


def with_rollback(m: Method, depth: int) -> Method:
    """``m`` with a journal of its last ``depth`` updates (see the module docstring): the
    method registered as ``f"{m.key}@rollback{depth}"`` (made once). ``depth`` is an integer
    from 1 to ``ROLLBACK_MAX``; :func:`trim` undoes journaled steps."""
    _check_int("depth", depth, 1, ROLLBACK_MAX)
    key = f"{m.key}@rollback{depth}"
    if key in _REGISTRY:
        return _REGISTRY[key]
    own = type(f"JournalState_{m.key}_{depth}".replace("+", "_").replace("@", "_"),
               (JournalState,), {"__slots__": (), "__doc__": JournalState.__doc__})
    def make(inner, b, h, d, dtype):
        return own(inner, (), ())

    crosslayer = m.layer_update is not None

    def journaled(state, inner, s, record=None):
        """``inner`` after a step of ``s`` tokens, the state before it journaled (and, for a
        cross-layer method, the record the layer had left before it, ``record`` the one it
        leaves now: ``None`` for an update without the model's record keeps the last)."""
        past, steps = (*state.past, state.inner)[-depth:], (*state.steps, s)[-depth:]
        if not crosslayer:
            return own(inner, past, steps)
        return own(inner, past, steps, state.record if record is None else record,
                   (*state.records, state.record)[-depth:])

    def update(state, keys, values, queries):
        return journaled(state, m.update(state.inner, keys, values, queries=queries), keys.shape[2])

    def nbytes(state):
        """Every distinct array of the current and journaled states: the journal's entries
        share the arrays a step did not replace. A cross-layer method's layer counts them as
        its method counts a state (the arrays it holds of another layer, a group's shared
        codes or basis, are that layer's): its current state's bytes, then each entry's,
        newest first, with the arrays counted already left out."""
        if crosslayer:
            return _crosslayer_nbytes(m, state)
        seen: dict[int, int] = {}
        for st in (state.inner, *state.past):
            for x in arrays(st):
                seen.setdefault(id(x), x.nbytes)
        return sum(seen.values())

    extra: dict[str, Any] = {}
    if crosslayer:
        def layer_update(record, layer, state, keys, values, *, queries=None):
            """The wrapped method's layer update, journaled with the record this layer had
            left before it (the record it leaves now kept as its newest)."""
            record, inner = m.layer_update(record, layer, state.inner, keys, values, queries=queries)
            return record, journaled(state, inner, keys.shape[2], record)
        extra.update(layer_update=layer_update, model_init=m.model_init, layer_params=m.layer_params)
    if m.error_bound is not None:
        extra["error_bound"] = lambda state: m.error_bound(state.inner)
    if m.attend is not None:
        extra["attend"] = lambda state, queries, keys, values, *, scale, mask=None: m.attend(
            state.inner, queries, keys, values, scale=scale, mask=mask)

        def attend_update(state, queries, keys, values, *, scale, mask=None):
            out, inner = m.attend_update(state.inner, queries, keys, values, scale=scale, mask=mask)
            return out, journaled(state, inner, keys.shape[2])
        extra["attend_update"] = attend_update
    if m.calibrate is not None:
        extra["calibrate"] = lambda state, arrays: state._replace(inner=m.calibrate(state.inner, arrays))

    def steady_step(state, queries, keys, values, scale):
        """A steady decode step (``velox.decode.split_step``): the wrapped method's, its row
        written at once (the journal holds the state before it, so no write is in place)."""
        out, inner, row = split_step(m, state.inner, queries, keys, values, scale)
        return out, journaled(state, inner if row is None else write_row(inner, row), keys.shape[2])

    def backend(name: str) -> Backend:
        """The journal over backend ``name``: its steady step, and its fill step where the
        wrapped backend has one (a token written into an empty slot or row)."""
        fill = m.backends[name].fill
        if fill is None:
            return Backend(update=update, steady_step=steady_step)

        def journal_fill(state, keys, values):
            inner = fill(state.inner, keys, values)
            return None if inner is None else journaled(state, inner, keys.shape[2])

        def fill_attention(state, new, queries, keys, values, scale):
            return fill_output(m, state.inner, new.inner, queries, keys, values, scale)
        return Backend(update=update, steady_step=steady_step, fill=journal_fill,
                       fill_attention=fill_attention)

    if "capacity" in m.extras:  # chunked storage: the rows its arrays hold
        extra["capacity"] = lambda state: m.extras["capacity"](state.inner)
    backends = {name: backend(name) for name in m.backends}
    return register(
        key, own, _forwarding_init(m, make), backends,
        get_kv=lambda state: m.get_kv(state.inner), nbytes=nbytes,
        positions=lambda state: m.positions(state.inner),
        kv_slots=lambda state: m.kv_slots(state.inner),
        dims=lambda state: method_dims(m, state.inner),
        spec=_spec(m, key, {}, f"The states before the last {depth} updates are kept "
                                     "for trim (rollback); their distinct arrays count in nbytes."),
        wraps=m, rollback=depth, **extra)


def trimmable_tokens(state: JournalState) -> int:
    """The most tokens :func:`trim` removes from ``state`` now: those of its journaled steps."""
    _check_journal(state)
    return sum(state.steps)


def can_trim(state: JournalState, n: int) -> bool:
    """Whether ``trim(state, n)`` is exact: ``n`` is 0 or the token count of the newest ``k``
    journaled steps for some ``k``."""
    _check_journal(state)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return False
    return n == 0 or _boundary(state, n) is not None


def _boundary(state: JournalState, n: int) -> int | None:
    total = 0
    for k in range(1, len(state.steps) + 1):
        total += state.steps[-k]
        if total == n:
            return k
    return None


def _check_journal(state: Any) -> None:
    if not isinstance(state, JournalState):
        raise TypeError(f"trim takes the state of a with_rollback method, got {type(state).__name__}")


def trim(state: JournalState, n: int) -> JournalState:
    """``state`` without its newest ``n`` tokens: the state its method held before them (the
    journal keeps the older steps). ``n`` must be 0 or a step boundary within the journal
    (:func:`can_trim`); anything else raises ``ValueError`` (never a partial trim)."""
    _check_journal(state)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"trim({n!r}): n must be an integer >= 0")
    if n == 0:
        return state
    k = _boundary(state, n)
    if k is None:
        ends = [sum(state.steps[len(state.steps) - j:]) for j in range(1, len(state.steps) + 1)]
        raise ValueError(f"trim({n}): the journal can remove exactly "
                         f"{', '.join(map(str, ends)) or 'no'} tokens now (its step boundaries)")
    if state.records:  # a cross-layer method's: the record its layer had left then
        return state._replace(inner=state.past[-k], past=state.past[:-k], steps=state.steps[:-k],
                              record=state.records[-k], records=state.records[:-k])
    return state._replace(inner=state.past[-k], past=state.past[:-k], steps=state.steps[:-k])


def _crosslayer_nbytes(m: Method, state: JournalState) -> int:
    """The bytes of a cross-layer method's journal (``with_rollback``'s ``nbytes``): each state
    counted by ``m.nbytes`` with the arrays a newer one holds replaced by empty ones, so an
    array several entries share counts once and one the method leaves to another layer
    never does."""
    seen: set[int] = set()
    total = 0
    for st in (state.inner, *reversed(state.past)):
        total += m.nbytes(_without(st, seen))
        seen.update(id(x) for x in arrays(st))
    return total


def _without(record: Any, seen: set[int]) -> Any:
    """``record`` (nested tuples, lists and dicts of arrays) with every array whose id is in
    ``seen`` replaced by an empty array of its dtype and rank."""
    if isinstance(record, mx.array):
        return mx.zeros((0,) * record.ndim, record.dtype) if id(record) in seen else record
    if isinstance(record, dict):
        return {k: _without(v, seen) for k, v in record.items()}
    if isinstance(record, tuple) and hasattr(record, "_fields"):
        return type(record)(*(_without(x, seen) for x in record))
    if isinstance(record, (tuple, list)):
        return type(record)(_without(x, seen) for x in record)
    return record
