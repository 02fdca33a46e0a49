"""Shared eviction mechanics (MLX): append candidates, protect sinks/recent, keep the top budget.

Every eviction method is "append the new rows, score every candidate, keep the ``budget``
best". Stored rows live in *slots*: ``positions [b, h, n]`` says which token each slot holds,
in any order (``-1``: an empty slot). A decode step that evicts one token writes the new row
into the loser's slot, in place; if the new token itself loses, nothing moves. A multi-token
step (prefill, chunks) first gathers the filled slots in increasing position, then keeps the
best candidates in increasing position, so after it the slots are sorted. A method whose rule
needs adjacent positions at decode declares ``contract.slots = "sorted"`` in its spec and keeps
rows sorted at every step (the helpers :func:`keep_rows`, :func:`top_budget`,
:func:`protected` work on sorted candidates). ``get_kv`` returns rows in increasing position
(a gather when the slots are not sorted); ``kv_slots`` returns them in storage order
(``velox.registry``).

Amortized eviction (``contract.slack``, the name of a parameter): a state holds up to
``budget + slack`` rows; a step whose candidates exceed that keeps ``budget`` in one
selection, so selection runs once every ``slack + 1`` decode steps. At decode the selection
gathers the kept rows to the first slots (in slot order, the new token last when kept) and
leaves the last ``slack`` slots empty (position ``-1``; the state's static ``empty`` counts
them): the next tokens fill them in order, each by a slice update in place at a slot every
row shares (no index, no score where the rule scores nothing between selections:
``update.fill``), and the filled slots are always a prefix, which attention reads as a view
(``kv_slots``: no mask). Such a state's slots are in increasing position. ``slack = 0`` is
the per-token rule.

Grown slots (a prefill-bounded method, ``contract.bound_phase = "prefill"``, whose state type
is made with ``grows=True``: SnapKV, PyramidKV, NestedKV): its decode steps keep every token, so a
decode step that finds no empty slot first adds :func:`grow_by` of them after the rows (a
sixteenth, at least ``GROW_MIN``: one copy, as mlx-lm's ``KVCache`` grows its buffers by
256), and the next steps fill them in place as amortized eviction's steps do
(``update.fill``, attention over the filled prefix). What is kept is the append-only rule's;
``nbytes`` counts the empty slots (they are held). A chunk step first drops the empty slots
(a gather of the filled prefix), then keeps what it keeps.

Tie rule (all backends): among equal scores the newer token is kept (the older goes).

Non-finite rule (all backends, every selection): a non-finite score (NaN, or +-inf from an
overflow) ranks lowest, below every finite score, ties among them by the tie rule; protected
tokens (sinks: positions below ``contract.sinks``; recent: the ``contract.recent`` newest
positions) always survive; positions stay unique and the budget holds. :func:`ranked` applies
it; :func:`top_budget` and :func:`slot_losers` rank through it.

Constants (index arrays, masks) come from a cache bounded in bytes (:data:`CONST_BYTES`), so
a cache that grows a token a step never keeps one array per length alive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass
import inspect
import math
import operator
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from . import reference as ref
from ._typing import Array, Bool, Float, Int, Shaped
from .backend import Backend, gpu_kernels
from .coded import CodedKeys
from .consts import CONST_BYTES, cached_const
from .distributed import LOCAL, Heads, head_gather
from .ordering import order_key
from .ragged import ragged
from .slots import Move, filled_rows
from .spec import param_fields
from .state_dims import dims_of

__all__ = ["empty_rows", "new_positions", "protected", "ranked", "top_budget", "row_offsets", "all_but",
           "take_rows", "append_rows", "keep_rows", "dims", "row_sq_norms", "row_norms",
           "cuda_update", "with_compacted", "cached_const", "CONST_BYTES", "score_and_keep", "Scored",
           "empty_state", "state_type", "scores_by_logits", "Move", "apply_move", "write_slot",
           "slot_losers", "filled_order", "empty_slots", "filled_rows", "compacted", "EMPTY"]


def empty_rows(batch: int, heads: int, head_dim: int, dtype: mx.Dtype):
    """Zero-length keys, values, positions and a zero ``next_pos`` for a fresh state."""
    return (mx.zeros((batch, heads, 0, head_dim), dtype), mx.zeros((batch, heads, 0, head_dim), dtype),
            mx.zeros((batch, heads, 0), mx.int32), mx.zeros((batch, heads), mx.int32))


def new_positions(next_pos: Int[Array, "b h"], s: int) -> Int[Array, "b h s"]:
    """Absolute positions of ``s`` new tokens."""
    if s == 1:  # a decode step: next_pos itself (no add)
        return next_pos[:, :, None]
    return next_pos[:, :, None] + _const("arange", s)


def _const(kind: str, *args: int) -> mx.array:
    """Small static index arrays, built once in NumPy: constants to ``mx.compile`` rather than
    a chain of primitives run at every call (each costs microseconds on a decode step)."""
    return cached_const((kind, *args), lambda: _build_const(kind, *args))


def _build_const(kind: str, *args: int) -> np.ndarray:
    if kind == "arange":
        return np.arange(args[0], dtype=np.int32)
    if kind == "base":  # row offsets of [b, h] blocks of n rows: [b, h, 1]
        b, h, n = args
        return (np.arange(b * h, dtype=np.int32) * n).reshape(b, h, 1)
    if kind == "append":  # flat rows of [b, h] blocks of n rows, each followed by s copies of its last
        b, h, n, s = args
        rows = np.minimum(np.arange(n + s), n - 1)[None, :] + (np.arange(b * h) * n)[:, None]
        return rows.reshape(-1).astype(np.int32)
    n, n_sink, recent = args  # "protected"
    i = np.arange(n)
    return (i < n_sink) | ((i >= n - recent) if recent else False)


def protected(n: int, n_sink: int, recent: int = 0) -> Bool[Array, "n"]:
    """Candidate slots never evicted: the first ``n_sink`` and the last ``recent`` of ``n``.

    Slots stand for positions because stored rows are position-sorted and protected tokens
    are never evicted: the sinks always occupy the first slots and the ``recent`` newest
    tokens the last ones (the reference backends test the same rule on positions). A static
    mask also keeps dynamic integer arithmetic out of compiled updates. The mask is a shared
    cached constant: read it, do not assign into it.
    """
    return _const("protected", n, n_sink, recent)


def ranked(scores: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Scores as selections rank them: a non-finite score (NaN, +-inf) becomes ``-inf``, the
    lowest rank (see the module's non-finite rule)."""
    return mx.where(mx.isfinite(scores), scores, -mx.inf)


def top_budget(scores: Float[Array, "b h n"], budget: int,
               protect: Bool[Array, "... n"] | None = None) -> Int[Array, "b h k"] | None:
    """Indices of the ``budget`` highest-scoring candidates, ascending; ``None`` keeps all.

    Non-finite scores rank lowest (:func:`ranked`); protected candidates score ``+inf``;
    callers guarantee they number fewer than ``budget``. When exactly one candidate goes (a
    decode step at a full cache) the loser is an argmin (its first occurrence: the older of
    equal scores goes), otherwise a partition.
    """
    n = scores.shape[-1]
    if n <= budget:
        return None
    scores = ranked(scores)
    if protect is not None:
        scores = mx.where(protect, mx.inf, scores)
    if n == budget + 1:
        return all_but(mx.argmin(scores, axis=-1, keepdims=True).astype(mx.int32), budget)
    key = order_key(scores)  # ties: the newer token ranks higher
    idx = mx.argpartition(-key, kth=budget - 1, axis=-1)[..., :budget]
    return mx.sort(idx.astype(mx.int32), axis=-1)


def row_offsets(b: int, h: int, n: int) -> Int[Array, "b h 1"]:
    """Offset of each ``[b, h]`` block of ``n`` rows in the flattened ``[b * h * n]`` row axis:
    ``index + row_offsets(b, h, n)`` addresses rows of a ``reshape(b * h * n, ...)`` array.
    A shared cached constant: read it, do not assign into it."""
    return _const("base", b, h, n)


def all_but(drop: Int[Array, "... 1"], k: int) -> Int[Array, "... k"]:
    """Ascending indices of ``k + 1`` candidates with candidate ``drop`` left out."""
    i = _const("arange", k)
    return i + (i >= drop).astype(mx.int32)


def take_rows(x: Shaped[Array, "b h n *rest"], idx: Int[Array, "b h k"] | None) -> Shaped[Array, "b h k *rest"]:
    """Gather rows along the token axis (axis 2); ``idx=None`` returns ``x`` unchanged."""
    if idx is None:
        return x
    b, h, n = x.shape[:3]
    rest = x.shape[3:]
    k = idx.shape[-1]
    base = row_offsets(b, h, n)
    flat = mx.take(x.reshape(b * h * n, *rest), (idx + base).reshape(-1), axis=0)
    return flat.reshape(b, h, k, *rest)


# Rows of at most this many values per token are narrow (positions, scores): keep_rows moves
# them by shifted views rather than a gather, and append_rows concatenates them.
_SHIFT_MAX = 16


def append_rows(a: Shaped[Array, "b h n *rest"], x: Shaped[Array, "b h s *rest"]) -> Shaped[Array, "b h ns *rest"]:
    """``a ++ x`` along the token axis (axis 2).

    On the CPU, for wide rows (keys, values) and a few new rows, this is a gather of ``a``'s
    rows into the longer array (its last row repeated into the new slots) and an in-place
    write of ``x`` there: MLX's CPU concatenation copies ~2x slower than its row gather.
    Otherwise (other devices, narrow rows, an empty ``a``, more new rows than old, mixed
    dtypes, a gather index over a quarter of :data:`CONST_BYTES`) a concatenation.
    """
    n, s = a.shape[2], x.shape[2]
    rest = a.shape[3:]
    b, h = a.shape[:2]
    if (mx.default_device() != mx.cpu or n == 0 or s == 0 or s > n or a.dtype != x.dtype
            or math.prod(rest) <= _SHIFT_MAX or 4 * b * h * (n + s) > CONST_BYTES // 4):
        return mx.concatenate([a, x], axis=2)
    out = mx.take(a.reshape(b * h * n, *rest), _const("append", b, h, n, s), axis=0)
    start = mx.array([0, 0, n] + [0] * len(rest))
    return mx.slice_update(out.reshape(b, h, n + s, *rest), x, start, axes=tuple(range(a.ndim)))


dims = dims_of("keys")  # (batch, kv_heads, head_dim, dtype) of a state storing keys [b, h, n, d]


def keep_rows(stored: tuple, new: tuple, idx: Int[Array, "b h k"] | None, pad: int = 0) -> tuple:
    """Rows ``idx`` of each ``stored ++ new`` pair (token axis 2); ``None`` keeps all. With
    ``pad``, the last ``pad`` entries of ``idx`` are not kept rows but empty slots to come
    (they gather candidate 0; the caller marks them, :class:`Move`).

    A decode step (one new token) never concatenates the candidates of a large array: it
    gathers from the stored rows alone and writes the new row into the last slot when it is
    kept (the newest kept token is always last). The flat gather index is built once for
    every array, and with one loser the last slot's other choice is the last stored row (a
    static slice), so nothing but the slot write references the gathered buffer and the write
    happens in place (MLX donates a buffer only it holds). Chunks append, then gather.

    With one loser, arrays of a few values per token (positions, scores) are instead two
    shifted views and a select: slot ``i`` holds candidate ``i`` or ``i + 1``. A gather moves
    one index per value, which for such arrays costs far more than the select's fused loop.
    """
    n, s = stored[0].shape[2], new[0].shape[2]
    if idx is None:
        return tuple(append_rows(a, x) for a, x in zip(stored, new))
    b, h, k = idx.shape
    if any(math.prod(a.shape[3:]) == 0 for a in stored):  # rows of no values: nothing to move
        # (and no op on empty arrays: MLX's compiled CUDA kernels fault on them)
        return tuple(mx.zeros((b, h, k) + a.shape[3:], a.dtype) if math.prod(a.shape[3:]) == 0
                     else keep_rows((a,), (x,), idx)[0] for a, x in zip(stored, new))
    if s > 1 or n == 0:
        return tuple(take_rows(append_rows(a, x), idx) for a, x in zip(stored, new))
    base = row_offsets(b, h, n)
    flat = (mx.minimum(idx, n - 1) + base).reshape(-1)
    last = k - pad  # the slot of the newest kept candidate, plus one
    new_kept = idx[:, :, last - 1:last] == n
    same = idx == _const("arange", k) if k == n and not pad else None  # slot i holds candidate i
    out = []
    for a, x in zip(stored, new):
        rest = a.shape[3:]
        trailing = (1,) * len(rest)
        if same is not None and math.prod(rest) <= _SHIFT_MAX:
            shifted = mx.concatenate([a[:, :, 1:], x], axis=2)
            out.append(mx.where(same.reshape(same.shape + trailing), a, shifted))
            continue
        kept = mx.take(a.reshape(b * h * n, *rest), flat, axis=0).reshape(b, h, k, *rest)
        # the last slot holds the new row when it is kept, else stored row idx[k-1]: with one
        # loser (k == n) that is the last stored row, a static slice; else gathered on its own
        other = (a[:, :, n - 1:] if k == n and not pad
                 else take_rows(a, mx.minimum(idx[:, :, last - 1:last], n - 1)))
        cond = new_kept.reshape(new_kept.shape + trailing)
        start = mx.array([0, 0, last - 1] + [0] * len(rest))
        out.append(mx.slice_update(kept, mx.where(cond, x, other), start, axes=tuple(range(a.ndim))))
    return tuple(out)


# --- slots ----------------------------------------------------------------------------------

EMPTY = -1  # the position of an empty slot
# The empty slots a prefill-bounded method's decode step adds when none is left (a state
# type made with grows=True; see the module): a sixteenth of its slots, at least GROW_MIN,
# so the held but empty slots stay within 1/16 of the rows (or GROW_MIN) and the copy that
# grows them costs about 16 rows a step.
GROW_MIN = 16
GROW_FRACTION = 16


def grow_by(n: int) -> int:
    """The empty slots a decode step adds to a prefill-bounded state of ``n`` slots, none
    empty."""
    return max(GROW_MIN, n // GROW_FRACTION)


def empty_slots(state) -> int:
    """Empty slots of a state (its static ``empty`` field; 0 for states without one)."""
    return getattr(state, "empty", 0)


def filled_order(positions: Int[Array, "b h n"], empty: int = 0) -> Int[Array, "b h f"] | None:
    """Slots of the ``n - empty`` filled slots in increasing position (empty slots, at
    position -1, sort first and are left out)."""
    return mx.argsort(positions, axis=-1)[..., empty:].astype(mx.int32)


def compacted(state, carry: tuple[str, ...] = ()):
    """``state`` with its filled slots gathered in increasing position (keys, values,
    positions and the ``carry`` per-token fields) and no empty slot."""
    order = filled_order(state.positions, empty_slots(state))
    fields = {name: take_rows(getattr(state, name), order)
              for name in ("keys", "values", "positions", *carry)}
    if hasattr(state, "empty"):
        fields["empty"] = 0
    return state._replace(**fields)


def write_slot(a: Shaped[Array, "b h n *rest"], x: Shaped[Array, "b h 1 *rest"],
               slot: Int[Array, "b h 1"] | int, write: Bool[Array, "b h 1"] | None = None) -> Shaped[Array, "b h n *rest"]:
    """``a`` with row ``x`` written at ``slot`` of each ``[b, h]`` row (where ``write`` holds;
    elsewhere the slot keeps its row; an ``int`` slot: the same slot in every row, written
    by one slice update). Rows of values (keys, values): a scatter into ``a``,
    which MLX writes in place when nothing else holds ``a``'s buffer (the state being
    replaced), so the step moves one row. One value per slot (``a [b, h, n]``): a select."""
    rest = a.shape[3:]
    if math.prod(rest) == 0:  # rows of no values: nothing to move
        return a
    if isinstance(slot, int):  # the same slot in every row (an empty slot filled): in place,
        # a slice update at a static start (one launch on a GPU; mx.slice_update's start is an
        # array, one more), written into a new handle of a's node (a itself is not changed)
        out = mx.array(a)
        out[:, :, slot:slot + 1] = x.astype(a.dtype)
        return out
    if not rest:  # one value per slot (positions, a carried score): a select over the row, whose
        # one fused pass costs less than a gather and a scatter (2-3% of TOVA's and H2O's CPU
        # decode update at SmolLM2's shape; the same values)
        hit = mx.arange(a.shape[2], dtype=slot.dtype) == slot
        return mx.where(hit if write is None else hit & write, x.astype(a.dtype), a)
    idx = slot.reshape(slot.shape + (1,) * len(rest))
    x = x.astype(a.dtype)
    if write is not None:
        old = mx.take_along_axis(a, idx, axis=2)
        x = mx.where(write.reshape(write.shape + (1,) * len(rest)), x, old)
    return mx.put_along_axis(a, idx, x, axis=2)


def apply_move(move: Move, stored: Sequence[mx.array], new: Sequence[mx.array]) -> tuple:
    """The per-token arrays ``stored`` (``[b, h, n, ...]``, slot order) after ``move``, the
    step's ``new`` rows (``[b, h, s, ...]``) placed as it says (the rows of ``move.pad``
    empty slots hold a copy of candidate 0's)."""
    if move.slot is not None:
        return tuple(write_slot(a, x, move.slot, move.write) for a, x in zip(stored, new))
    if move.pre is not None:
        stored = tuple(take_rows(a, move.pre) for a in stored)
    return keep_rows(tuple(stored), tuple(new), move.idx, move.pad)


def _mono(scores: Float[Array, "..."]) -> Int[Array, "..."]:
    """float32 bits made monotone, as int64 (``velox.ordering``)."""
    bits = mx.view(scores.astype(mx.float32), mx.int32)
    return mx.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(mx.int64)


def slot_losers(scores: Float[Array, "b h N"], cand_pos: Int[Array, "b h N"], total: Int[Array, "b h 1"],
                drop: int, n_sink: int, recent: int) -> Bool[Array, "b h N"] | Int[Array, "b h 1"]:
    """The ``drop`` losers of candidates in any order, by position: the lowest scores
    (:func:`ranked`), the older of equal scores first; sinks (position below ``n_sink``) and
    the ``recent`` newest of ``total`` tokens never go. ``drop == 1``: the loser's index
    ``[b, h, 1]``; else a mask ``[b, h, N]`` of the ``drop`` losers."""
    protect = cand_pos < n_sink
    if recent:
        protect = protect | (cand_pos >= total - recent)
    r = mx.where(protect, mx.inf, ranked(scores))
    if drop == 1:
        low = r.min(axis=-1, keepdims=True)
        tied = mx.where(r == low, cand_pos, np.iinfo(np.int32).max)
        return mx.argmin(tied, axis=-1, keepdims=True).astype(mx.int32)
    key = _mono(r) * (1 << 31) + cand_pos.astype(mx.int64)  # unique: (score, position)
    kth = mx.partition(key, drop - 1, axis=-1)[..., drop - 1:drop]
    return key <= kth


def row_sq_norms(x: Float[Array, "... d"]) -> Float[Array, "..."]:
    """Squared L2 norm of every row (last axis), in float32.

    On the CPU this is a matrix-vector product with ones (one BLAS call, ~3x faster than MLX's
    reduction over short last-axis rows at d=128); elsewhere a plain reduction, which keeps the
    sums out of reduced-precision (TF32) matmuls on GPUs.
    """
    x = x.astype(mx.float32)
    if mx.default_device() == mx.cpu:
        return (mx.square(x) @ mx.ones((x.shape[-1], 1), mx.float32))[..., 0]
    return mx.square(x).sum(axis=-1)


def row_norms(x: Float[Array, "... d"]) -> Float[Array, "..."]:
    """L2 norm of every row (last axis), in float32 (see :func:`row_sq_norms`)."""
    return mx.sqrt(row_sq_norms(x))


def cuda_update(mlx_update, capacity, decode_step):
    """The ``cuda`` backend's update for a per-step evictor (kernels in ``velox.kernels.evict``).

    A decode step at a full cache (one new token, ``capacity(state)`` rows stored) runs
    ``decode_step(state, keys, values, queries)``, the method's fused kernels. Every other
    call (prefill, chunks, a cache still filling) is a step the kernels do not cover and runs
    ``mlx_update``, the vectorised MLX ops of the ``mlx`` backend, on the same GPU; so does a
    state holding one shard of its layer's kv heads (``velox.distributed``) whose selection is
    shared by the heads (``per_head`` false): the kernels average the heads they hold.
    """
    def update(state, keys, values, queries):
        if (keys.shape[2] != 1 or state.keys.shape[2] != capacity(state)
                or (not getattr(state, "per_head", True) and getattr(state, "heads", LOCAL).shards > 1)):
            return mlx_update(state, keys, values, queries)
        return decode_step(state, keys, values, queries)

    return update


def with_compacted(state, out: Sequence[mx.array], carried: str = "scores"):
    """``state`` holding the outputs of ``velox.kernels.evict.compact``: keys, values,
    positions, next_pos (and the carried per-token data, in the field ``carried``)."""
    fields = dict(keys=out[0], values=out[1], positions=out[2], next_pos=out[3])
    if len(out) > 4:
        fields[carried] = out[4]
    return state._replace(**fields)


# --- the score-and-keep skeleton, written once for every backend -------------------------

class Scored(NamedTuple):
    """What a rule's score returns: the candidates' ``scores`` (``None`` when nothing is
    evicted and the rule needs none) and new values of state fields (``updates``): the
    rule's carried per-token fields over the ``n + s`` candidates (an array, or a
    ``(stored, new)`` pair), and any other field it refreshes."""

    scores: Any
    updates: dict


def _scored(out) -> Scored:
    if isinstance(out, Scored):
        return out
    if isinstance(out, tuple):
        return Scored(*out)
    return Scored(out, {})


class _Plan(NamedTuple):
    """What a spec says of a score-and-keep method: capacity, protected tokens, when it
    evicts, whether a batch row's heads share one selection, its slots and slack."""

    capacity: Callable
    sinks: Callable
    recent: Callable
    prefill_only: bool
    shared: Callable
    slots: bool
    slack: Callable
    heads: Callable = lambda state: getattr(state, "heads", LOCAL)  # noqa: E731  (velox.distributed)


def _getter(expr: str | None, default: int = 0) -> Callable:
    """``state -> value`` of a spec expression over state fields (``"budget"``,
    ``"n_sink + window_size"``), compiled once."""
    if expr is None:
        return lambda state: default
    if expr.isidentifier():
        return operator.attrgetter(expr)
    code = compile(expr, "<spec>", "eval")
    names = code.co_names
    env = {"__builtins__": {"min": min, "max": max}}
    return lambda state: eval(code, env, {n: getattr(state, n) for n in names if n not in ("min", "max")})


def _plan(spec) -> _Plan:
    c = spec.contract
    head = c.get("head_independent", True)
    if head is True:
        shared = lambda state: False  # noqa: E731
    elif head is False:
        shared = lambda state: True  # noqa: E731
    else:  # the name of the bool parameter that gives every head its own selection
        shared = lambda state, name=head: not getattr(state, name)  # noqa: E731
    slots = c.get("slots", "slots")
    if slots not in ("slots", "sorted"):
        raise ValueError(f"{spec.key}: contract.slots={slots!r} must be 'slots' or 'sorted'")
    return _Plan(capacity=_getter(c["capacity"]), sinks=_getter(c.get("sinks")),
                 recent=_getter(c.get("recent")), prefill_only=c.get("bound_phase") == "prefill",
                 shared=shared, slots=slots == "slots", slack=_getter(c.get("slack")))


def _evicting(plan: _Plan, state, filled: int, s: int) -> bool:
    return filled + s > plan.capacity(state) + plan.slack(state) and (s > 1 or not plan.prefill_only)


def _protected_index(n: int, n_sink: int, recent: int) -> np.ndarray:
    return np.flatnonzero(_build_const("protected", n, n_sink, recent)).astype(np.int32)


def _sorts_chunks(plan: _Plan, state, n: int, s: int) -> bool:
    """Whether this update first gathers the filled slots in increasing position: a
    multi-token step of a slot method over stored rows, or a decode step of a state holding
    more than its capacity (a budget lowered since: SqueezeAttention's reallocation), which
    keeps ``capacity`` in one gather (a prefill-bounded method's filled slots are always
    sorted, its decode steps appending; a chunk step drops the empty slots its decode steps
    grew)."""
    if not plan.slots or n == 0:
        return False
    if plan.prefill_only:  # sorted already: a chunk step drops the empty slots a decode grew
        return s > 1 and empty_slots(state) > 0
    return s > 1 or n - empty_slots(state) > plan.capacity(state) + plan.slack(state)


def _grows(plan: _Plan, state, seen, s: int) -> bool:
    """Whether a decode step of a prefill-bounded method first adds empty slots: a
    state type that grows (``empty``), none empty, plain rows (not a composition's codes),
    not ragged."""
    return (plan.prefill_only and plan.slots and s == 1 and hasattr(state, "empty")
            and state.empty == 0 and not getattr(state, "ragged", False)
            and isinstance(state.keys, mx.array) and isinstance(seen.keys, mx.array))


def _grown(state, carry: tuple[str, ...]):
    """``state`` with :func:`grow_by` empty slots after its rows (zero rows, position
    ``EMPTY``, zero carried scores): one copy of the rows per growth, as mlx-lm's ``KVCache``
    grows its buffers."""
    grow = grow_by(state.keys.shape[2])

    def pad(a, fill):
        extra = mx.full(a.shape[:2] + (grow,) + a.shape[3:], fill, a.dtype)
        return mx.concatenate([a, extra], axis=2)
    fields = {name: pad(getattr(state, name), 0) for name in ("keys", "values", *carry)}
    return state._replace(positions=pad(state.positions, EMPTY), empty=grow, **fields)


@dataclass(frozen=True, eq=False)
class ScoreKernel:
    """The ``cuda`` backend's scores of a score-and-keep method at a decode step of a full
    cache (:func:`score_and_keep`'s ``kernel``).

    Attributes:
        inputs: ``inputs(state, keys, values, queries) -> dict``: ``by=`` the candidates'
            scores, ``carry=`` the carried field over them, ``profiles=`` MorphKV's (stored,
            new column), ``drop=`` a fixed loser; with ``attends``, also called with
            ``attend=True`` and then gives ``out=``, the step's attention output.
        attends: ``inputs`` computes the attention output with the scores.
        select_args: ``state -> dict | None``: the arguments of the one-launch step
            (``velox.kernels.evict.attend_select``: which score it ranks by), or ``None``
            where the method's step does not fit it.
    """

    inputs: Callable[..., dict]
    attends: bool = False
    select_args: Callable[[Any], dict | None] | None = None


def score_and_keep(score: Callable | None, reference: Callable | None, *,
                   kernel: ScoreKernel | None = None, carry: tuple[str, ...] = (),
                   fields: tuple[str, ...] = (), logits_only: bool = False) -> Callable:
    """The backends of a score-and-keep eviction method, built from its score.

    Every update appends the ``s`` new rows to the ``n`` stored ones, and when the method
    evicts (its spec: ``n + s`` over ``contract.capacity`` plus ``contract.slack``; every
    update, or multi-token chunks only when ``contract.bound_phase = "prefill"``) keeps the
    ``capacity`` best-scoring candidates, the protected ones always (the first
    ``contract.sinks`` positions and the ``contract.recent`` newest), with the tie and
    non-finite rules of :func:`top_budget`. Rows live in slots (see the module): a decode step
    writes the new row into the loser's slot (:func:`slot_losers`; with slack, the freed slots
    empty and later tokens fill them), a multi-token step gathers the survivors in increasing
    position; ``contract.slots = "sorted"`` keeps every step in increasing position. Where the
    spec's ``head_independent`` names a bool parameter (``"per_head"``), a batch row's heads
    share one selection when it is false: the mean of their scores. Positions, ``next_pos``,
    the append, the slot write and the gather are written here, once. A score must not depend
    on the order of the stored rows at decode (attention over them, per-token values).

    Args:
        score: the ``mlx`` score, ``score(state, keys, values, queries, evicting) -> scores
            [b, h, n + s]`` (vectorised MLX) or ``(scores, updates)`` (see :class:`Scored`).
            Called when the update evicts, and on every update when the method carries or
            refreshes fields. ``None``: the protected slots alone are kept (a fixed index).
        reference: the ``reference`` score of one head, ``reference(state, head) -> scores
            [N]`` or ``(scores, updates)`` (NumPy, float64: the executable spec; ``head`` is a
            :class:`velox.reference.Head`, whose ``carried`` holds the head's values of the
            ``carry`` and ``fields`` fields, float64). Called on the same updates as ``score``;
            its updates are per head (``[N, ...]`` for carried fields, the field's per-head
            shape for the others). ``None`` with ``score=None``.
        kernel: the ``cuda`` backend's input for a decode step at a full cache, a
            :class:`ScoreKernel` whose ``inputs(state, keys, values, queries) -> dict`` gives
            ``by=`` the scores (from
            ``velox.kernels.evict.weights`` or MLX ops), ``carry=`` the carried field over the
            candidates, ``profiles=`` MorphKV's (stored, new column); ``drop=`` (a fixed loser)
            is the protected-tokens rule itself. The loser and the slot write are MLX ops, as
            on the ``mlx`` backend. Default (when the spec lists ``cuda``): ``by`` the ``mlx``
            score. Every other call runs the ``mlx`` backend on the GPU.
        carry: state fields of per-token data kept with the rows (``[b, h, n, ...]``): H2O's
            accumulated attention, KVzip's running maximum, MorphKV's votes. The score's
            updates hold their values over the candidates.
        fields: other state fields the score's updates refresh every update (Q-Filters'
            running filters).
        logits_only: both scores read the stored keys only as attention logits, through
            ``velox.attention`` (``candidate_logits``, ``candidate_weights``,
            ``candidate_mass``; one head: ``head_weights``). The state's ``keys`` may then be
            :class:`velox.attention.CodedKeys` (a composition's, ``velox.compose``): the
            skeleton appends and gathers their decoded ``rows``, the scores see the codes
            (the ``reference`` score one head's NumPy codes, its ``Head.keys``) and so read
            the codec's logit estimates. Without it a score sees the decoded rows.

    Returns:
        ``spec -> {backend: Backend}``, for :func:`velox.registry.register`'s ``backends``
        (:class:`velox.backend.Backend` records): the ``reference`` and ``mlx`` ones with
        ``logits_only`` (read by :func:`scores_by_logits`), every one with ``slots`` (read by
        the registry: ``get_kv``, ``positions`` and ``kv_slots`` of a state of slots) and
        ``with_move(state, keys, values, queries) -> (state, Move)`` (how the rows moved:
        compositions follow it, the decode step defers the slot write); the ``mlx`` one with
        ``skeleton``, this ``spec ->`` function (the contract suite builds the ``"sorted"``
        twin with it).
    """
    if kernel is not None and not isinstance(kernel, ScoreKernel):
        raise TypeError(f"score_and_keep: kernel must be a velox.evict.ScoreKernel, got {type(kernel).__name__}")
    if score is None and (carry or fields or reference is not None):
        raise ValueError("a rule without a score keeps the protected slots only: it carries nothing")

    def build(spec) -> dict[str, Callable]:
        plan = _plan(spec)
        mlx_update = _mlx_backend(score, carry, fields, plan, logits_only)
        out = {"reference": _reference_backend(reference, carry, fields, plan, logits_only),
               "mlx": mlx_update}
        if "cuda" in spec.backends:
            out["cuda"] = _cuda_update(mlx_update, plan,
                                       _kernel_step(score, kernel, carry, fields, plan))
        # the backends of another spec (tests: contract.slots)
        out["mlx"] = dataclasses.replace(mlx_update, skeleton=build)
        return out

    return build


def scores_by_logits(method) -> bool:
    """Whether ``method`` (a registered method) is a score-and-keep method whose scores read
    the stored keys only as attention logits (:func:`score_and_keep`'s ``logits_only``): its
    state's ``keys`` may be :class:`velox.attention.CodedKeys`."""
    return all(b in method.backends and method.backends[b].logits_only for b in ("reference", "mlx"))


def _rows_and_scored(state, logits_only: bool) -> tuple:
    """``(state with rows as keys, state the score reads)``: a state whose ``keys`` are
    :class:`CodedKeys` holds their decoded rows for the skeleton; its score sees the codes
    when it reads keys only as logits, else the rows."""
    if not isinstance(state.keys, CodedKeys):
        return state, state
    rows = state._replace(keys=state.keys.rows)
    return rows, (state if logits_only else rows)


def _slot_step(plan: _Plan, state, n: int, s: int, evicting: bool) -> bool:
    """Whether a decode step works in place: it evicts from a full state of slots (exactly
    ``capacity + slack`` tokens) or fills an empty slot."""
    if not plan.slots or s != 1:
        return False
    empty = empty_slots(state)
    if evicting:
        return n - empty == plan.capacity(state) + plan.slack(state)
    return empty > 0


def _compacted_pair(state, seen, carry):
    """``(state, seen)`` with the filled slots gathered in increasing position. A state whose
    keys are :class:`CodedKeys` (a composition's) arrives compacted: ``velox.compose``
    gathers its codes first."""
    if isinstance(seen.keys, CodedKeys) or isinstance(state.keys, CodedKeys):
        if empty_slots(state):
            raise ValueError("a composed state reaches a chunk step with empty slots")
        return state, seen
    state = compacted(state, carry)
    return state, state


def _decode_slot(plan: _Plan, state, scores, new_pos) -> tuple[Move, mx.array]:
    """A decode step at a full state of slots (none empty): the loser(s) and where the new
    row goes; the positions with the freed slots emptied (slack)."""
    b, h, n = state.positions.shape
    slack, sinks, recent = plan.slack(state), plan.sinks(state), plan.recent(state)
    # with recent tokens protected (and one loser) the newest candidate never loses: the
    # loser is a stored slot and the new row always takes it (the same choice, fewer ops: no
    # candidate positions joined, no "the new token lost" case to write around)
    stored_only = slack == 0 and recent > 0
    cand = state.positions if stored_only else mx.concatenate([state.positions, new_pos], axis=2)
    if scores is None:  # a rule without a score: only the protected tokens stay
        scores = mx.zeros((b, 1, cand.shape[2]), mx.float32)
    elif stored_only:
        scores = scores[..., :n]
    total = state.next_pos[:, :, None] + 1
    if plan.shared(state):  # every kv head of the layer, those of other shards too
        scores = head_gather(plan.heads(state), scores)
    if plan.shared(state) or scores.shape[1] == 1:  # one selection for the row
        scores = scores.mean(axis=1, keepdims=True) if scores.shape[1] > 1 else scores
        cand, total = cand[:, :1], total[:, :1]
    if slack == 0:
        loser = mx.broadcast_to(slot_losers(scores, cand, total, 1, sinks, recent), (b, h, 1))
        if stored_only:
            return Move(slot=loser), state.positions
        write = loser < n
        return Move(slot=mx.where(write, loser, 0), write=write), state.positions
    # amortized: the slack + 1 losers go and the kept rows are gathered to the first slots,
    # in slot order (the new token, when kept, last of them), the freed slots last: the next
    # slack tokens fill them in order at a static slot (a slice update, no index), and the
    # filled slots are a prefix (attention reads a view, no mask)
    lose = slot_losers(scores, cand, total, slack + 1, sinks, recent)
    i = _const("arange", n + 1)
    order = mx.argsort(mx.where(lose, i + (n + 1), i), axis=-1)[..., :n - slack].astype(mx.int32)
    idx = mx.concatenate([order, mx.zeros(order.shape[:2] + (slack,), mx.int32)], axis=-1)
    return Move(idx=mx.broadcast_to(idx, (b, h, n)), pad=slack), state.positions


def _place(plan: _Plan, state, keys, values, scored: Scored, carry, evicting: bool):
    """The slot step of a decode update (``s == 1``) that evicts or fills an empty slot:
    ``(move, stored, new, empty)`` for :func:`apply_move`."""
    new_pos = new_positions(state.next_pos, 1)
    empty = empty_slots(state)
    positions = state.positions
    if evicting:
        move, positions = _decode_slot(plan, state, scored.scores, new_pos)
        empty = plan.slack(state)
    else:  # the first empty slot: the empty slots are the last ones (_decode_slot)
        move = Move(slot=state.positions.shape[2] - empty)
        empty -= 1
    stored, new = [state.keys, state.values, positions], [keys, values, new_pos]
    n = state.positions.shape[2]
    for name in carry:
        both = scored.updates.get(name)
        if both is None:  # not refreshed (rows of no values): kept as stored
            a = getattr(state, name)
            x = mx.zeros((a.shape[0], a.shape[1], 1) + a.shape[3:], a.dtype)
        else:
            a, x = both if isinstance(both, tuple) else (both[:, :, :n], both[:, :, n:])
        stored.append(a)
        new.append(x)
    return move, stored, new, empty


def _moved(move: Move, stored: list, new: list) -> tuple:
    """:func:`apply_move` of a slot step's arrays (keys, values, positions, carried), the
    positions of the empty slots an amortized selection leaves (``move.pad``) at ``EMPTY``."""
    out = apply_move(move, stored, new)
    if not move.pad:
        return out
    n = out[2].shape[2]
    filled = _const("arange", n) < n - move.pad
    return (*out[:2], mx.where(filled, out[2], EMPTY), *out[3:])


def _finish(state, out, carry, refreshed: dict, s: int, empty: int | None):
    kept = dict(zip(carry, out[3:]))
    kept.update(refreshed)
    if hasattr(state, "empty"):
        kept["empty"] = empty
    return state._replace(keys=out[0], values=out[1], positions=out[2],
                          next_pos=state.next_pos + s, **kept)


def _mlx_backend(score, carry, fields, plan: _Plan, logits_only: bool = False) -> Callable:
    def step(state, keys, values, queries):
        state, seen = _rows_and_scored(state, logits_only)
        n, s = state.keys.shape[2], keys.shape[2]
        if _sorts_chunks(plan, state, n, s):
            state, seen = _compacted_pair(state, seen, carry)
            n = state.keys.shape[2]
        if _grows(plan, state, seen, s):
            state = seen = _grown(state, carry)
            n = state.keys.shape[2]
        empty = empty_slots(state)
        evicting = _evicting(plan, state, n - empty, s)
        scored = Scored(None, {})
        if score is not None and (evicting or carry or fields):
            scored = _scored(score(seen, keys, values, queries, evicting))
        refreshed = {name: scored.updates[name] for name in fields}
        if _slot_step(plan, state, n, s, evicting):
            move, stored, new, empty = _place(plan, state, keys, values, scored, carry, evicting)
            out = _moved(move, stored, new)
            return _finish(state, out, carry, refreshed, s, empty), move
        idx = None
        if evicting:
            b, h = state.positions.shape[:2]
            if score is None:
                keep = cached_const(("kept", n + s, plan.sinks(state), plan.recent(state)),
                                    lambda: _protected_index(n + s, plan.sinks(state), plan.recent(state)))
                idx = mx.broadcast_to(keep, (b, h) + keep.shape)
            else:
                scores = scored.scores
                if plan.shared(state):  # one selection for the row, shared by every head
                    scores = head_gather(plan.heads(state), scores).mean(axis=1, keepdims=True)
                idx = top_budget(scores, plan.capacity(state),
                                 protected(n + s, plan.sinks(state), plan.recent(state)))
                idx = mx.broadcast_to(idx, (b, h) + idx.shape[2:])
        stored = [state.keys, state.values, state.positions]
        new = [keys, values, new_positions(state.next_pos, s)]
        for name in carry:
            both = scored.updates[name]
            a, x = both if isinstance(both, tuple) else (both[:, :, :n], both[:, :, n:])
            stored.append(a)
            new.append(x)
        move = Move(idx=idx)
        out = keep_rows(tuple(stored), tuple(new), idx)
        return _finish(state, out, carry, refreshed, s, 0), move

    def update(state, keys, values, queries):
        return step(state, keys, values, queries)[0]

    def fill(state, keys, values):
        """A decode step into an empty slot (amortized eviction's steps between selections)
        of a rule that scores nothing there: the new row, its position and ``next_pos + 1``
        written at the first empty slot (the same slot in every row: slice updates in place),
        no score; ``None`` where the step is another (:func:`_fillable`)."""
        if not _fillable(plan, state, keys):
            return None
        i = state.keys.shape[2] - state.empty  # _place's slot and values, written directly
        nxt = state.next_pos
        positions = mx.array(state.positions)  # a new handle: the state's array is not changed
        positions[:, :, i] = nxt
        return state._replace(keys=write_slot(state.keys, keys, i), values=write_slot(state.values, values, i),
                              positions=positions, next_pos=nxt + 1, empty=state.empty - 1)

    quiet = not (carry or fields)  # the rule scores nothing between selections: fill steps
    return Backend(update, with_move=step, ragged=ragged(update), slots=plan.slots,
                   logits_only=logits_only, fill=fill if quiet else None,
                   fill_attention=fill_attention if quiet else None)


def fill_attention(state, filled, queries, keys, values, scale):
    """The attention of a step into an empty slot (``filled = fill(state, keys, values)``) on
    an NVIDIA GPU: ``queries [b, qh, 1, d]`` over ``state``'s filled slots and the new row at
    ``scale``, in one pass of ``velox.kernels.evict.attend`` over ``filled``'s buffers in
    place (no copy of the filled prefix); ``None`` on another device or where the kernel
    does not take the shapes (the caller attends with MLX)."""
    if not _on_cuda():
        return None
    from .kernels.evict import attend, attend_supports
    b, h, n, d = filled.keys.shape
    if (queries.shape[2] != 1 or queries.shape[1] % h or keys.shape != (b, h, 1, d)
            or not attend_supports(d, queries.shape[1] // h)):
        return None
    return attend(queries, filled.keys, filled.values, keys, values, rows=n - empty_slots(state), scale=scale)


def _on_cuda() -> bool:
    """Whether MLX computes on a GPU whose kernels run now: an NVIDIA GPU, or an Apple GPU
    whose Metal kernels passed the self-check (``velox.backend.gpu_kernels``)."""
    return gpu_kernels()


def _fillable(plan: _Plan, state, keys) -> bool:
    """Whether a step is one token into an empty slot of a state of plain rows (amortized
    eviction between selections)."""
    return (keys.shape[2] == 1 and plan.slots and empty_slots(state) > 0
            and not getattr(state, "ragged", False) and isinstance(state.keys, mx.array)
            and (plan.prefill_only or state.keys.shape[2] == plan.capacity(state) + plan.slack(state)))


def _reference_backend(reference, carry, fields, plan: _Plan, logits_only: bool = False) -> Callable:
    def step(state, keys, values, queries):
        state, seen = _rows_and_scored(state, logits_only)
        n, s = state.keys.shape[2], keys.shape[2]
        if _sorts_chunks(plan, state, n, s):
            if not (isinstance(seen.keys, CodedKeys) or isinstance(state.keys, CodedKeys)):
                state = seen = ref.compacted(state, carry)
            n = state.keys.shape[2]
        if _grows(plan, state, seen, s):
            state = seen = _grown(state, carry)
            n = state.keys.shape[2]
        coded = seen.keys.numpy() if isinstance(seen.keys, CodedKeys) else None
        c = ref.candidates(state, keys, values, queries)
        b, h, N = c.positions.shape
        empty = empty_slots(state)
        evicting = _evicting(plan, state, n - empty, s)
        scores = np.zeros((b, h, N))
        per_head: dict[str, list] = {name: [[None] * h for _ in range(b)] for name in (*carry, *fields)}
        if reference is not None and (evicting or carry or fields):
            old = {name: ref.to_np(getattr(state, name)) for name in (*carry, *fields)}
            for i in range(b):
                for j in range(h):
                    head = ref.head(c, i, j, {k: v[i, j] for k, v in old.items()}, evicting)
                    if coded is not None:  # one head's codes, with its candidates' rows
                        head = head._replace(keys=coded.head(i, j, head.keys))
                    out = _scored(reference(state, head))
                    if out.scores is not None:
                        scores[i, j] = out.scores
                    for name in per_head:
                        per_head[name][i][j] = out.updates[name]
        if evicting and plan.shared(state):
            scores[:] = head_gather(plan.heads(state), scores).mean(axis=1, keepdims=True)
        stacked = {name: np.stack([np.stack(row) for row in rows]) for name, rows in per_head.items()}
        cap, sinks, recent = plan.capacity(state), plan.sinks(state), plan.recent(state)
        if _slot_step(plan, state, n, s, evicting):
            slack = plan.slack(state)
            extra = {name: stacked[name] for name in carry}
            if evicting and slack:
                new, move = ref.amortized(state, c, scores, slack, sinks, recent, **extra)
            else:
                slots = ref.slot_step(scores, c.positions, c.total, n, evicting, sinks, recent)
                new, move = ref.place(state, c, slots, **extra)
            empty = slack if evicting else empty - 1
        else:
            chosen = [[None] * h for _ in range(b)]
            if evicting:
                chosen = [[ref.top_budget(scores[i, j], cap,
                                          ref.protected(c.positions[i, j], c.total[i, j], sinks, recent))
                           for j in range(h)] for i in range(b)]
            new = ref.keep(state, c, chosen, **{name: stacked[name] for name in carry})
            move = ref.gather_move(chosen, n, s)
            empty = 0
        if hasattr(state, "empty"):
            new = new._replace(empty=empty)
        return new._replace(**{name: ref.to_mx(stacked[name], getattr(state, name).dtype)
                               for name in fields}), move

    def update(state, keys, values, queries):
        return step(state, keys, values, queries)[0]

    return Backend(update, with_move=step, ragged=ragged(update), slots=plan.slots,
                   logits_only=logits_only)


def _cuda_update(mlx_update, plan: _Plan, decode_step) -> Callable:
    """The ``cuda`` backend of a score-and-keep method: a decode step at a full state of
    slots (none empty) runs ``decode_step`` (the method's kernels for the scores, MLX ops for
    the loser and the slot write); every other call the ``mlx`` backend, on the same GPU."""
    def update(state, keys, values, queries):
        if not full_decode(state, keys):
            return mlx_update(state, keys, values, queries)
        return decode_step(state, keys, values, queries)

    def full_decode(state, keys) -> bool:
        # a selection shared with other shards' heads gathers their scores: MLX ops (the
        # kernels average the heads they hold)
        return (keys.shape[2] == 1 and not empty_slots(state) and isinstance(state.keys, mx.array)
                and state.keys.shape[2] == plan.capacity(state) + plan.slack(state)
                and not (plan.shared(state) and plan.heads(state).shards > 1))

    def with_attention(state, keys, values, queries):
        """A decode step at a full state with its attention computed in the same kernel as
        its scores: ``(out, state, move)``, ``out [b, qh, 1, d]`` the attention of
        ``queries`` over the stored rows and the new token at scale ``d ** -0.5``; ``None``
        where the step is not one (the caller attends itself)."""
        from .kernels.evict import THREADS, attend_supports
        if (queries is None or queries.shape[2] != 1 or not full_decode(state, keys)
                or THREADS % keys.shape[-1] or queries.shape[1] % keys.shape[1]
                or not attend_supports(keys.shape[-1], queries.shape[1] // keys.shape[1])):
            return None
        return decode_step.with_attention(state, keys, values, queries)

    def with_move(state, keys, values, queries):
        if full_decode(state, keys):
            return decode_step.with_move(state, keys, values, queries)
        return mlx_update.with_move(state, keys, values, queries)

    return Backend(update, with_move=with_move, with_attention=with_attention, slots=plan.slots,
                   fill=mlx_update.fill, fill_attention=mlx_update.fill_attention)


def _kernel_step(score, kernel, carry, fields, plan: _Plan) -> Callable:
    """A decode step at a full state on the ``cuda`` backend: the scores from the method's
    kernel input (``by``, the carried ``carry`` or MorphKV's ``profiles``; ``drop``, a fixed
    loser, is the protected-tokens rule itself), then the loser and the in-place slot write
    of :func:`_place` (MLX ops: a custom kernel's outputs are fresh buffers, so a kernel that
    moves the rows would copy the whole cache)."""
    def inputs(state, keys, values, queries, attend: bool):
        """``(state, by, updates, out)``: the selection scores, the carried fields over the
        candidates and (``attend``) the attention output when the kernel computed it."""
        out = None
        if kernel is None:
            scored = _scored(score(state, keys, values, queries, True))
            state = state._replace(**{name: scored.updates[name] for name in fields})
            by, updates = scored.scores, {name: scored.updates[name] for name in carry}
        else:
            if attend and kernel.attends:
                args = kernel.inputs(state, keys, values, queries, attend=True)
                out = args.get("out")
            else:
                args = kernel.inputs(state, keys, values, queries)
            by, updates = args.get("by"), {}
            if "carry" in args:
                updates[carry[0]] = args["carry"]
            if "profiles" in args:
                old, w = args["profiles"]
                n = old.shape[2]
                stored = mx.concatenate([old[..., 1:], w[:, :, :n, None]], axis=-1)
                fresh = mx.concatenate([mx.zeros(w.shape[:2] + (1, old.shape[3] - 1), old.dtype),
                                        w[:, :, n:, None]], axis=-1)
                updates[carry[0]] = (stored, fresh)
        if isinstance(by, tuple):
            by = mx.concatenate(list(by), axis=2)
        return state, by, updates, out

    def finish(state, keys, values, by, updates):
        move, stored, new, empty = _place(plan, state, keys, values, Scored(by, updates), carry, True)
        rows = _moved(move, stored, new)
        return _finish(state, rows, carry, {}, 1, empty), move

    def step(state, keys, values, queries):
        state, by, updates, _ = inputs(state, keys, values, queries, False)
        return finish(state, keys, values, by, updates)

    def selected(state, keys, values, by, updates):
        """The per-token rule's selection (``slack = 0``) in one launch
        (``velox.kernels.evict.select``): ``(state, Move)``, the move carrying the slot's
        row; ``None`` where the step's inputs do not fit it."""
        from .kernels.evict import select
        b, h, n, _ = state.keys.shape
        if plan.slack(state) or (by is not None and (by.shape != (b, h, n + 1) or by.dtype != mx.float32)):
            return None
        carried = None
        if carry:
            carried = updates.get(carry[0])
            if (len(carry) > 1 or not isinstance(carried, mx.array) or carried.shape != (b, h, n + 1)
                    or carried.dtype != mx.float32 or getattr(state, carry[0]).dtype != mx.float32):
                return None
        if by is None:  # a rule without a score: the protected tokens stay, the oldest other goes
            by = cached_const(("zeros", b, h, n + 1), lambda: np.zeros((b, h, n + 1), np.float32))
        slot, rk, rv, positions, kept = select(
            by, state.positions, state.next_pos, state.keys, state.values, keys, values,
            n_sink=plan.sinks(state), recent=plan.recent(state), shared=plan.shared(state),
            carried=carried)
        return taken(state, positions, state.next_pos + 1, kept), Move(slot=slot, rows=(rk, rv))

    def taken(state, positions, next_pos, kept):
        """``state`` after a one-launch selection took a slot: its positions, next position
        and carried scores (``kept``), no slot empty."""
        new = dict(positions=positions, next_pos=next_pos)
        if carry:
            new[carry[0]] = kept
        if hasattr(state, "empty"):
            new["empty"] = 0
        return state._replace(**new)

    def attended_select(state, keys, values, queries):
        """The whole step in two launches (``velox.kernels.evict.attend_select``: the
        attention output, the weights or carried scores and the per-token rule's selection,
        ``slack = 0``) where the method's kernel says which score it ranks by
        (``kernel.select_args(state)``) or its score comes from MLX ops with nothing carried:
        ``(out, state, Move)``; ``None`` elsewhere."""
        from .kernels.evict import attend_select, attend_select_supports
        b, h, n, d = state.keys.shape
        if (plan.slack(state) or state.positions.dtype != mx.int32 or state.next_pos.dtype != mx.int32
                or not attend_select_supports(h, d, queries.shape[1] // h, plan.shared(state))):
            return None
        if kernel is None:
            if carry or fields:
                return None
            by = _scored(score(state, keys, values, queries, True)).scores
            if by.shape != (b, h, n + 1) or by.dtype != mx.float32:
                return None
            args = dict(by="given", given=by)
        else:
            args = None if kernel.select_args is None else kernel.select_args(state)
            if args is None or bool(args.get("carry")) != bool(carry):
                return None
            if carry and (len(carry) > 1 or getattr(state, carry[0]).dtype != mx.float32):
                return None
        out, slot, rk, rv, positions, next_pos, kept = attend_select(
            queries, state.keys, state.values, keys, values, state.positions, state.next_pos,
            n_sink=plan.sinks(state), recent=plan.recent(state), shared=plan.shared(state), **args)
        if out.dtype != queries.dtype:
            out = out.astype(queries.dtype)
        return out, taken(state, positions, next_pos, kept), Move(slot=slot, rows=(rk, rv))

    def with_attention(state, keys, values, queries):
        from .kernels.evict import attend_weights
        done = attended_select(state, keys, values, queries)
        if done is not None:
            return done
        state, by, updates, out = inputs(state, keys, values, queries, True)
        if out is None:  # the kernel input did not attend: one launch for the output alone
            out = attend_weights(queries, state.keys, state.values, keys, values)[0]
        done = selected(state, keys, values, by, updates)
        if done is None:
            done = finish(state, keys, values, by, updates)
        return (out.astype(queries.dtype), *done)

    def update(state, keys, values, queries):
        return step(state, keys, values, queries)[0]

    return Backend(update, with_move=step, with_attention=with_attention)


def state_type(name: str, init: Callable, doc: str, *, grows: bool = False, **carried: Any) -> type:
    """The state record of an eviction method, from its ``init``: ``keys``, ``values``
    ``[b, h, n, d]``, ``positions [b, h, n]``, the ``carried`` per-token arrays (``name=
    annotation``, in order), ``next_pos [b, h]``, then every parameter of ``init``'s
    signature as a static field (its annotation), ``heads`` (a
    :class:`velox.distributed.Heads`) when ``init`` takes one, ``empty`` (the empty slots, an int) when
    ``init`` has a ``slack`` parameter or the state ``grows`` (a prefill-bounded method whose
    decode steps fill slots it adds as it needs them, see the module), ``ragged`` (whether
    its batch rows hold different numbers of tokens, ``velox.ragged``; False) and
    ``backend``. The parameters are written once, in the signature. Rows live in slots (see the module): ``positions`` says which token each
    holds."""
    fields = [("keys", Float[Array, "b h n d"]), ("values", Float[Array, "b h n d"]),
              ("positions", Int[Array, "b h n"]), *carried.items(), ("next_pos", Int[Array, "b h"])]
    params = param_fields(init)
    slots = [("empty", int)] if grows or any(p == "slack" for p, _ in params) else []
    # a method whose selection may reduce over a layer's kv heads holds where its heads sit
    heads = [("heads", Heads)] if "heads" in inspect.signature(init).parameters else []
    record = NamedTuple(name, [*fields, *params, *heads, *slots, ("ragged", bool), ("backend", str)])
    record.__doc__ = doc
    record.__module__ = init.__module__
    return record


def empty_state(state_type: type, args: dict, **arrays: mx.array):
    """A fresh eviction state from ``init``'s arguments (``locals()`` of an ``init``): no
    rows, ``next_pos`` zero, every static field from ``args`` by name (``empty`` 0, ``ragged``
    False), every
    carried per-token field an empty ``[b, h, 0]`` float32 array unless given in ``arrays``."""
    b, h, d = args["batch"], args["kv_heads"], args["head_dim"]
    k, v, pos, nxt = empty_rows(b, h, d, args["dtype"])
    given = dict(keys=k, values=v, positions=pos, next_pos=nxt, **arrays)
    out = {}
    for name in state_type._fields:
        if name in given:
            out[name] = given[name]
        elif name in args:
            out[name] = args[name]
        elif name == "empty":
            out[name] = 0
        elif name == "ragged":
            out[name] = False
        else:
            out[name] = mx.zeros((b, h, 0), mx.float32)
    return state_type(**out)
