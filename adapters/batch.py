"""mlx-lm's batch protocol for velox caches: one batch-of-one velox state per row (Stage A).

mlx-lm never builds a batch cache itself: ``batch_generate``, ``BatchGenerator`` and the
server call the ``merge`` classmethod of the per-request cache class (``VeloxCache.merge``)
and later ``extract(i)`` a single-sequence cache back. :class:`VeloxBatchCache` is what
``merge`` returns. It holds one :class:`~velox.adapters.mlxlm.VeloxCache` per row, each with
a batch-of-one state, and runs each row's update and attention on that row's valid tokens
only, so a row evolves exactly as it would alone (same operations, same shapes) and padding
never reaches a state.

Protocol facts this class honours (mlx-lm 0.32.2):

* ``merge`` takes single-sequence velox caches (empty ones included) that agree on method,
  parameters, backend, mode, decode settings, ``compile``, ``real_queries`` and state dims;
  it copies them (the given caches stay as they were) and settles a step still pending from
  a forward that never reached the attention wrapper. More than one row needs a model whose
  attention calls mlx-lm's ``scaled_dot_product_attention`` (the adapter's wrapper): the
  wrapper hands the batch's attention to :meth:`VeloxBatchCache.attention`, which attends
  row by row; ``merge`` refuses other models.
* ``prepare(lengths=, right_padding=)`` before a right-padded prompt chunk: row ``b``'s valid
  tokens are the first ``lengths[b]`` of the call(s) that follow, until ``finalize()``;
  ``prepare(left_padding=)`` (only on an empty batch) marks leading tokens as padding. A row
  with no valid token in a call is not touched at all (bit-identical).
* ``update_and_fetch`` gives each row its valid slice; the rows' results wait for the
  wrapper's attention call of the same layer, which computes each row's attention with that
  row's queries (``None`` mask for one query, causal for a chunk) and writes zeros for padded
  query positions (mlx-lm discards them). A batch of one whose call has no padding hands the
  row's own result back, so it also runs on a model without the wrapper.
* ``offset`` is an int32 ``mx.array [B]`` of the rows' next positions (RoPE per row);
  ``size()`` the largest row's token count, ``empty()`` whether every row is empty,
  ``nbytes`` the sum of the rows' bytes, ``state`` every row's arrays.
* ``filter``, ``extend``, ``extract`` are list operations; ``extract(i)`` returns a
  ``VeloxCache`` equal to row ``i`` (a copy: the batch is unchanged), which ``merge``
  accepts again. ``is_trimmable()`` is ``False``: mlx-lm never trims a batch.
* Cross-layer methods (a ``layer_update`` hook with a model-level record shared by a
  request's layers, ``velox.crosslayer``) keep one record per row: mlx-lm merges, extracts
  and copies layer by layer, in layer order, so the copies of a row's layers are made to
  share one copy of that row's record (a deep copy of the whole cache list shares it too).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models import base as _mlx_base

from velox import ragged as _ragged
from velox.state_dims import method_dims

from .model_step import SteppedCache
from .routing import KV_BITS as _KV_BITS
from .routing import Mode
from .routing import capture_installed as _capture_installed

if TYPE_CHECKING:
    from .mlxlm import VeloxCache

__all__ = ["VeloxBatchCache"]


# What merge requires every row of one layer to share (besides the method's state dims).
_SETTINGS = ("params", "backend", "mode", "decode", "decode_cap", "compile", "real_queries", "layer")


def _describe(c: VeloxCache, name: str) -> Any:
    return c.method.key if name == "method" else getattr(c, name)


def _check_rows(rows: list) -> None:
    """Every row is a single-sequence velox cache of one configuration (raises ValueError)."""
    for i, c in enumerate(rows):
        if not isinstance(c, SteppedCache):  # (velox's layer cache: VeloxCache)
            raise ValueError(f"VeloxCache.merge takes velox caches; row {i} is a {type(c).__name__}")
    first = rows[0]
    for i, c in enumerate(rows[1:], 1):
        for name in ("method",) + _SETTINGS:
            a, b = _describe(first, name), _describe(c, name)
            if a != b:
                raise ValueError(f"cannot batch velox caches with different {name}: row 0 has "
                                 f"{a!r}, row {i} has {b!r} (one batch runs one configuration)")
        if (first.artifact is None) != (c.artifact is None):
            raise ValueError(f"cannot batch a calibrated row with an uncalibrated one (rows 0 and {i})")
    dims = None
    for i, c in enumerate(rows):
        st = c.velox_state
        if st is None:
            continue
        b, h, d, dtype = _dims(c)
        if b != 1:
            raise ValueError(f"row {i} holds a batch of {b} sequences; VeloxCache.merge takes "
                             "single-sequence caches (one per request)")
        if dims is None:
            dims = (h, d, dtype, i)
        elif dims[:3] != (h, d, dtype):
            raise ValueError(f"rows {dims[3]} and {i} differ in kv heads, head dim or dtype: "
                             f"{dims[:3]} and {(h, d, dtype)}")


def _dims(c: VeloxCache) -> tuple:
    return method_dims(c.method, c.velox_state)


def _check_routed(rows: list) -> None:
    """More than one row needs the attention wrapper to reach the batch's attention."""
    if len(rows) < 2:
        return
    for c in rows:
        routed = getattr(c, "_routed", None)
        if routed is None:  # not known (loaded without its model): deferred mode says so
            routed = c.mode.value == "deferred" and not c._route_unknown
        if not routed or not _capture_installed():
            raise ValueError(
                "batching velox caches (more than one row) needs a model whose attention calls "
                "mlx-lm's scaled_dot_product_attention, with velox's wrapper installed (the "
                "caches of make_cache(model, ...) say whether it does); this model's does not, so "
                "run its requests one at a time")


def _clone(c: VeloxCache, memo: dict | None = None) -> VeloxCache:
    """An independent copy of ``c`` sharing its (immutable) method object; a cross-layer
    row's layers copied one after the other (layer 0 first, as mlx-lm does) share one copy
    of the row's model-level record and one copy of each array they hold in common (the
    record's, a layer's anchor's). ``memo``: a ``copy.deepcopy`` memo to share instead."""
    if memo is not None:  # one deepcopy of several layers: the memo shares the record
        memo.setdefault(id(c.method), c.method)
        return copy.deepcopy(c, memo)
    memo = {id(c.method): c.method}
    src = c._model
    if src is not None:
        shared = src.__dict__.get("_velox_twin")
        if c.layer == 0 or shared is None:
            src.__dict__.pop("_velox_twin", None)
            first = {id(src.method): src.method}
            twin = copy.deepcopy(src, first)
            shared = {id(src): twin, **_copied_arrays(first)}
            src.__dict__["_velox_twin"] = shared
        memo.update(shared)
        if c.layer == src.n_layers - 1:  # the pass is complete
            src.__dict__.pop("_velox_twin", None)
    out = copy.deepcopy(c, memo)
    if src is not None:
        shared.update(_copied_arrays(memo))
    return out


def _copied_arrays(memo: dict) -> dict:
    """The arrays a ``copy.deepcopy`` memo copied, by the id of their original (alive while
    the caches copied hold them)."""
    return {k: v for k, v in memo.items() if isinstance(v, mx.array)}


def _shell(c: VeloxCache) -> VeloxCache:
    """A copy of ``c``'s settings with no state (its arrays are not copied)."""
    held = c.held
    c.held = held._replace(state=None, row=None, fast=False)
    try:
        return _clone(c)
    finally:
        c.held = held


def _joinable(rows: list) -> list | None:
    """The rows' states when ``rows`` can run as one batched state (see
    :meth:`VeloxBatchCache._join`), else ``None``. Reads shapes and static fields only."""
    first = rows[0]
    m = first.method
    if len(rows) < 2 or not m.spec.contract.get("ragged", False) or m.layer_update is not None:
        return None
    states = []
    for r in rows:
        if (r.rollback or r.decode != "evict" or r.held.pending is not None
                or r.mode is not Mode.DEFERRED or r.artifact is not None):
            return None
        st = r._state  # (writes a decode step's pending row into its slot)
        if st is None or _ragged.is_ragged(st) or getattr(st, "positions", None) is None:
            return None
        states.append(st)
    s0 = states[0]
    for st in states[1:]:
        for a, b in zip(s0, st):
            if isinstance(a, mx.array):
                if not isinstance(b, mx.array) or a.shape != b.shape or a.dtype != b.dtype:
                    return None
            elif isinstance(b, mx.array) or a != b:
                return None
    return states


class VeloxBatchCache(SteppedCache):
    """A batch of velox caches, one batch-of-one :class:`VeloxCache` per row (``rows``), or,
    while its rows hold the same slot layout, one batched state (joined mode).

    A joined batch whose state is steady takes the whole model's compiled decode step
    (``velox.adapters.model_step``) as a single cache does: :meth:`steady_state` offers the
    joined state with each row's offset (RoPE per row), :meth:`stepped` takes the result.

    Created by ``VeloxCache.merge``; see the module docstring for the protocol. Set the
    class attribute ``join_rows`` to ``False`` to keep one state per row always (e.g. to
    measure what joining gains).
    """

    join_rows = True

    def __init__(self, rows: list[VeloxCache]):
        self._rows = list(rows)
        # Joined mode (:meth:`_join`): one VeloxCache whose state holds every row, and each
        # row's offset; ``_rows`` is then stale until :meth:`_split`.
        self._joined: VeloxCache | None = None
        self._offsets: list[int] | None = None
        self._left: list[int] | None = None    # prepare: leading padding still to come, per row
        self._valid: list[int] | None = None   # prepare: valid tokens still to come, per row
        self._right: list[int] | None = None   # prepare: trailing padding (without lengths)
        # Between update_and_fetch and the wrapper's attention: per row None (no valid token)
        # or (start, count, keys, values), what that row's attention reads; "joined" for a
        # call of the joined state.
        self._calls: list | str | None = None
        self._direct = False  # the call was one cache's own: its result went to the model

    # -- rows, one state per row or one joined state -----------------------------------
    @property
    def rows(self) -> list[VeloxCache]:
        """One single-sequence cache per row (a joined batch is split back into them)."""
        self._split()
        return self._rows

    @rows.setter
    def rows(self, rows: list[VeloxCache]) -> None:
        self._joined, self._offsets, self._rows = None, None, list(rows)

    @property
    def joined(self) -> bool:
        """Whether the rows run as one batched state now (see :meth:`_join`)."""
        return self._joined is not None

    def _count(self) -> int:
        return len(self._offsets) if self._joined is not None else len(self._rows)

    def _join(self) -> bool:
        """Run the rows as one batched state from now on, when they can: a method whose
        state is a state of slots that batches ragged rows (``contract.ragged``, the
        score-and-keep evictors), deferred mode, ``decode="evict"``, no rollback, tail or
        calibration, and every
        row's state of the same shapes and static fields (same slot count: e.g. every row's
        cache is full at its budget). A row's state then evolves as the batch-of-one state
        would (the update is vectorised over rows and each row's selection is its own); each
        row keeps its own positions and offset. Its cost: one copy of the rows' states into
        one."""
        if self._joined is not None:
            return True
        if not self.join_rows:
            return False
        states = _joinable(self._rows)
        if states is None:
            return False
        joined = _shell(self._rows[0])
        joined.held = joined.held._replace(state=_ragged.stack(states, states[0]),
                                           offset=max(r.offset for r in self._rows))
        self._offsets = [r.offset for r in self._rows]
        self._joined, self._rows = joined, []
        return True

    def _row(self, i: int) -> VeloxCache:
        """Row ``i`` of the joined state as a single-sequence cache."""
        j = self._joined
        c = _shell(j)
        c.held = c.held._replace(state=_ragged.row(j._state, i), offset=self._offsets[i])
        return c

    def _split(self) -> None:
        """Back to one cache per row (from joined mode)."""
        if self._joined is None:
            return
        rows = [self._row(i) for i in range(len(self._offsets))]
        self._joined, self._offsets, self._rows = None, None, rows

    # -- construction and row operations -------------------------------------------
    @classmethod
    def merge(cls, caches: list) -> "VeloxBatchCache":
        """A batch of copies of ``caches`` (single-sequence velox caches or batches of them),
        in order; pending steps settled."""
        rows: list = []
        for c in caches:
            rows.extend(c.rows if isinstance(c, VeloxBatchCache) else [c])
        if not rows:
            raise ValueError("VeloxCache.merge needs at least one cache")
        _check_rows(rows)
        _check_routed(rows)
        out = []
        for c in rows:
            r = _clone(c)
            r._settle()
            out.append(r)
        return cls(out)

    def filter(self, batch_indices) -> None:
        """Keep the rows ``batch_indices`` (in that order), in place."""
        self._check_idle()
        idx = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        idx = [int(i) for i in idx]
        if self._joined is not None and len(idx) >= 2:
            j = self._joined
            j._state = _ragged.take_rows(j._state, idx)
            self._offsets = [self._offsets[i] for i in idx]
        else:
            self.rows = [self.rows[i] for i in idx]
        for name in ("_left", "_valid", "_right"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, [v[i] for i in idx])

    def extend(self, other: "VeloxBatchCache") -> None:
        """Append ``other``'s rows, in place (the two must agree as ``merge`` requires)."""
        self._check_idle()
        if not isinstance(other, VeloxBatchCache):
            raise ValueError(f"a velox batch extends with another velox batch, not a {type(other).__name__}")
        if self._prepared() or other._prepared():
            raise ValueError("extend between prepare() and finalize() is not supported")
        rows = self.rows + list(other.rows)
        if rows:
            _check_rows(rows)
            _check_routed(rows)
        self.rows = rows

    def extract(self, idx: int) -> VeloxCache:
        """Row ``idx`` as a single-sequence ``VeloxCache`` (a copy; the batch is unchanged)."""
        self._check_idle()
        if self._joined is not None:
            return self._row(idx)
        return _clone(self._rows[idx])

    def __deepcopy__(self, memo: dict) -> "VeloxBatchCache":
        new = VeloxBatchCache([_clone(r, memo) for r in self._rows])
        if self._joined is not None:
            new._joined, new._offsets = _clone(self._joined, memo), list(self._offsets)
        new._left, new._valid, new._right = (None if v is None else list(v)
                                             for v in (self._left, self._valid, self._right))
        memo[id(self)] = new
        return new

    # -- padding --------------------------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Record which tokens of the next call(s) are real: row ``b`` skips
        ``left_padding[b]`` leading tokens (an empty batch only) and takes ``lengths[b]``
        tokens (else all but ``right_padding[b]`` trailing ones of the next call)."""
        self._check_idle()
        n = self._count()

        def ints(v, name):
            if v is None:
                return None
            v = v.tolist() if isinstance(v, mx.array) else list(v)
            if len(v) != n or any(int(x) < 0 for x in v):
                raise ValueError(f"{name} must give {n} counts >= 0; got {v}")
            return [int(x) for x in v]

        left, valid, right = ints(left_padding, "left_padding"), ints(lengths, "lengths"), \
            ints(right_padding, "right_padding")
        if left is not None and any(left):
            if not self.empty():
                raise ValueError("left padding can only be added to an empty velox batch")
            self._left = [a + b for a, b in zip(self._left or [0] * n, left)]
        if valid is not None:
            self._valid = valid
        if right is not None and any(right):
            self._right = right

    def finalize(self) -> None:
        """End of a padded chunk: forget the recorded counts (padding was never stored)."""
        self._check_idle()
        self._left = self._valid = self._right = None

    def _prepared(self) -> bool:
        return any(v is not None for v in (self._left, self._valid, self._right))

    def _spans(self, s: int) -> list[tuple[int, int]]:
        """Each row's ``(start, count)`` of valid tokens in a call of ``s`` tokens (and the
        recorded counts advanced past it)."""
        out = []
        for b in range(self._count()):
            skip = 0 if self._left is None else min(self._left[b], s)
            if self._valid is not None:
                take = min(self._valid[b], s - skip)
                self._valid[b] -= take
            elif self._right is not None:
                take = max(s - skip - self._right[b], 0)
            else:
                take = s - skip
            if self._left is not None:
                self._left[b] -= skip
            out.append((skip, take))
        return out

    # -- the forward ------------------------------------------------------------------
    def _check_idle(self) -> None:
        calls, self._calls = self._calls, None
        if calls is not None and not self._direct:
            raise RuntimeError(
                "the last forward never reached the attention wrapper for this velox batch "
                "(the model's attention does not call mlx-lm's scaled_dot_product_attention); "
                "its rows' results are lost")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Give each row its valid tokens; their attention follows in :meth:`attention`.

        A decode step (one valid token per row) of rows that can run as one batched state
        joins them (:meth:`_join`) and runs that state's update; a call with padding splits
        a joined batch back into rows. Returns the row's own result for a batch of one
        without padding (the joined state's for a joined batch), else the call's keys and
        values (the wrapper reads the rows' results instead)."""
        self._check_idle()
        b, _, s, _ = keys.shape
        if b != self._count():
            raise ValueError(f"a call of {b} rows on a velox batch of {self._count()}")
        spans = self._spans(s)
        whole = all(sp == (0, s) for sp in spans)
        if whole and (self._joined is not None or (s == 1 and self._join())):
            k, v = self._joined.update_and_fetch(keys, values)
            self._offsets = [o + s for o in self._offsets]
            self._calls, self._direct = "joined", True
            return k, v
        rows = self.rows  # (a joined batch given padding splits here)
        if b == 1 and spans[0] == (0, s):
            k, v = rows[0].update_and_fetch(keys, values)
            self._calls, self._direct = [(0, s, k, v)], True
            return k, v
        calls = []
        for i, (row, (start, count)) in enumerate(zip(rows, spans)):
            if not count:
                calls.append(None)
                continue
            k, v = row.update_and_fetch(keys[i:i + 1, :, start:start + count],
                                        values[i:i + 1, :, start:start + count])
            calls.append((start, count, k, v))
        self._calls, self._direct = calls, False
        return keys, values

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                  mask, sinks=None) -> mx.array:
        """Each row's attention (and deferred update) with its own queries, as alone; zeros
        at padded query positions. ``keys``/``values``/``mask`` from the model are not read
        (except by a batch of one without padding, which is the row's own call, and by the
        joined state's call)."""
        calls, self._calls = self._calls, None
        if calls is None:
            raise RuntimeError("attention on a velox batch without update_and_fetch before it")
        if calls == "joined":
            return self._joined.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        b, hq, s, _ = queries.shape
        if b == 1 and calls[0] is not None and calls[0][:2] == (0, s):
            _, _, k, v = calls[0]
            return self._rows[0].attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)
        dv = values.shape[-1]
        outs = []
        for i, (row, call) in enumerate(zip(self._rows, calls)):
            if call is None:
                outs.append(mx.zeros((1, hq, s, dv), queries.dtype))
                continue
            start, count, k, v = call
            q = queries[i:i + 1, :, start:start + count]
            out = row.attention(q, k, v, scale=scale, mask=None if count == 1 else "causal",
                                sinks=sinks)
            if count < s:
                parts = [mx.zeros((1, hq, start, out.shape[-1]), out.dtype)] if start else []
                parts.append(out)
                if s - start - count:
                    parts.append(mx.zeros((1, hq, s - start - count, out.shape[-1]), out.dtype))
                out = mx.concatenate(parts, axis=2)
            outs.append(out)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The row's own mask for a batch of one; else ``None``/``"causal"`` (the wrapper
        builds each row's mask itself and ignores this one; a joined state holds no padding)."""
        if window_size is not None:
            raise ValueError("velox caches do not support sliding-window attention layers")
        if self._joined is None and len(self._rows) == 1:
            return self._rows[0].make_mask(N, return_array=return_array)
        if N == 1:
            return None
        if return_array:
            return _mlx_base.create_causal_mask(N, offset=self.size())
        return "causal"

    # -- the compiled whole-model step (velox.adapters.model_step) -------------------
    def steady_state(self) -> tuple | None:
        """``(method, state, pending row, offsets)`` of the joined state while its next
        single-token step may run compiled with the whole model (the joined cache's own
        conditions: ``VeloxCache.steady_state``), with ``offsets`` each row's next position
        (a tuple: the compiled step's RoPE offset is then an int32 ``[B]`` array); ``None``
        for a batch of separate rows, or with padding recorded."""
        if self._joined is None or self._prepared() or self._calls is not None:
            return None
        got = self._joined.steady_state()
        if got is None:
            return None
        return (*got[:3], tuple(self._offsets))

    def stepped(self, state, row) -> None:
        """Take the joined state and pending row of a compiled step (one token more per row)."""
        self._joined.stepped(state, row)
        self._offsets = [o + 1 for o in self._offsets]

    # -- getters (none of them updates) -----------------------------------------------
    @property
    def offset(self) -> mx.array:
        """Each row's absolute next position, int32 ``[B]`` (less the left padding still to
        come, so that a row's first real token gets its own position)."""
        offsets = self._offsets if self._joined is not None else [r.offset for r in self._rows]
        left = self._left or [0] * len(offsets)
        return mx.array([o - p for o, p in zip(offsets, left)], dtype=mx.int32)

    @offset.setter
    def offset(self, value) -> None:
        raise AttributeError("the offsets of a velox batch follow the tokens its rows absorbed")

    def size(self) -> int:
        """The largest row's token count."""
        if self._joined is not None:
            return self._joined.size()
        return max((r.size() for r in self._rows), default=0)

    def empty(self) -> bool:
        return self._joined is None and all(r.empty() for r in self._rows)

    @property
    def nbytes(self) -> int:
        """The sum of the rows' bytes (what each row alone holds; no padding); for a joined
        batch, its one state's."""
        if self._joined is not None:
            return self._joined.nbytes
        return sum(r.nbytes for r in self._rows)

    @property
    def state(self) -> list[mx.array]:
        """Every array of every row (mlx-lm evaluates these)."""
        if self._joined is not None:
            return self._joined.state
        return [x for r in self._rows for x in r.state]

    @state.setter
    def state(self, v) -> None:
        raise AttributeError("a velox batch's state is its rows'; set a row with load_cache")

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        """Refused for ``n > 0`` (mlx-lm never trims a batch cache)."""
        if n:
            raise ValueError("a velox batch cache cannot be trimmed; extract a row first")
        return 0

    @property
    def to_quantized(self):
        """Refused, as for a single velox cache."""
        raise ValueError(_KV_BITS)
