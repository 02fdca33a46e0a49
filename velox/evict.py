"""Shared eviction mechanics (MLX): append candidates, protect sinks/recent, keep the top budget.

Every eviction method is "append the new rows, score every candidate, keep the ``budget``
best, in increasing absolute position". Stored rows are always sorted by position, so the
candidates (stored + new) are too, and keeping sorted indices keeps the order.

Tie rule (all backends): among equal scores the newer token is kept.

Non-finite rule (all backends, every selection): a non-finite score (NaN, or +-inf from an
overflow) ranks lowest, below every finite score, ties among them by the tie rule; protected
slots (sinks, recent window) always survive; positions stay strictly increasing and the
budget holds. :func:`ranked` applies it; :func:`top_budget` ranks through it.

Constants (index arrays, masks) come from a cache bounded in bytes (:data:`CONST_BYTES`), so
a cache that grows a token a step never keeps one array per length alive.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
import math
import operator
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from ._typing import Array, Bool, Float, Int, Shaped
from .attention import CodedKeys
from .ordering import order_key
from .registry import dims_of
from .spec import param_fields

__all__ = ["empty_rows", "new_positions", "protected", "ranked", "top_budget", "row_offsets", "all_but",
           "take_rows", "append_rows", "keep_rows", "dims", "row_sq_norms", "row_norms",
           "cuda_update", "with_compacted", "cached_const", "CONST_BYTES", "score_and_keep", "Scored",
           "empty_state", "state_type", "scores_by_logits"]


def empty_rows(batch: int, heads: int, head_dim: int, dtype: mx.Dtype):
    """Zero-length keys, values, positions and a zero ``next_pos`` for a fresh state."""
    return (mx.zeros((batch, heads, 0, head_dim), dtype), mx.zeros((batch, heads, 0, head_dim), dtype),
            mx.zeros((batch, heads, 0), mx.int32), mx.zeros((batch, heads), mx.int32))


def new_positions(next_pos: Int[Array, "b h"], s: int) -> Int[Array, "b h s"]:
    """Absolute positions of ``s`` new tokens."""
    return next_pos[:, :, None] + _const("arange", s)


CONST_BYTES = 1 << 20  # bytes the constant cache may hold (1 MiB)
_CONSTS: OrderedDict[tuple, mx.array] = OrderedDict()
_CONST_HELD = [0]


def cached_const(key: tuple, build: Callable[[], np.ndarray]) -> mx.array:
    """``mx.array(build())``, cached by ``key`` (least recently used first out).

    The cache holds at most :data:`CONST_BYTES`; larger arrays are built but not kept. A
    decode step at a full cache asks for the same few shapes every step and hits; a cache
    that grows asks for a new length every step, and the bound keeps those from piling up.
    The arrays are shared: read them, do not assign into them.
    """
    hit = _CONSTS.get(key)
    if hit is not None:
        _CONSTS.move_to_end(key)
        return hit
    arr = mx.array(build())
    if arr.nbytes <= CONST_BYTES:
        _CONSTS[key] = arr
        _CONST_HELD[0] += arr.nbytes
        while _CONST_HELD[0] > CONST_BYTES:
            _CONST_HELD[0] -= _CONSTS.popitem(last=False)[1].nbytes
    return arr


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


def keep_rows(stored: tuple, new: tuple, idx: Int[Array, "b h k"] | None) -> tuple:
    """Rows ``idx`` of each ``stored ++ new`` pair (token axis 2); ``None`` keeps all.

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
    new_kept = idx[:, :, -1:] == n
    same = idx == _const("arange", k) if k == n else None  # slot i holds candidate i (not i + 1)
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
        other = a[:, :, n - 1:] if k == n else take_rows(a, mx.minimum(idx[:, :, k - 1:], n - 1))
        cond = new_kept.reshape(new_kept.shape + trailing)
        start = mx.array([0, 0, k - 1] + [0] * len(rest))
        out.append(mx.slice_update(kept, mx.where(cond, x, other), start, axes=tuple(range(a.ndim))))
    return tuple(out)


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
    ``mlx_update``, the vectorised MLX ops of the ``mlx`` backend, on the same GPU.
    """
    def update(state, keys, values, queries):
        if keys.shape[2] != 1 or state.keys.shape[2] != capacity(state):
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
    """What a spec says of a score-and-keep method: capacity, protected slots, when it
    evicts, whether a batch row's heads share one selection."""

    capacity: Callable
    sinks: Callable
    recent: Callable
    prefill_only: bool
    shared: Callable


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
    return _Plan(capacity=_getter(c["capacity"]), sinks=_getter(c.get("sinks")),
                 recent=_getter(c.get("recent")), prefill_only=c.get("bound_phase") == "prefill",
                 shared=shared)


def _evicting(plan: _Plan, state, n: int, s: int) -> bool:
    return n + s > plan.capacity(state) and (s > 1 or not plan.prefill_only)


def _protected_index(n: int, n_sink: int, recent: int) -> np.ndarray:
    return np.flatnonzero(_build_const("protected", n, n_sink, recent)).astype(np.int32)


def score_and_keep(score: Callable | None, reference: Callable | None, *,
                   kernel: Callable | None = None, carry: tuple[str, ...] = (),
                   fields: tuple[str, ...] = (), logits_only: bool = False) -> Callable:
    """The backends of a score-and-keep eviction method, built from its score.

    Every update appends the ``s`` new rows to the ``n`` stored ones, and when the method
    evicts (its spec: ``n + s`` over ``contract.capacity``; every update, or multi-token
    chunks only when ``contract.bound_phase = "prefill"``) keeps the ``capacity`` best-scoring candidates, the
    protected ones always (the first ``contract.sinks`` positions and the ``contract.recent``
    newest), in increasing position, with the tie and non-finite rules of :func:`top_budget`.
    Where the spec's ``head_independent`` names a bool parameter (``"per_head"``), a batch
    row's heads share one selection when it is false: the mean of their scores. Positions,
    ``next_pos``, the append and the gather are written here, once.

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
        kernel: the ``cuda`` backend's input for a decode step at a full cache,
            ``kernel(state, keys, values, queries) -> dict`` of ``velox.kernels.evict.compact``'s
            loser arguments (``by=`` scores or ``drop=``, ``carry=``, ``profiles=``); the
            protection and sharing are added here. Default (when the spec lists ``cuda``):
            ``by`` the ``mlx`` score. Every other call runs the ``mlx`` backend on the GPU.
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
        ``spec -> {backend: update}``, for :func:`velox.registry.register`'s ``backends``;
        the ``reference`` and ``mlx`` updates carry ``logits_only`` as an attribute (read by
        :func:`scores_by_logits`).
    """
    if score is None and (carry or fields or reference is not None):
        raise ValueError("a rule without a score keeps the protected slots only: it carries nothing")

    def build(spec) -> dict[str, Callable]:
        plan = _plan(spec)
        mlx_update = _mlx_backend(score, carry, fields, plan, logits_only)
        out = {"reference": _reference_backend(reference, carry, fields, plan, logits_only),
               "mlx": mlx_update}
        if "cuda" in spec.backends:
            out["cuda"] = cuda_update(mlx_update, plan.capacity,
                                      _kernel_step(score, kernel, carry, fields, plan))
        return out

    return build


def scores_by_logits(method) -> bool:
    """Whether ``method`` (a registered method) is a score-and-keep method whose scores read
    the stored keys only as attention logits (:func:`score_and_keep`'s ``logits_only``): its
    state's ``keys`` may be :class:`velox.attention.CodedKeys`."""
    return all(getattr(method.backends.get(b), "logits_only", False) for b in ("reference", "mlx"))


def _rows_and_scored(state, logits_only: bool) -> tuple:
    """``(state with rows as keys, state the score reads)``: a state whose ``keys`` are
    :class:`CodedKeys` holds their decoded rows for the skeleton; its score sees the codes
    when it reads keys only as logits, else the rows."""
    if not isinstance(state.keys, CodedKeys):
        return state, state
    rows = state._replace(keys=state.keys.rows)
    return rows, (state if logits_only else rows)


def _mlx_backend(score, carry, fields, plan: _Plan, logits_only: bool = False) -> Callable:
    def update(state, keys, values, queries):
        state, seen = _rows_and_scored(state, logits_only)
        n, s = state.keys.shape[2], keys.shape[2]
        evicting = _evicting(plan, state, n, s)
        scored = Scored(None, {})
        if score is not None and (evicting or carry or fields):
            scored = _scored(score(seen, keys, values, queries, evicting))
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
                    scores = scores.mean(axis=1, keepdims=True)
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
        out = keep_rows(tuple(stored), tuple(new), idx)
        kept = dict(zip(carry, out[3:]))
        kept.update({name: scored.updates[name] for name in fields})
        return state._replace(keys=out[0], values=out[1], positions=out[2],
                              next_pos=state.next_pos + s, **kept)

    update.logits_only = logits_only
    return update


def _reference_backend(reference, carry, fields, plan: _Plan, logits_only: bool = False) -> Callable:
    from . import reference as ref

    def update(state, keys, values, queries):
        state, seen = _rows_and_scored(state, logits_only)
        coded = seen.keys.numpy() if isinstance(seen.keys, CodedKeys) else None
        c = ref.candidates(state, keys, values, queries)
        b, h, N = c.positions.shape
        s = keys.shape[2]
        evicting = _evicting(plan, state, N - s, s)
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
        chosen = [[None] * h for _ in range(b)]
        if evicting:
            if plan.shared(state):
                scores[:] = scores.mean(axis=1, keepdims=True)
            cap, sinks, recent = plan.capacity(state), plan.sinks(state), plan.recent(state)
            chosen = [[ref.top_budget(scores[i, j], cap,
                                      ref.protected(c.positions[i, j], c.total[i, j], sinks, recent))
                       for j in range(h)] for i in range(b)]
        stacked = {name: np.stack([np.stack(row) for row in rows]) for name, rows in per_head.items()}
        new = ref.keep(state, c, chosen, **{name: stacked[name] for name in carry})
        return new._replace(**{name: ref.to_mx(stacked[name], getattr(state, name).dtype)
                               for name in fields})

    update.logits_only = logits_only
    return update


def _kernel_step(score, kernel, carry, fields, plan: _Plan) -> Callable:
    def step(state, keys, values, queries):
        from .kernels.evict import compact
        if kernel is None:
            scored = _scored(score(state, keys, values, queries, True))
            args = dict(by=scored.scores)
            state = state._replace(**{name: scored.updates[name] for name in fields})
        else:
            args = kernel(state, keys, values, queries)
        if "by" in args:
            args.update(shared=plan.shared(state), n_sink=plan.sinks(state),
                        recent=plan.recent(state))
        out = compact(state.keys, state.values, state.positions, keys, values, state.next_pos,
                      **args)
        return with_compacted(state, out, carried=carry[0] if carry else "scores")

    return step


def state_type(name: str, init: Callable, doc: str, **carried: Any) -> type:
    """The state record of an eviction method, from its ``init``: ``keys``, ``values``
    ``[b, h, n, d]``, ``positions [b, h, n]``, the ``carried`` per-token arrays (``name=
    annotation``, in order), ``next_pos [b, h]``, then every parameter of ``init``'s
    signature as a static field (its annotation) and ``backend``. The parameters are
    written once, in the signature."""
    fields = [("keys", Float[Array, "b h n d"]), ("values", Float[Array, "b h n d"]),
              ("positions", Int[Array, "b h n"]), *carried.items(), ("next_pos", Int[Array, "b h"])]
    record = NamedTuple(name, [*fields, *param_fields(init), ("backend", str)])
    record.__doc__ = doc
    record.__module__ = init.__module__
    return record


def empty_state(state_type: type, args: dict, **arrays: mx.array):
    """A fresh eviction state from ``init``'s arguments (``locals()`` of an ``init``): no
    rows, ``next_pos`` zero, every static field from ``args`` by name, every carried
    per-token field an empty ``[b, h, 0]`` float32 array unless given in ``arrays``."""
    b, h, d = args["batch"], args["kv_heads"], args["head_dim"]
    k, v, pos, nxt = empty_rows(b, h, d, args["dtype"])
    given = dict(keys=k, values=v, positions=pos, next_pos=nxt, **arrays)
    out = {}
    for name in state_type._fields:
        if name in given:
            out[name] = given[name]
        elif name in args:
            out[name] = args[name]
        else:
            out[name] = mx.zeros((b, h, 0), mx.float32)
    return state_type(**out)
