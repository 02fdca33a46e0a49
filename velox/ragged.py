"""Ragged rows in one state: batch rows holding different numbers of tokens.

A state of slots (``velox.evict``: ``positions [b, h, n]``, ``-1`` an empty slot) may hold a
different number of tokens in each batch row: the rows' extra slots are empty. Such a state
comes from an update with ``valid`` (``update(state, keys, values, *, queries=None,
valid=None)``): ``valid [b]`` counts the real new tokens of each row, the real ones first
(right padding, as mlx-lm pads a batch's chunks); the padding is never stored, scored,
protected or counted. A method whose state of slots holds ragged rows declares it in its
spec (``contract.ragged = true``); every score-and-keep method (``velox.evict.score_and_keep``)
does; every other method holds them as one state per row (the end of this docstring).

The rule, for every backend: each row evolves exactly as that row alone (a batch-of-one
state fed only its real tokens). A row with ``valid = 0`` keeps its slots bit for bit.

How a state holds ragged rows:

* ``positions`` is ``-1`` at every empty slot; the static ``empty`` field (slack methods) is
  the number of slots empty in *every* row and head: the common count when all rows and
  heads hold the same, else 0 (a lower bound).
* ``get_kv`` and ``positions`` (``velox.registry``) gather ``n - empty`` columns per row in
  increasing position: a row's extra empty slots come first, at position -1 (left padding,
  as mlx-lm's batch caches hold rows); ``kv_slots``' mask (``positions >= 0``) is given for
  every ragged state and is what attention over the stored rows applies.
* ``nbytes`` counts the filled slots (and the per-row arrays): the sum of the rows' own
  accounting (:func:`filled_nbytes`); a state whose rows are not ragged is counted as before,
  array by array.

The update (:func:`ragged`): when every row takes ``s`` real tokens and every row holds the
same slots (each row and head exactly ``empty`` empty ones), the state is an ordinary batch
and the backend's update runs on it as it is. Otherwise each row that takes tokens runs the
backend's update as a batch-of-one state of its filled slots (:func:`compact`) with its real
tokens (and queries) alone, and the rows are stacked back into one state (:func:`stack`),
padded with empty slots to the widest row. A method's score reads whole rows (attention over
the stored and new keys, the last queries of a chunk), so a row's score is its own call on
its own tokens: no padded key, value or query reaches it, whatever it holds.

A ragged state says so in its static ``ragged`` field (:func:`is_ragged`): an update without
``valid`` of a ragged state runs as ``valid = s`` for every row.

Every other method (quantizers, codecs, compositions, low-rank and cross-layer states: no
``contract.ragged``) holds ragged rows as :class:`RowStates`, one batch-of-one state per row:
an update with unequal ``valid`` counts splits the batch state (:func:`split_rows`), and
every function of the method takes the result (the registry wraps them): the same rule,
each row exactly the row alone, without vectorising the rows' updates.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .coded import CodedKeys
from .state_dims import _keys_dims

__all__ = ["check_valid", "is_ragged", "token_fields", "row", "compact", "stack", "filled_nbytes",
           "ragged", "take_rows", "RowStates", "split_rows", "rows_kv", "rows_positions",
           "rows_kv_slots", "rows_update", "rows_attend"]

def _mark(state, ragged: bool = True):
    """``state`` with its static ``ragged`` field set (a state of slots of any other record
    type is returned as it is)."""
    return state._replace(ragged=ragged) if "ragged" in getattr(state, "_fields", ()) else state


def is_ragged(state) -> bool:
    """Whether ``state`` holds ragged rows: its static ``ragged`` field, set by :func:`stack`
    when its rows or heads hold different numbers of empty slots (a field of the record, so
    copies, compiled functions and saved states keep it)."""
    return bool(getattr(state, "ragged", False))


def check_valid(valid, batch: int, s: int, key: str) -> np.ndarray:
    """``valid`` as an int64 NumPy array ``[batch]`` of counts in ``0..s``, or ValueError.

    ``valid`` is an integer array (MLX or NumPy, any integer dtype) or a sequence of Python
    or NumPy ints; a float or bool array (or a float or bool among the ints) is refused, not
    rounded or cast (``True`` is not a count)."""
    if isinstance(valid, mx.array):
        got = f"an array of dtype {str(valid.dtype).replace('mlx.core.', '')}"
        v = np.asarray(valid) if mx.issubdtype(valid.dtype, mx.integer) else None
    elif isinstance(valid, (list, tuple)) and any(
            isinstance(x, (bool, np.bool_, float, np.floating)) for x in valid):
        got, v = f"a {type(valid).__name__} of {', '.join(sorted({type(x).__name__ for x in valid}))}", None
    else:
        v = np.asarray(valid)
        got = f"dtype {v.dtype}"
        v = v if np.issubdtype(v.dtype, np.integer) else None
    if v is None:
        raise ValueError(f"{key}: valid must be an integer array [batch={batch}] (or a list of "
                         f"Python ints) of real tokens per row; got {got} (floats and bools are "
                         f"not counts)")
    if v.shape != (batch,):
        raise ValueError(f"{key}: valid must be an integer array [batch={batch}] of real tokens per "
                         f"row; got shape {v.shape}, dtype {v.dtype}")
    if (v < 0).any() or (v > s).any():
        raise ValueError(f"{key}: valid counts {v.tolist()} must lie in 0..{s} (the update's new tokens)")
    return v.astype(np.int64)


def _dims(annotation) -> str | None:
    """The dimension string of a field's annotation (``Float[Array, "b h n d"]``, also as
    the text of a postponed annotation), or None."""
    dims = getattr(annotation, "dim_str", None)
    text = getattr(annotation, "__forward_arg__", annotation)  # typing.ForwardRef: its text
    if dims is None and isinstance(text, str):
        found = re.search(r"""["']([^"']*)["']""", text)
        dims = found.group(1) if found else None
    return dims


def token_fields(state) -> tuple[str, ...]:
    """The per-token fields of a state of slots: arrays ``[b, h, n, ...]`` laid out like
    ``positions`` (keys, values, positions and the carried fields), by their annotations
    (dims ``"b h n ..."``; a field without one: by its shape)."""
    shape = tuple(state.positions.shape)
    notes = getattr(type(state), "__annotations__", {})
    out = []
    for name, x in zip(state._fields, state):
        if not (isinstance(x, mx.array) and x.ndim >= 3 and tuple(x.shape[:3]) == shape):
            continue
        dims = _dims(notes.get(name))
        if dims is None or dims.split()[:3] == ["b", "h", "n"]:
            out.append(name)
    return tuple(out)


def _row_arrays(state) -> tuple[str, ...]:
    b = state.positions.shape[0]
    return tuple(name for name, x in zip(state._fields, state)
                 if isinstance(x, mx.array) and x.ndim >= 1 and x.shape[0] == b)


def row(state, i: int):
    """Row ``i`` of ``state`` as a batch-of-one state, its slots as stored."""
    return state._replace(**{name: getattr(state, name)[i:i + 1] for name in _row_arrays(state)})


def take_rows(state, idx):
    """The rows ``idx`` (a list of row numbers, in that order) of ``state``, as one state;
    a ragged state stays marked ragged (its update then runs row by row, as for any ragged
    state, even if the rows kept hold the same slots)."""
    take = mx.array(list(idx), dtype=mx.int32)
    out = state._replace(**{name: getattr(state, name)[take] for name in _row_arrays(state)})
    return out


def _filled(state) -> np.ndarray:
    """``[b, h]`` filled slots of each row and head (a host read of ``positions``)."""
    return (np.array(state.positions) >= 0).sum(axis=-1)


def compact(state):
    """A batch-of-one ``state`` with its filled slots only, in increasing position
    (``empty`` 0): the row as a state of its own tokens."""
    pos = np.array(state.positions)
    filled = (pos >= 0).sum(axis=-1)
    if (filled != filled[:, :1]).any():
        raise ValueError("the heads of a row hold different numbers of tokens")
    n = pos.shape[-1]
    order = mx.array(np.argsort(pos, axis=-1, kind="stable")[..., n - int(filled[0, 0]):].astype(np.int32))
    fields = {name: mx.take_along_axis(getattr(state, name),
                                       order.reshape(order.shape + (1,) * (getattr(state, name).ndim - 3)),
                                       axis=2)
              for name in token_fields(state)}
    if hasattr(state, "empty"):
        fields["empty"] = 0
    return _mark(state._replace(**fields), False)


def _pad_slots(x: mx.array, width: int, fill, left: bool = False) -> mx.array:
    """``x [b, h, n, ...]`` padded with ``fill`` to ``width`` slots, at the end (or first)."""
    n = x.shape[2]
    if n == width:
        return x
    pad = mx.full(x.shape[:2] + (width - n,) + x.shape[3:], fill, x.dtype)
    return (mx.concatenate([pad, x] if left else [x, pad], axis=2)) if n else pad


def stack(rows: list, like):
    """One state of the batch-of-one states ``rows`` (``like``'s static fields): per-token
    fields padded at the end to the widest row with empty slots (position -1, zeros), per-row
    arrays stacked; ``empty`` the count of slots empty in every row and head when all hold
    the same, else 0 (the state is then marked ragged, :func:`is_ragged`)."""
    width = max(r.positions.shape[2] for r in rows)
    tokens = token_fields(rows[0])
    fields = {}
    for name in _row_arrays(rows[0]):
        if name in tokens:
            fill = -1 if name == "positions" else 0
            fields[name] = mx.concatenate([_pad_slots(getattr(r, name), width, fill) for r in rows], axis=0)
        else:
            fields[name] = mx.concatenate([getattr(r, name) for r in rows], axis=0)
    out = like._replace(**fields)
    empties = width - _filled(out)
    uniform = bool((empties == empties.flat[0]).all()) if empties.size else True
    if hasattr(out, "empty"):
        out = out._replace(empty=int(empties.flat[0]) if uniform and empties.size else 0)
    return _mark(out, bool(not uniform or (not hasattr(out, "empty") and empties.size and empties.flat[0])))


def filled_nbytes(state) -> int:
    """Bytes of a state's filled slots beyond its static ``empty`` count, plus every other
    array: the bytes of the state's arrays less its rows' extra empty slots. For a ragged
    state, the sum of its rows' own accounting (each row's :func:`compact` state)."""
    from .accounting import state_nbytes
    total = state_nbytes(state)
    tokens = token_fields(state)
    per_slot = sum(_slot_bytes(getattr(state, name)) for name in tokens)
    b, h, n = state.positions.shape
    extra = int(b * h * n - _filled(state).sum()) - b * h * getattr(state, "empty", 0)
    return int(total - per_slot * extra)


def _slot_bytes(x: mx.array) -> int:
    """Bytes one slot of one row and head takes in ``x [b, h, n, ...]``."""
    return int(x.itemsize * int(np.prod(x.shape[3:], dtype=np.int64)))


def ragged(step: Callable) -> Callable:
    """The ragged update of a backend's update ``step(state, keys, values, queries)``:
    ``update(state, keys, values, queries, valid)`` with ``valid`` a checked ``[b]`` NumPy
    count (see the module)."""
    def update(state, keys, values, queries, valid: np.ndarray):
        if isinstance(state.keys, CodedKeys):
            raise ValueError("ragged rows are not supported by composed states (codes follow the policy's moves)")
        b, h, n = state.positions.shape
        s = keys.shape[2]
        filled = _filled(state)
        if (valid == s).all() and not is_ragged(state) and (filled == n - getattr(state, "empty", 0)).all():
            return step(state, keys, values, queries)  # an ordinary batch
        if not valid.any():
            return state
        rows = []
        for i in range(b):
            r = row(state, i)
            v = int(valid[i])
            if v:
                q = None if queries is None else queries[i:i + 1, :, :v]
                r = step(compact(r), keys[i:i + 1, :, :v], values[i:i + 1, :, :v], q)
            rows.append(r)
        return stack(rows, state)

    return update


# --- ragged rows of any other method: one batch-of-one state per row ------------------------

class RowStates(NamedTuple):
    """Ragged rows of a method whose state holds equal rows (no ``contract.ragged``): one
    batch-of-one state of that method per batch row, each exactly the row alone.

    Made by an update with unequal ``valid`` counts (:func:`split_rows` of the state given),
    or from states of one row each (``RowStates(rows=(s0, s1, ...))``). Every function of the
    method takes it: ``update`` runs each row's update on its real tokens (a row with
    ``valid = 0`` is the same object afterwards), ``get_kv`` and ``positions`` give each row's
    rows left-padded to the widest row (padding at position -1, zeros), ``kv_slots`` the same
    with the mask of real rows, ``nbytes`` the sum of the rows' bytes, ``attend`` each row's
    attention; ``velox.method_of`` finds the method of its rows. The update is not vectorised
    over rows (a call per row); the score-and-keep methods hold ragged rows in one state of
    slots instead (the module docstring)."""

    rows: tuple


def _per_row(x: mx.array, b: int, h: int, dims: str | None) -> bool:
    """Whether the array ``x`` has a batch axis: annotated with a leading ``b`` dim, or with a
    leading ``*bh`` (up to two leading axes, batch and kv heads: a table shared by the rows,
    or one a batch row where fitted to its rows) holding both of them, or without an
    annotation of shape ``[b, h, ...]`` (a shared table such as a rotation ``[d, d]`` or a
    codebook ``[c]`` has neither)."""
    if dims is not None:
        names = dims.split()
        if names[:1] == ["*bh"]:
            return x.ndim == len(names) + 1
        return names[:1] == ["b"]
    return x.ndim >= 2 and tuple(x.shape[:2]) == (b, h)


def _cut(x, i: int, b: int, h: int, dims: str | None, top: str | None):
    """Row ``i`` of the field ``x`` (an array, or a nested record, tuple, list or dict of
    them); ``top`` names a top-level field (arrays there without a batch axis must be empty)."""
    if isinstance(x, mx.array):
        if _per_row(x, b, h, dims):
            return x[i:i + 1]
        if top is not None and x.size:
            raise ValueError(f"its state's {top} {tuple(x.shape)} has no batch axis and holds data")
        return x
    if hasattr(x, "_fields"):
        notes = getattr(type(x), "__annotations__", {})
        return x._replace(**{n: _cut(y, i, b, h, _dims(notes.get(n)), None) for n, y in zip(x._fields, x)})
    if isinstance(x, (tuple, list)):
        return type(x)(_cut(y, i, b, h, None, None) for y in x)
    if isinstance(x, dict):
        return {k: _cut(y, i, b, h, None, None) for k, y in x.items()}
    return x


def split_rows(m, state) -> RowStates:
    """An ordinary batch ``state`` of method ``m`` as :class:`RowStates`: row ``i``'s state
    holds the batch state's per-row arrays at row ``i`` (an array annotated ``"b ..."``, or
    without an annotation one of shape ``[batch, kv_heads, ...]``, also inside nested
    records) and shares the rest (static fields, and the tables of a nested record: a
    codec's rotation and codebooks). Raises ValueError when an array directly in the state has
    no batch axis and holds data (a stream of every row's codes cannot be cut by row)."""
    b, h = (m.dims or _keys_dims)(state)[:2]
    notes = getattr(type(state), "__annotations__", {})
    try:
        rows = tuple(state._replace(**{n: _cut(x, i, b, h, _dims(notes.get(n)), n)
                                       for n, x in zip(state._fields, state)}) for i in range(b))
    except ValueError as e:
        raise ValueError(f"{m.key}: {e}, so the state cannot be split into rows; build the ragged "
                         "batch from one-row states (velox.ragged.RowStates)") from None
    return RowStates(rows)


def _pad_left(x: mx.array, width: int, fill) -> mx.array:
    return _pad_slots(x, width, fill, left=True)


def rows_kv(get_kv: Callable, rs: RowStates) -> tuple[mx.array, mx.array]:
    """Each row's ``get_kv``, left-padded with zeros to the widest row, stacked."""
    kv = [get_kv(r) for r in rs.rows]
    width = max(k.shape[2] for k, _ in kv)
    return tuple(mx.concatenate([_pad_left(x[j], width, 0) for x in kv], axis=0) for j in (0, 1))


def rows_positions(positions: Callable, rs: RowStates) -> mx.array:
    """Each row's positions, left-padded with -1 to the widest row, stacked."""
    pos = [positions(r) for r in rs.rows]
    width = max(p.shape[2] for p in pos)
    return mx.concatenate([_pad_left(p, width, -1) for p in pos], axis=0)


def rows_kv_slots(kv_slots: Callable, rs: RowStates):
    """Each row's ``kv_slots``, left-padded to the widest row and stacked, with the mask of
    the real rows (``None`` when every row fills every slot)."""
    parts = [kv_slots(r) for r in rs.rows]
    width = max(k.shape[2] for k, _, _ in parts)
    if all(k.shape[2] == width and m is None for k, _, m in parts):
        return (mx.concatenate([k for k, _, _ in parts], axis=0),
                mx.concatenate([v for _, v, _ in parts], axis=0), None)
    keys = mx.concatenate([_pad_left(k, width, 0) for k, _, _ in parts], axis=0)
    values = mx.concatenate([_pad_left(v, width, 0) for _, v, _ in parts], axis=0)
    masks = [mx.ones(k.shape[:3], mx.bool_) if m is None else m for k, _, m in parts]
    return keys, values, mx.concatenate([_pad_left(m, width, False) for m in masks], axis=0)


def rows_update(update: Callable, rs: RowStates, keys, values, queries, valid: np.ndarray) -> RowStates:
    """Row ``i``'s update on its first ``valid[i]`` tokens (its queries' first too); a row with
    none is kept as it is."""
    out = []
    for i, r in enumerate(rs.rows):
        v = int(valid[i])
        if v:
            q = None if queries is None else queries[i:i + 1, :, :v]
            r = update(r, keys[i:i + 1, :, :v], values[i:i + 1, :, :v], queries=q)
        out.append(r)
    return RowStates(tuple(out))


def rows_attend(attend: Callable, rs: RowStates, queries, keys, values, *, scale: float, mask=None):
    """Each row's ``attend`` with its own queries and new tokens, stacked."""
    return mx.concatenate([attend(r, queries[i:i + 1], keys[i:i + 1], values[i:i + 1], scale=scale, mask=mask)
                           for i, r in enumerate(rs.rows)], axis=0)
