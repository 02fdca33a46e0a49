"""Kv heads split over processes (tensor parallelism): the record and the reductions over them.

On a tensor-parallel model (mlx-lm's ``model.shard(group)``, ``sharded_load``) each process of
a group of ``n`` holds a contiguous slice of every layer's kv heads: process ``r`` the heads
``[r h, (r + 1) h)`` of the layer's ``n h``. A cache there sees its slice only. A method whose
decision reduces over the kv-head axis (one token selection for every head of a layer, a
statistic over a layer's heads, a storage width fitted to the widest head) holds a
:class:`Heads` record (a static field of its state, given to its ``init`` as ``heads=``) and
takes that reduction through it:

* :func:`head_gather`: the statistic of every head of the layer, ``[.., n h, ..]``, in head
  order (``mx.distributed.all_gather``), then the method's own reduction over it, as the
  unsharded method computes it (the same operation on the same values: every process gets
  the same result, and the same as one process holding every head);
* :func:`head_sum`, :func:`head_max`: a local reduction, then ``all_sum`` / ``all_max``
  (counts and widths, exact in any order);
* :func:`host_max`: the largest of an integer every process computed (a shape).

With :data:`LOCAL` (one process holds every head, the default) each is the local operation
itself: no collective is called and the arrays are those of a method without the record.
A per-head decision (a statistic over the query heads of one kv head, a fit of one head)
needs none of this: it stays local.

Every process of the group must call the same reductions in the same order (a collective
waits for all of them): a method calls one wherever its decision needs it, never under a
condition that depends on its own heads' data.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

__all__ = ["Comm", "Heads", "LOCAL", "heads_of", "check_heads", "head_gather", "head_sum",
           "head_max", "host_max", "total_heads", "first_head", "HEAD_KINDS"]

#: What a spec's ``heads`` says of a method's decisions (``velox.spec``): ``independent``
#: (each kv head's own: a shard needs nothing), ``mixed`` (some decision reduces over a
#: layer's kv heads: the state holds a :class:`Heads` record and reduces through it) and
#: ``unshardable`` (its state cannot be split by heads: refused on a shard).
HEAD_KINDS = ("independent", "mixed", "unshardable")


class Comm(int):
    """An ``mx.distributed.Group`` held as a static constant of a state.

    ``mx.compile`` takes Python ints as constants of a trace and refuses other objects; this
    is an ``int`` (the group's size) that carries its group (``.group``), so a state holding
    it compiles, and a compiled step keeps the group it was traced with. Copies are the same
    object (``copy.deepcopy`` of a cache never copies a group). Compiled steps are keyed by
    the value: a process steps the caches of one group (the tensor-parallel group it belongs
    to)."""

    group: Any

    def __new__(cls, group: Any) -> "Comm":
        obj = int.__new__(cls, int(group.size()))
        obj.group = group
        return obj

    def __repr__(self) -> str:
        return f"Comm(size={int(self)})"

    def __copy__(self) -> "Comm":
        return self

    def __deepcopy__(self, memo: dict) -> "Comm":
        return self

    def __reduce__(self):
        raise TypeError("a Comm (an mx.distributed group) cannot be pickled: build it again "
                        "from the group in each process (velox.distributed.heads_of)")


class Heads(NamedTuple):
    """Where a state's kv heads sit among its layer's: the layer's heads split into ``shards``
    equal contiguous slices over the processes of ``comm``'s group, this state holding slice
    ``shard``. :data:`LOCAL` (``shards=1``): every head, no group."""

    shards: int = 1
    shard: int = 0
    comm: Comm | None = None


#: One process holds every kv head: every reduction is local, no collective.
LOCAL = Heads()


def heads_of(group: Any) -> Heads:
    """The record of this process's kv heads on a model sharded over ``group`` (an
    ``mx.distributed.Group``; ``None`` or a group of one: :data:`LOCAL`)."""
    if group is None or int(group.size()) == 1:
        return LOCAL
    return Heads(int(group.size()), int(group.rank()), Comm(group))


def check_heads(heads: Any) -> Heads:
    """``heads`` if it is a valid :class:`Heads` record, else a ``ValueError`` saying why."""
    if not isinstance(heads, Heads):
        raise ValueError(f"heads={heads!r} must be a velox.distributed.Heads record "
                         "(velox.distributed.heads_of(group); LOCAL for one process)")
    n, r, comm = heads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"heads.shards={n!r} must be an integer >= 1")
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
        raise ValueError(f"heads.shard={r!r} must be an integer in 0..{n - 1}")
    if (comm is None) != (n == 1) or (comm is not None and (not isinstance(comm, Comm) or int(comm) != n)):
        raise ValueError(f"heads.comm={comm!r} must be None for one shard, else a Comm of a group "
                         f"of {n} processes")
    return heads


def total_heads(heads: Heads, h: int) -> int:
    """The layer's kv heads, of which a state of ``h`` holds one shard."""
    return h * heads.shards


def first_head(heads: Heads, h: int) -> int:
    """The layer's index of a state's first kv head (it holds ``h``)."""
    return h * heads.shard


def _moved(x, axis: int):
    """``x`` as an MLX array with ``axis`` first (NumPy arrays on the CPU stream: float64
    included)."""
    if isinstance(x, np.ndarray):
        return mx.moveaxis(mx.array(x), axis, 0), True
    return mx.moveaxis(x, axis, 0), False


def head_gather(heads: Heads, x, axis: int = 1):
    """``x`` (an MLX or NumPy array whose ``axis`` holds this state's kv heads) with that axis
    holding every kv head of the layer, in head order (the same on every process); ``x``
    itself with :data:`LOCAL`."""
    if heads.shards == 1:
        return x
    axis = axis % x.ndim
    moved, host = _moved(x, axis)
    got = mx.distributed.all_gather(moved, group=heads.comm.group,
                                    stream=mx.cpu if host else None)
    out = mx.moveaxis(got, 0, axis)
    return np.array(out) if host else out


def head_sum(heads: Heads, x: mx.array, axis: int = 1, keepdims: bool = False) -> mx.array:
    """The sum of ``x`` over the layer's kv heads (``axis``: this state's): the local sum,
    then ``all_sum``; the local sum alone with :data:`LOCAL`."""
    local = x.sum(axis=axis, keepdims=keepdims)
    if heads.shards == 1:
        return local
    return mx.distributed.all_sum(local, group=heads.comm.group)


def head_max(heads: Heads, x: mx.array, axis: int = 1, keepdims: bool = False) -> mx.array:
    """The maximum of ``x`` over the layer's kv heads (``axis``: this state's): the local
    maximum, then ``all_max``; the local maximum alone with :data:`LOCAL`."""
    local = x.max(axis=axis, keepdims=keepdims)
    if heads.shards == 1:
        return local
    return mx.distributed.all_max(local, group=heads.comm.group)


def host_max(heads: Heads, n: int) -> int:
    """The largest of the integer ``n`` every process of the group computed (a shape fitted
    to the widest head of the layer); ``n`` with :data:`LOCAL`."""
    if heads.shards == 1:
        return int(n)
    got = mx.distributed.all_max(mx.array(int(n), mx.int32), group=heads.comm.group, stream=mx.cpu)
    return int(got.item())
