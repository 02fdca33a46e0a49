"""One layer's cache as a value: what it holds (:class:`Held`) and the pure steps of mlx-lm's
cache protocol over it.

An mlx-lm cache (``velox.adapters.mlxlm.VeloxCache``) holds one :class:`Held` record and the
settings of its layer, and maps the protocol's calls onto these functions:
``update_and_fetch`` is :func:`take` (and, where the step's attention comes later, in
mlx-lm's wrapped ``scaled_dot_product_attention``, :func:`defer`), the wrapped attention is
:func:`attend`, an update outside it is :func:`absorb`, ``trim`` is :func:`trim`. Every
decision of a step (which path a token takes, when the state is created, which rows
attention reads, whether the next step may skip the checks) is made here; the cache only
stores the record each function returns. Nothing here evaluates or reads the device.

A decode step's row may be left unwritten (``row``: the slot write of the last steady step,
``velox.decode.split_step``), to be written first in the next step's graph, in place. Any
function that reads the state's rows writes it first (:func:`written`); the cache stores the
record it gets back, so the row is written once.

A cross-layer method's model-level record (shared by every layer of a model, held by the
cache's model) goes through these steps as a value: :func:`absorb` and :func:`attend` take it
and return the next one; after a trim the layer's journal says which record it left then
(:func:`left_record`; the last layer's is the model's). A verify call, run as one-token steps
inside each layer, carries one record per token from layer to layer (:class:`TokenRecords`,
:func:`at_token`, :func:`after_split`), where the method's spec says that is exact, and is
refused (:func:`check_verify`) where it is not.

``fast``: the state is at its steady size after a fused step of a cache whose steps are
plain (no journal, tail, observer or model-level record): the next single-token call needs
no check (``VeloxCache.update_and_fetch``). A new state ends it; writing the row keeps it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx

from . import evict, wrap
from .decode import (compiled, compiled_form, fill_token, layer_step, record_form, steady_rows,
                     steady_token, with_empty_slots, write_row)
from .decode import arrays as _arrays
from .distributed import LOCAL, Heads
from .registry import Method

__all__ = ["Plan", "Pending", "Held", "plan", "written", "take", "defer", "waits", "fetch", "missed", "absorb", "attend",
           "fast_after", "steady", "stored_rows", "tokens", "positions", "held_arrays", "new_arrays",
           "inner_state", "tail_state", "kind", "trim", "can_trim", "trimmable_tokens", "TokenRecords",
           "split_refusal", "check_verify", "at_token", "after_split", "token_record", "kept_record",
           "left_record", "leaving"]


class Plan(NamedTuple):
    """A layer's settings its steps read: the method it steps (``m``), the backend, parameters
    and calibration arrays its state is made with, the slots of its steady state (``rows``,
    ``velox.decode.steady_rows``), whether steady steps compile, and where the layer's kv
    heads the cache holds sit among the layer's (``heads``, ``velox.distributed``: a shard of
    a tensor-parallel model's)."""

    m: Method
    backend: str = "auto"
    params: dict[str, Any] = {}
    artifact: Any = None
    rows: int | None = None
    compile: bool = True
    heads: Heads = LOCAL


class Pending(NamedTuple):
    """Tokens a cache took whose update waits for the step's attention (deferred mode).

    ``fused``: the attention runs the steady step (``velox.decode.layer_step``); ``new_only``:
    the cache handed out only these tokens (the wrapper attends by itself); ``filled``: the
    state after a fill step, when that was decided at the call; ``split``: a verify call,
    run as the one-token steps it stands for."""

    keys: mx.array
    values: mx.array
    fused: bool = False
    new_only: bool = False
    filled: Any = None
    split: bool = False


class Held(NamedTuple):
    """What one layer's cache holds: the state of the method it steps (``None`` before its
    first tokens), a pending row, the offset (the next token's absolute position), a pending
    step, and ``fast`` (module doc)."""

    state: Any = None
    row: Any = None
    offset: int = 0
    pending: Pending | None = None
    fast: bool = False


def plan(m: Method, params: dict[str, Any], full: dict[str, Any], *, backend: str = "auto",
         tail: int | None = None, rollback: int = 0, artifact: Any = None, compile: bool = True,
         heads: Heads = LOCAL) -> Plan:
    """The plan of a layer stepping ``m`` (``params`` as given, ``full`` the same validated
    with its defaults): the method behind a decode tail of ``tail`` tokens where one is given
    (``velox.wrap.with_tail``), then behind a journal of its last ``rollback`` updates
    (``velox.wrap.with_rollback``); the slots of its steady state."""
    run = wrap.with_tail(m, tail) if tail else m
    run = wrap.with_rollback(run, rollback) if rollback else run
    return Plan(run, backend, params, artifact, rows=steady_rows(run, full), compile=compile,
                heads=heads)


def written(h: Held) -> Held:
    """``h`` with its pending row written into its slot (``fast`` kept: the same slots)."""
    if h.row is None:
        return h
    return h._replace(state=write_row(h.state, h.row), row=None)


def take(p: Plan, h: Held, keys: mx.array, values: mx.array) -> tuple[Held, Pending]:
    """A call's tokens taken: the state created on the first tokens (``p.m.init`` with the
    plan's parameters, backend and heads, calibrated where it has an artifact), the offset
    advanced; the step, for :func:`defer` or :func:`absorb`."""
    if h.state is None:
        b, n_heads, _, d = keys.shape
        st = p.m.init(b, n_heads, d, dtype=keys.dtype, backend=p.backend, heads=p.heads, **p.params)
        if p.artifact is not None:
            st = p.m.calibrate(st, p.artifact)
        h = h._replace(state=st, row=None, fast=False)
    return h._replace(offset=h.offset + keys.shape[2]), Pending(keys, values)


def defer(p: Plan, h: Held, step: Pending, *, routed: bool) -> Held:
    """``step`` pending for the wrapped attention, with its path decided: the steady step
    (a single token at a full bounded state, ``rows`` its slots) or a fill step into an empty
    slot; ``new_only`` where the wrapper attends by itself (the method's ``attend``, or the
    steady step) and is known to run for this layer (``routed``)."""
    m, rows, compile = p.m, p.rows, p.compile
    h = written(h)
    fused = steady_token(m, h.state, step.keys, rows, compile=compile)
    filled = None if fused else fill_token(m, h.state, step.keys, step.values, compile=compile)
    fused = fused or filled is not None
    new_only = routed and (m.attend is not None or fused)
    return h._replace(pending=step._replace(fused=fused, new_only=new_only, filled=filled))


def waits(h: Held, keys: mx.array, values: mx.array, *, rollback: int,
          wrapped: bool) -> Held | None:
    """``h`` with a call's tokens pending whole for the wrapped attention (``wrapped``: it
    runs for this layer) where they need nothing before it, else ``None`` (:func:`fetch`):
    a single token after a fused step while ``fast`` holds (nothing to check; the row is
    written inside the next step), and a verify call (2 to ``rollback + 1`` tokens on a
    state holding tokens), which the attention runs as the one-token steps it stands for."""
    s = keys.shape[2]
    if not wrapped or h.pending is not None:
        return None
    if h.fast and s == 1:
        return h._replace(offset=h.offset + 1, pending=Pending(keys, values, True, True))
    if 1 < s <= rollback + 1 and h.offset > 0:
        return h._replace(offset=h.offset + s,
                          pending=Pending(keys, values, new_only=True, split=True))
    return None


def fetch(p: Plan, h: Held, keys: mx.array, values: mx.array, *, wrapped: bool,
          routed: bool) -> tuple[Held, Pending, tuple[mx.array, mx.array]]:
    """A call's tokens taken (:func:`take`) and what the call hands the model's attention:
    ``(held, step, (keys, values))``. Where the wrapped attention comes later (``wrapped``)
    the step is pending for it (:func:`defer`), and the new rows alone are handed out where
    the wrapper attends by itself; else the step is the caller's to :func:`absorb` and the
    stored rows come first (:func:`stored_rows`)."""
    h, step = take(p, h, keys, values)
    h = defer(p, h, step, routed=routed) if wrapped else written(h)
    if wrapped and h.pending.new_only:
        return h, step, (keys, values)
    k, v = stored_rows(p.m, h.state, wrapped=wrapped)
    return h, step, (evict.append_rows(k, keys), evict.append_rows(v, values))


def missed(m: Method, h: Held) -> tuple[Held, Pending | None]:
    """``h`` without a pending step whose attention never reached the wrapper, and that step
    (``None`` where none is pending), for :func:`absorb` with the proxy; ``RuntimeError``
    where the cache had handed out its new rows alone (nothing attended over the rest)."""
    step = h.pending
    if step is not None and step.new_only:
        raise RuntimeError(f"{m.key} attends through mlx-lm's scaled_dot_product_attention, "
                           "but the last forward did not call it for this layer")
    return (h, None) if step is None else (h._replace(pending=None), step)


def absorb(p: Plan, h: Held, step: Pending, queries: mx.array | None, *, record: Any = None,
           index: int = 0) -> tuple[Held, Any]:
    """The method's update of ``step``'s tokens (scored with ``queries``, or the proxy):
    ``(held, record)``. With a model-level ``record`` (a cross-layer method's, shared by
    every layer) the update is ``m.layer_update`` of layer ``index``; a steady single token
    runs the compiled update, its row left pending."""
    m = p.m
    h = written(h)
    keys, values, st, row = step.keys, step.values, h.state, None
    if record is not None and m.layer_update is not None:
        record, st = m.layer_update(record, index, st, keys, values, queries=queries)
    elif not steady_token(m, st, keys, p.rows, compile=p.compile):
        st = m.update(st, keys, values, queries=queries)
    elif queries is None:
        st, row = compiled(m, "update", st.backend)(st, keys, values)
    else:
        st, row = compiled(m, "update+queries", st.backend)(st, keys, values, queries)
    return h._replace(state=st, row=row, fast=False), record


def attend(p: Plan, h: Held, queries: mx.array, keys: mx.array, values: mx.array, *,
           scale: float, mask, sinks, plain: bool, record: Any = None,
           index: int = 0) -> tuple[mx.array, Held, str, Any]:
    """The wrapped attention of ``h``'s pending step (not a verify call), then its update
    with the real ``queries``: ``(out, held, kind, record)``, ``kind`` how it ran
    (``"fused"``, ``"fill"``, ``"deferred"``, or ``"tail"`` where the token joined the tail).

    ``keys``/``values`` are what the cache handed out. The paths: the steady step where it
    was decided (no mask, no sinks); the method's own ``attend`` (with its update in one call,
    ``attend_update``, where the step is its own queries' tokens and not steady); else MLX's
    attention over the stored rows, the empty slots masked."""
    m, step, h = p.m, h.pending, h._replace(pending=None)
    if step.fused and sinks is None and mask is None:
        out, st, row, how = layer_step(m, h.state, h.row, queries, step.keys, step.values, scale,
                                       filled=step.filled)
        fast = h.fast or fast_after(p, st, plain)  # decided for the state it stepped from: kept
        return out, h._replace(state=st, row=row, fast=fast), how, record
    h = written(h)
    if m.attend is not None:
        if sinks is not None:
            raise ValueError(f"{m.key} does not support attention sinks")
        if (step.keys.shape[2] == queries.shape[2] and m.layer_update is None
                and not steady_token(m, h.state, step.keys, p.rows, compile=p.compile)):
            out, st = m.attend_update(h.state, queries, step.keys, step.values, scale=scale,
                                      mask=mask)
            return out, h._replace(state=st, fast=False), kind(st, "deferred"), record
        out = m.attend(h.state, queries, step.keys, step.values, scale=scale, mask=mask)
    else:
        k, v, filled = m.kv_slots(h.state)
        if step.new_only:  # handed the new tokens only; rebuild what attention reads
            keys, values = evict.append_rows(k, step.keys), evict.append_rows(v, step.values)
        mask = with_empty_slots(mask, filled, queries, keys.shape[2])
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                   sinks=sinks)
    h, record = absorb(p, h, step, queries, record=record, index=index)
    return out, h, kind(h.state, "deferred"), record


def fast_after(p: Plan, state, plain: bool) -> bool:
    """Whether the next single-token step of ``state`` (after a fused step) may skip the
    checks: the cache's steps are ``plain`` and the state is still at its steady size."""
    return plain and p.m.kv_slots(state)[0].shape[2] == p.rows


def steady(p: Plan, h: Held, *, plain: bool, alone: bool, record: bool) -> tuple[Held, Any]:
    """The state the whole model's compiled step takes for ``h``'s next token, ``None`` where
    that token runs layer by layer (a state not made yet, a step pending): with a model-level
    ``record``, the layer's full state (its row written first; ``velox.decode.record_form``)
    where its steps are the method's ``alone``; else ``velox.decode.compiled_form`` (``fast``
    its fast path, ``plain`` its steps). Returns ``(held, form)``: ``held`` as the cache keeps
    it."""
    if h.state is None or h.pending is not None:
        return h, None
    if record:
        h = written(h)
        return h, record_form(p.m, h.state) if p.compile and alone else None
    return h, compiled_form(p.m, h.state, h.offset, steady=h.fast, plain=p.compile and plain,
                            row=h.row)


def stored_rows(m: Method, state, *, wrapped: bool) -> tuple[mx.array, mx.array]:
    """The stored rows a step's attention reads: ``kv_slots`` (storage order; attention does
    not depend on it). With empty slots the wrapped attention masks them; mlx-lm's own
    attention (``wrapped=False``) cannot, so it gets ``get_kv``'s gather of the filled ones."""
    k, v, filled = m.kv_slots(state)
    return m.get_kv(state) if filled is not None and not wrapped else (k, v)


def tokens(m: Method, h: Held) -> int:
    """Tokens ``h`` holds: stored (a tail included) and those of a pending step."""
    stored = 0 if h.state is None else int(m.positions(h.state).shape[2])
    return stored + (0 if h.pending is None else h.pending.keys.shape[2])


def positions(m: Method, h: Held) -> mx.array:
    """Absolute positions ``[b, h, n]`` of what ``h`` holds: stored (a tail last), then the
    tokens of a pending step."""
    if h.state is None:
        return mx.zeros((1, 1, 0), mx.int32)
    pos = m.positions(h.state)
    t = 0 if h.pending is None else h.pending.keys.shape[2]
    if not t:
        return pos
    new = mx.arange(h.offset - t, h.offset, dtype=pos.dtype)
    return mx.concatenate([pos, mx.broadcast_to(new, (*pos.shape[:2], t))], axis=2)


def held_arrays(h: Held) -> list[mx.array]:
    """Every array ``h`` holds: its state's (its row written: :func:`written`) and a pending
    step's rows."""
    p = h.pending
    return _arrays(h.state) + ([] if p is None else [p.keys, p.values])


def new_arrays(h: Held) -> list[mx.array]:
    """The arrays of ``h``'s state and pending row (what a step's output is tied to)."""
    return _arrays(h.state) + _arrays(h.row)


def inner_state(st):
    """The method's own state inside a journal's and a tail's (``velox.wrap``)."""
    if isinstance(st, wrap.JournalState):
        st = st.inner
    return st.inner if isinstance(st, wrap.TailState) else st


def tail_state(st) -> wrap.TailState | None:
    """The tail's state (inside a journal's) while it holds tokens, else ``None``."""
    if isinstance(st, wrap.JournalState):
        st = st.inner
    return st if isinstance(st, wrap.TailState) and st.tail_len else None


def kind(st, how: str) -> str:
    """How a step ran: ``how``, or ``"tail"`` where its token joined a tail."""
    return "tail" if tail_state(st) is not None else how


def trimmable_tokens(st) -> int:
    """The most tokens :func:`trim` removes from a state now (0 without a journal)."""
    return wrap.trimmable_tokens(st) if isinstance(st, wrap.JournalState) else 0


def can_trim(st, n: Any) -> bool:
    """Whether trimming ``n`` tokens is exact now: 0, or the tokens of the newest journaled
    steps."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return False
    return n == 0 or (isinstance(st, wrap.JournalState) and wrap.can_trim(st, n))


def trim(h: Held, n: Any, depth: int) -> Held:
    """``h`` without its newest ``n`` tokens (a journal of ``depth`` steps restores the state
    before them); ``ValueError`` where ``n`` is not a step boundary within the journal."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"trim({n!r}): n must be an integer >= 0")
    if n == 0:
        return h
    if not can_trim(h.state, n):
        steps = list(h.state.steps) if isinstance(h.state, wrap.JournalState) else []
        ends = [sum(steps[len(steps) - j:]) for j in range(1, len(steps) + 1)]
        raise ValueError(
            f"trim({n}): this cache (rollback={depth}) can remove exactly "
            f"{', '.join(map(str, ends)) or 'no'} tokens now (its journaled steps end at offset "
            f"{h.offset}); {n} is not a step boundary within its depth. For speculative "
            "decoding make the model's caches with rollback >= num_draft_tokens")
    return Held(state=wrap.trim(written(h).state, n), offset=h.offset - n)


# --- a cross-layer method's model-level record through rollback and verify calls ------------

def left_record(st) -> Any:
    """The model-level record a cross-layer method's layer left at its newest update, as its
    journal holds it (``velox.wrap.JournalState.record``; after a trim, the one it had left
    then): ``None`` without a journal, or before the layer's first update (the record
    ``model_init`` makes). Trimming every layer in order, as a step updates them, leaves the
    last layer's: the model's record at that token."""
    return st.record if isinstance(st, wrap.JournalState) else None


def leaving(h: Held, record: Any) -> Held:
    """``h`` whose journal says its layer left ``record`` at its newest update (a loaded
    cache's: the model's record as saved), so a trim back to it restores that record."""
    if isinstance(h.state, wrap.JournalState) and h.state.records == () and h.state.past == ():
        return h._replace(state=h.state._replace(record=record))
    return h


class TokenRecords(NamedTuple):
    """A cross-layer method's model-level records through a verify call run as one-token
    steps inside each layer: token ``i``'s record as the layers so far left it, the token the
    stepping layer is at, and the record the model held before the call (``start``). Each
    layer steps every token of the call before the next layer starts, so token ``i``'s record
    goes from layer to layer on its own, starting from ``start`` (:func:`check_verify`: exact
    only where no layer reads what a layer wrote at an earlier token); the last layer hands
    on the record each token leaves (:func:`at_token`)."""

    records: tuple
    at: int = 0
    start: Any = None


def split_refusal(m: Method) -> str | None:
    """Why a verify call of cross-layer method ``m`` cannot run exactly as one-token steps
    inside each layer (``None`` where it can, or ``m`` has no model-level record): its spec
    says ``contract.record_split = true`` when no layer reads from the record what a layer
    wrote at an earlier token, the record each token starts from, and gives the reason
    (``record_split_because``) otherwise."""
    if m.layer_update is None:
        return None
    contract = m.spec.contract
    if contract.get("record_split", False):
        return None
    return contract.get("record_split_because",
                        "its spec does not say that a token's layers read only what the "
                        "layers before them wrote at that token (contract.record_split)")


def check_verify(m: Method, s: int, depth: int) -> None:
    """Refuse (``ValueError``) a verify call of ``s`` tokens on a cache of rollback ``depth``
    whose one-token steps inside each layer would not be token-by-token decoding."""
    why = split_refusal(m)
    if why is not None:
        while wrap.wrapped(m) is not None:  # the method behind its journal and tail
            m = wrap.wrapped(m)
        raise ValueError(
            f"a call of {s} tokens on a cache holding tokens with rollback={depth} runs as "
            f"{s} one-token steps inside each layer (a speculative verify call), which "
            f"{m.key} cannot do exactly: {why}. What works: calls of one token (trim undoes "
            f"up to {depth} of them), calls of more than {depth + 1} tokens (one step each), "
            "or a method whose record a verify call can split")


def at_token(record: Any, i: int, s: int, last: bool) -> Any:
    """The model-level record a layer's verify call of ``s`` tokens holds as it steps token
    ``i``: the call's first layer makes the tokens' records from the model's (each token
    starting from it), a later layer takes those the layer before left. At the ``last``
    layer a token whose record no layer has replaced yet (still ``start`` itself) takes the
    record the token before left, as token-by-token decoding hands it on: so the last layer
    steps, journals and leaves what it would have, token by token (ChunkKV's or XQuant's
    selection or codes carried past tokens that publish none, an append tail's)."""
    if not isinstance(record, TokenRecords):
        record = TokenRecords((record,) * s, i, record)
    record = record._replace(at=i)
    if last and i > 0 and record.records[i] is record.start:
        records = list(record.records)
        records[i] = records[i - 1]
        record = record._replace(records=tuple(records))
    return record


def after_split(record: Any, last: bool) -> Any:
    """The model-level record after a layer's verify call: the tokens' records for the next
    layer, or, after the ``last`` layer, the last token's, the model's record now."""
    if last and isinstance(record, TokenRecords):
        return record.records[-1]
    return record


def token_record(record: Any) -> Any:
    """The record a layer's step reads: the stepping token's through a verify call."""
    return record.records[record.at] if isinstance(record, TokenRecords) else record


def kept_record(held: Any, new: Any) -> Any:
    """The model-level record after a layer's step returned ``new``: the stepping token's
    record replaced through a verify call, else ``new``."""
    if isinstance(held, TokenRecords):
        records = list(held.records)
        records[held.at] = new
        return held._replace(records=tuple(records))
    return new
