"""NumPy helpers for the ``reference`` backends: the executable, readable spec of each rule.

Reference updates convert the state to NumPy, apply the method's rule head by head in
float64 (quantizers: float32, the precision their codes are defined in), and convert back.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .slots import Move

__all__ = ["to_np", "to_mx", "softmax", "visible", "attention_weights", "protected", "ranked", "top_budget",
           "scoring_queries", "Candidates", "candidates", "keep", "Head", "head", "compacted",
           "slot_losers", "slot_step", "place", "gather_move"]


def to_np(x: mx.array, dtype=np.float64) -> np.ndarray:
    """MLX array -> NumPy (via float32 for float inputs, so bfloat16 converts too)."""
    if x.dtype in (mx.float16, mx.bfloat16, mx.float32, mx.float64):
        return np.array(x.astype(mx.float32)).astype(dtype)
    return np.array(x)


def to_mx(x: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """NumPy -> MLX array of ``dtype``."""
    if dtype in (mx.float16, mx.bfloat16):
        return mx.array(np.asarray(x, dtype=np.float32)).astype(dtype)
    return mx.array(np.ascontiguousarray(x)).astype(dtype)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def scoring_queries(keys: np.ndarray, queries: np.ndarray | None) -> np.ndarray:
    """``[b, h, g, s, d]``: real queries grouped per kv head, or the new keys as proxies."""
    if queries is None:
        return keys[:, :, None]
    b, hq, s, d = queries.shape
    h = keys.shape[1]
    return queries.reshape(b, h, hq // h, s, d)


def visible(key_pos: np.ndarray, query_pos: np.ndarray) -> np.ndarray:
    """``[1, m, n]``: which of the keys at ``key_pos [n]`` the queries at ``query_pos [m]``
    attend: causal, and an empty slot (position -1) never."""
    k = key_pos[None, None, :]
    return (k <= query_pos[None, :, None]) & (k >= 0)


def attention_weights(q: np.ndarray, k: np.ndarray, key_pos: np.ndarray,
                      query_pos: np.ndarray) -> np.ndarray:
    """One head: weights ``[g, m, n]`` of queries ``[g, m, d]`` over keys ``[n, d]``, over the
    keys :func:`visible` to each query."""
    d = q.shape[-1]
    logits = q @ k.T / np.sqrt(d)
    return softmax(np.where(visible(key_pos, query_pos), logits, -np.inf))


def protected(positions: np.ndarray, total: int | np.integer, n_sink: int, recent: int = 0) -> np.ndarray:
    """Sinks (the first ``n_sink`` positions) and the ``recent`` newest of ``total`` tokens."""
    return (positions < n_sink) | (positions >= total - recent if recent else False)


def ranked(scores: np.ndarray) -> np.ndarray:
    """Scores as selections rank them: non-finite (NaN, +-inf) -> ``-inf``, the lowest rank."""
    scores = np.asarray(scores, dtype=np.float64)
    return np.where(np.isfinite(scores), scores, -np.inf)


def top_budget(scores: np.ndarray, budget: int, protect: np.ndarray | None = None) -> np.ndarray | None:
    """One head: indices of the ``budget`` best candidates, ascending (ties: newer wins;
    non-finite scores rank lowest, protected candidates highest)."""
    n = scores.shape[-1]
    if n <= budget:
        return None
    scores = ranked(scores)
    if protect is not None:
        scores = np.where(protect, np.inf, scores)
    order = np.lexsort((np.arange(n), scores))  # ascending by score, then by index
    return np.sort(order[n - budget:])


class Candidates(NamedTuple):
    """Stored rows followed by the new ones, as NumPy arrays (one selection's input)."""

    keys: np.ndarray       # [b, h, N, d] float32: exact copies of the rows
    values: np.ndarray     # [b, h, N, d] float32
    positions: np.ndarray  # [b, h, N] int64, absolute
    total: np.ndarray      # [b, h] int64: tokens seen, the new ones included
    new_keys: np.ndarray   # [b, h, s, d] float64, for scoring
    queries: np.ndarray | None  # [b, q, s, d] float64 real queries, or None


def candidates(state, keys: mx.array, values: mx.array, queries: mx.array | None) -> Candidates:
    """Concatenate a state's stored rows with ``s`` new rows."""
    s = keys.shape[2]
    nxt = to_np(state.next_pos, np.int64)
    return Candidates(
        keys=np.concatenate([to_np(state.keys, np.float32), to_np(keys, np.float32)], axis=2),
        values=np.concatenate([to_np(state.values, np.float32), to_np(values, np.float32)], axis=2),
        positions=np.concatenate([to_np(state.positions, np.int64), nxt[..., None] + np.arange(s)], axis=2),
        total=nxt + s, new_keys=to_np(keys), queries=None if queries is None else to_np(queries))


class Head(NamedTuple):
    """One head's candidates (stored rows, then the ``s`` new ones): what a score-and-keep
    rule's reference score reads (``velox.evict.score_and_keep``)."""

    keys: np.ndarray       # [N, d] float32: exact copies of the rows
    values: np.ndarray     # [N, d] float32
    positions: np.ndarray  # [N] int64, absolute
    total: int             # tokens seen, the new ones included
    probes: np.ndarray     # [g, s, d] float64: the new tokens' real queries, or their keys
    carried: dict          # this head's values of the rule's carried fields (the n stored
                           # rows, [n, ...]) and refreshed fields, as float64
    evicting: bool         # whether this update evicts
    s: int                 # new tokens


def head(cand: Candidates, i: int, j: int, carried: dict, evicting: bool) -> Head:
    """Row ``i``, kv head ``j`` of ``cand``."""
    probes = scoring_queries(cand.new_keys, cand.queries)[i, j]
    return Head(cand.keys[i, j], cand.values[i, j], cand.positions[i, j], int(cand.total[i, j]),
                probes, carried, evicting, cand.new_keys.shape[2])


def keep(state, cand: Candidates, chosen, **extra: np.ndarray):
    """New state holding, for each row ``[i][j]``, the candidates ``chosen[i][j]`` (None: all).

    ``extra`` arrays ``[b, h, N, ...]`` (per-candidate side data such as scores) are gathered the
    same way and stored under their field names with the field's current dtype.
    """
    dtype = state.keys.dtype
    b, h, N = cand.positions.shape
    rows = [[np.arange(N) if chosen[i][j] is None else chosen[i][j] for j in range(h)] for i in range(b)]

    def gather(x: np.ndarray) -> np.ndarray:
        return np.stack([np.stack([x[i, j, rows[i][j]] for j in range(h)]) for i in range(b)])

    fields = dict(keys=to_mx(gather(cand.keys), dtype), values=to_mx(gather(cand.values), dtype),
                  positions=to_mx(gather(cand.positions), mx.int32),
                  next_pos=to_mx(cand.total, mx.int32))
    for name, x in extra.items():
        fields[name] = to_mx(gather(x), getattr(state, name).dtype)
    return state._replace(**fields)


# --- slots (velox.evict): rows in any order, positions say which token each slot holds ---

def _gather_field(x: mx.array, rows: np.ndarray) -> mx.array:
    """``x [b, h, n, ...]`` gathered along the token axis by ``rows [b, h, k]`` (exact: float
    fields go through float32, which holds every float16 and bfloat16 value)."""
    a = to_np(x, np.float32) if x.dtype in (mx.float16, mx.bfloat16, mx.float32) else np.array(x)
    idx = rows.reshape(rows.shape + (1,) * (a.ndim - 3))
    return to_mx(np.take_along_axis(a, idx, axis=2), x.dtype)


def compacted(state, carry: tuple[str, ...] = ()):
    """``state`` with each head's filled slots gathered in increasing position (keys, values,
    positions and the ``carry`` fields) and no empty slot (``empty``: 0)."""
    pos = np.array(state.positions)
    empty = getattr(state, "empty", 0)
    rows = np.argsort(pos, axis=-1, kind="stable")[..., empty:]
    fields = {name: _gather_field(getattr(state, name), rows)
              for name in ("keys", "values", "positions", *carry)}
    if hasattr(state, "empty"):
        fields["empty"] = 0
    return state._replace(**fields)


def slot_losers(scores: np.ndarray, positions: np.ndarray, total: int | np.integer, drop: int, n_sink: int,
                recent: int = 0) -> np.ndarray:
    """One head: the ``drop`` losers among candidates in any order (indices), by ascending
    score then position (the older of equal scores goes first); non-finite scores rank lowest,
    protected tokens (:func:`protected`) never go."""
    r = np.where(protected(positions, total, n_sink, recent), np.inf, ranked(scores))
    return np.lexsort((positions, r))[:drop]


def slot_step(scores: np.ndarray, positions: np.ndarray, total: np.ndarray, n: int,
              evicting: bool, n_sink: int, recent: int) -> list:
    """A decode step on slots, head by head: ``[i][j] -> slot or None``. Evicting (``n``
    full slots and the new token): the loser goes and the new token, unless it lost, takes
    its slot. Otherwise the new token takes the first empty slot."""
    b, h, _ = positions.shape
    out = [[None] * h for _ in range(b)]
    for i in range(b):
        for j in range(h):
            pos = positions[i, j]
            if not evicting:
                out[i][j] = int(np.flatnonzero(pos[:n] < 0)[0])
                continue
            loser = int(slot_losers(scores[i, j], pos, total[i, j], 1, n_sink, recent)[0])
            out[i][j] = None if loser == n else loser
    return out


def place(state, cand: Candidates, slots: list, **extra: np.ndarray):
    """The state after a decode step on slots (:func:`slot_step`): each head's new token
    (candidate ``n``) written at its slot; ``extra`` per-candidate arrays ``[b, h, n + 1,
    ...]`` are placed the same way. Returns the state and its ``velox.evict.Move``."""
    b, h, N = cand.positions.shape
    n = N - 1
    dtype = state.keys.dtype
    arrays = dict(keys=cand.keys, values=cand.values, positions=cand.positions, **extra)
    out = {name: x[:, :, :n].copy() for name, x in arrays.items()}
    slot = np.zeros((b, h, 1), np.int32)
    write = np.zeros((b, h, 1), bool)
    for i in range(b):
        for j in range(h):
            at = slots[i][j]
            if at is not None:
                slot[i, j, 0], write[i, j, 0] = at, True
                for name, x in arrays.items():
                    out[name][i, j, at] = x[i, j, n]
    fields = dict(keys=to_mx(out["keys"], dtype), values=to_mx(out["values"], dtype),
                  positions=to_mx(out["positions"], mx.int32), next_pos=to_mx(cand.total, mx.int32))
    for name in extra:
        fields[name] = to_mx(out[name], getattr(state, name).dtype)
    return state._replace(**fields), Move(slot=mx.array(slot), write=mx.array(write))


def amortized(state, cand: Candidates, by: np.ndarray, slack: int, n_sink: int, recent: int,
              **extra: np.ndarray):
    """Amortized eviction's selection (``slack > 0``) at a full state of ``n`` slots and the
    new token, head by head: the ``slack + 1`` losers by the scores ``by`` go, the kept
    candidates fill the first ``n - slack`` slots in candidate order, and the last ``slack``
    slots are empty (position -1; their rows hold candidate 0's). ``extra`` per-candidate
    arrays are kept the same way. Returns the state and its ``velox.evict.Move``."""
    b, h, N = cand.positions.shape
    n = N - 1
    chosen = [[None] * h for _ in range(b)]
    for i in range(b):
        for j in range(h):
            lost = slot_losers(by[i, j], cand.positions[i, j], cand.total[i, j], slack + 1, n_sink, recent)
            kept = np.setdiff1d(np.arange(N), lost)  # ascending
            chosen[i][j] = np.concatenate([kept, np.zeros(slack, np.int64)]).astype(np.int32)
    new = keep(state, cand, chosen, **extra)
    positions = np.array(new.positions)
    positions[:, :, n - slack:] = -1
    idx = np.stack([np.stack(row) for row in chosen])
    return new._replace(positions=to_mx(positions, mx.int32)), Move(idx=mx.array(idx), pad=slack)


def gather_move(chosen, n: int, s: int):
    """The ``velox.evict.Move`` of :func:`keep`'s choice (``None`` everywhere: append)."""
    if all(c is None for row in chosen for c in row):
        return Move()
    return Move(idx=mx.array(np.stack([np.stack(row) for row in chosen]).astype(np.int32)))


# --- group quantization, written out with NumPy (float32, the formula of velox.quant) ---

def round_to(x: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """Round float32 values to ``dtype`` and back (the stored precision of scales/zeros)."""
    return to_np(to_mx(x, dtype), np.float32)


def quantize_group(x: np.ndarray, bits: int, dtype: mx.Dtype):
    """One group (1-D float32): codes, stored scale, stored zero (scale 0 -> codes 0)."""
    levels = 2 ** bits - 1
    scale = round_to(np.array([(x.max() - x.min()) / np.float32(levels)], np.float32), dtype)[0]
    zero = round_to(np.array([x.min()], np.float32), dtype)[0]
    if scale == 0:
        return np.zeros(x.shape, np.uint32), scale, zero
    q = np.clip(np.round((x - zero) / scale), 0, levels)
    return q.astype(np.uint32), scale, zero


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Little-endian bit stream of ``bits``-bit codes along the last axis, as uint32 words."""
    lead = codes.shape[:-1]
    bitplanes = (codes[..., None] >> np.arange(bits, dtype=np.uint32)) & 1  # [..., m, bits]
    stream = np.packbits(bitplanes.reshape(*lead, -1).astype(np.uint8), axis=-1, bitorder="little")
    return np.ascontiguousarray(stream).view("<u4").reshape(*lead, -1)


def unpack_codes(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`."""
    lead = words.shape[:-1]
    stream = np.unpackbits(np.ascontiguousarray(words.astype("<u4")).view(np.uint8), axis=-1,
                           bitorder="little").reshape(*lead, -1, bits)
    return (stream.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(-1).astype(np.uint32)


def quantize(x: np.ndarray, bits: int, group_size: int, dtype: mx.Dtype):
    """Groups of ``group_size`` along the last axis: packed codes, scales, zeros (float32)."""
    lead, m = x.shape[:-1], x.shape[-1]
    groups = x.reshape(-1, m // group_size, group_size)
    codes = np.zeros(groups.shape, np.uint32)
    scales = np.zeros(groups.shape[:2], np.float32)
    zeros = np.zeros(groups.shape[:2], np.float32)
    for r in range(groups.shape[0]):
        for g in range(groups.shape[1]):
            codes[r, g], scales[r, g], zeros[r, g] = quantize_group(groups[r, g], bits, dtype)
    return (pack_codes(codes.reshape(*lead, m), bits), scales.reshape(*lead, -1),
            zeros.reshape(*lead, -1))


def dequantize(words: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int,
               group_size: int) -> np.ndarray:
    """``q * scale + zero`` in float32."""
    q = unpack_codes(words, bits).astype(np.float32)
    lead, m = q.shape[:-1], q.shape[-1]
    q = q.reshape(*lead, m // group_size, group_size)
    return (q * scales[..., None] + zeros[..., None]).reshape(*lead, m)
