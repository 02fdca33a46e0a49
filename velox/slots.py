"""Slot mechanics shared by the eviction skeleton (``velox.evict``), its reference backends
(``velox.reference``) and the registry's readers of a state of slots (``velox.registry``):
how an update moved the stored rows (:class:`Move`) and the view of the filled slots
(:func:`filled_rows`). ``velox.evict`` describes slots and re-exports both.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx

__all__ = ["Move", "filled_rows"]


def filled_rows(keys: mx.array, values: mx.array, empty: int) -> tuple[mx.array, mx.array]:
    """The rows of the filled slots of a state with ``empty`` empty slots, which are the last
    ones (amortized eviction, see ``velox.evict``): views of the first ``n - empty`` slots."""
    if not empty:
        return keys, values
    n = keys.shape[2] - empty
    return keys[:, :, :n], values[:, :, :n]


class Move(NamedTuple):
    """How an update moved the stored rows: what a composition (``velox.compose``) repeats on
    its own per-token rows (codes).

    ``slot`` (``[b, h, 1]``, or an ``int``: the same slot in every row) is a decode step in
    place: the new row goes to that slot where ``write`` (``[b, h, 1]``, or ``None``:
    everywhere) holds, else nothing moves. Otherwise the filled slots are first gathered by
    ``pre`` (``[b, h, f]``, ``None``: as stored), then the candidates (those rows followed by
    the new ones) by ``idx`` (``None``: all are kept, the new rows appended), as
    ``velox.evict.keep_rows`` does; the last ``pad`` entries of ``idx`` (0) are then empty slots
    (amortized eviction's selection: the kept rows first, in slot order, the empty slots
    last). ``rows`` (a decode step of the fused
    kernels, ``velox.kernels.evict.select``) are the keys and values ``[b, h, 1, d]`` that
    belong in ``slot`` and that the step left unwritten (the adapter writes them in place)."""

    pre: Any = None
    idx: Any = None
    slot: Any = None
    write: Any = None
    rows: Any = None  # a decode step whose rows were not written: (keys, values) for ``slot``
    pad: int = 0  # empty slots after the rows ``idx`` keeps
