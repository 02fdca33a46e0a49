"""AdaKV-adapted: Ada-KV's head-adaptive budget applied to bits, per-head key bit-widths.

Keys are quantized per channel in groups of ``group_size`` (``G``) tokens; the ``T mod G``
newest wait exact. When a group completes, each head of the row gets ``lo_bit``, ``mid_bit``
or ``hi_bit`` by its importance rank so that the mean over heads meets ``target_avg_bits``
(the seed's rule: ranks spread around the target, snapped to the widths, greedily corrected
to the target total); the allocation is redone every ``update_interval`` groups. Importance
accumulates group by group over the quantized tokens: ``norm_variance`` (variance of the key
norms, a quantization-sensitivity signal) or ``attention_entropy`` (Ada-KV's sign: the
normalised entropy of each group's last ``min(obs_window, G)`` keys, as proxy queries,
attending over the group). Statistics move in whole groups, so one chunk or token-by-token
decoding give bit-identical states. Values are stored exact (the seed's key-only method), in
``residual_dtype`` (float16 by default) like the newest keys; scales and zeros are float16.

Shapes: heads sit in slots sorted by rank, so each width holds a static number of them:
``<lo|mid|hi>_codes [b, n_width, d, Q*bits/32]``, ``_scales``/``_zeros [b, n_width, d,
Q/G]``, ``head_slot [b, h, Q/G]``, ``stats [b, h, k]``, ``residual_keys [b, h, r, d]``,
``values [b, h, n, d]``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import nuq, quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..ordering import order_key
from ..registry import register
from . import kivi

__all__ = ["AdaKVState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "error_bound", "bits_by_rank", "level_counts", "head_bits"]

LEVELS = ("lo", "mid", "hi")
_PARTS = ("codes", "scales", "zeros")


class AdaKVState(NamedTuple):
    """Key codes per width level (slots sorted by importance), slot map, statistics, values."""

    lo_codes: UInt[Array, "b nl d wl"]
    lo_scales: Float[Array, "b nl d g"]
    lo_zeros: Float[Array, "b nl d g"]
    mid_codes: UInt[Array, "b nm d wm"]
    mid_scales: Float[Array, "b nm d g"]
    mid_zeros: Float[Array, "b nm d g"]
    hi_codes: UInt[Array, "b nh d wh"]
    hi_scales: Float[Array, "b nh d g"]
    hi_zeros: Float[Array, "b nh d g"]
    head_slot: UInt[Array, "b h g"]
    stats: Float[Array, "b h k"]
    residual_keys: Float[Array, "b h r d"]
    values: Float[Array, "b h n d"]
    next_pos: Int[Array, "b h"]
    target_avg_bits: float
    lo_bit: int
    mid_bit: int
    hi_bit: int
    group_size: int
    update_interval: int
    importance: str
    obs_window: int
    residual_dtype: str
    cache_dtype: str
    backend: str


# --- the allocation (the seed's rule, on distinct ranks: a static table) --------------------

@lru_cache(maxsize=None)
def bits_by_rank(heads: int, target: float, lo: int, mid: int, hi: int) -> tuple[int, ...]:
    """Bits of the head of importance rank ``r`` (0 = least important), ascending.

    The seed's allocation for distinct importances: ranks evenly spread on ``[-1/2, 1/2]``,
    placed at ``target + spread * z`` with the widest spread inside ``[lo, hi]``, snapped to
    the nearest allowed width (the lower one on a tie), then moved one width at a time, the
    head nearest to the boundary first, while that brings the total closer to
    ``heads * target``.
    """
    allowed = sorted({lo, mid, hi})
    if heads == 1:
        return (min(allowed, key=lambda b: abs(b - target)),)
    z = [r / (heads - 1) - 0.5 for r in range(heads)]
    spread = min((allowed[-1] - target) / 0.5, (target - allowed[0]) / 0.5)
    real = [min(max(target + spread * zh, allowed[0]), allowed[-1]) for zh in z]
    bits = [min(allowed, key=lambda b: abs(b - r)) for r in real]
    goal = heads * target
    for _ in range(heads * len(allowed) * 4):
        diff = goal - sum(bits)
        if abs(diff) < 1e-9:
            break
        step = 1 if diff > 0 else -1
        best, best_key = -1, None
        for i in range(heads):
            j = allowed.index(bits[i]) + step
            if not 0 <= j < len(allowed):
                continue
            key = (abs(real[i] - allowed[j]), -step * i)  # ties: importance decides
            if best_key is None or key < best_key:
                best, best_key = i, key
        if best < 0:
            break
        trial = list(bits)
        trial[best] = allowed[allowed.index(bits[best]) + step]
        if abs(goal - sum(trial)) >= abs(diff):
            break
        bits = trial
    return tuple(sorted(bits))


def level_counts(heads: int, target: float, lo: int, mid: int, hi: int) -> dict[str, int]:
    """Slots per width level: ``lo`` slots first, then ``mid``, then ``hi`` (distinct widths)."""
    table = bits_by_rank(heads, target, lo, mid, hi)
    return {"lo": table.count(lo), "mid": table.count(mid) if mid != lo else 0,
            "hi": table.count(hi) if hi not in (lo, mid) else 0}


def _counts(state: AdaKVState, heads: int) -> dict[str, int]:
    return level_counts(heads, state.target_avg_bits, state.lo_bit, state.mid_bit, state.hi_bit)


def level_bits(state: AdaKVState) -> dict[str, int]:
    return {"lo": state.lo_bit, "mid": state.mid_bit, "hi": state.hi_bit}


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         target_avg_bits: float = 2.5, lo_bit: int = 2, mid_bit: int = 3, hi_bit: int = 4,
         group_size: int = 32, update_interval: int = 1, importance: str = "norm_variance",
         obs_window: int = 32, residual_dtype: str = "float16",
         backend: str = "auto") -> AdaKVState:
    """Empty AdaKV state.

    Args:
        target_avg_bits: mean key bits over the heads of a row (adaptive only strictly between
            lo_bit and hi_bit).
        lo_bit: bits of the least important heads.
        mid_bit: bits of middle heads.
        hi_bit: bits of the most important heads.
        group_size: tokens per key group (one scale and zero per channel and group).
        update_interval: quantized groups between two allocations.
        importance: head importance: variance of key norms, or proxy attention entropy (Ada-KV's
            sign).
        obs_window: proxy queries per group for attention_entropy (at most group_size).
        residual_dtype: dtype of the rows held exact ("model": the cache dtype); scales and
            zeros are float16 (bfloat16 for a bfloat16 cache).
    """
    b, h, d = batch, kv_heads, head_dim
    sd, rd = quant.side_dtype(dtype), quant.exact_dtype(residual_dtype, dtype)
    counts = level_counts(h, target_avg_bits, lo_bit, mid_bit, hi_bit)
    levels = {}
    for lvl in LEVELS:
        levels[f"{lvl}_codes"] = mx.zeros((b, counts[lvl], d, 0), mx.uint32)
        levels[f"{lvl}_scales"] = mx.zeros((b, counts[lvl], d, 0), sd)
        levels[f"{lvl}_zeros"] = mx.zeros((b, counts[lvl], d, 0), sd)
    k = 2 if importance == "norm_variance" else 1
    return AdaKVState(**levels, head_slot=mx.zeros((b, h, 0), nuq.index_dtype(h)),
                      stats=mx.zeros((b, h, k), mx.float32),
                      residual_keys=mx.zeros((b, h, 0, d), rd), values=mx.zeros((b, h, 0, d), rd),
                      next_pos=mx.zeros((b, h), mx.int32), target_avg_bits=target_avg_bits,
                      lo_bit=lo_bit, mid_bit=mid_bit, hi_bit=hi_bit, group_size=group_size,
                      update_interval=update_interval, importance=importance,
                      obs_window=obs_window, residual_dtype=residual_dtype,
                      cache_dtype=quant.dtype_name(dtype), backend=backend)


def quantized_groups(state: AdaKVState) -> int:
    return state.head_slot.shape[-1]


# --- mlx ---------------------------------------------------------------------------------------

def _group_stats(state: AdaKVState, groups: Float[Array, "b h m G d"]) -> Float[Array, "b h m k"]:
    """Per-group additive statistics: (sum of norms, sum of squared norms) or (entropy,)."""
    x = groups.astype(mx.float32)
    if state.importance == "norm_variance":
        norms = mx.sqrt((x * x).sum(-1))
        return mx.stack([norms.sum(-1), (norms * norms).sum(-1)], axis=-1)
    g, d = x.shape[-2], x.shape[-1]
    w = min(state.obs_window, g)
    logits = (x[..., g - w:, :] @ x.swapaxes(-1, -2)) * (d ** -0.5)
    p = mx.softmax(logits, axis=-1, precise=True).mean(-2)
    ent = -(p * mx.log(mx.maximum(p, 1e-30))).sum(-1) / math.log(g)
    return ent[..., None]


def _importance(state: AdaKVState, stats: Float[Array, "b h k"], tokens: int) -> Float[Array, "b h"]:
    if state.importance == "norm_variance":
        mean = stats[..., 0] / tokens
        return stats[..., 1] / tokens - mean * mean
    return stats[..., 0]


def _ranks(importance: Float[Array, "b h"]) -> Int[Array, "b h"]:
    """Rank of each head by (importance, index), ascending: a permutation of ``0..h-1``."""
    order = mx.argsort(order_key(importance), axis=-1)
    return mx.argsort(order, axis=-1).astype(mx.int32)


def _update_mlx(state: AdaKVState, keys, values, queries) -> AdaKVState:
    g, s = state.group_size, keys.shape[2]
    b, h, _, d = keys.shape
    rd = state.residual_keys.dtype
    rows = mx.concatenate([state.residual_keys, keys.astype(rd)], axis=2)
    m = rows.shape[2] // g  # groups completed by this update
    fields = dict(residual_keys=rows[:, :, m * g:],
                  values=mx.concatenate([state.values, values.astype(rd)], 2),
                  next_pos=state.next_pos + s)
    if not m:
        return state._replace(**fields)
    groups = rows[:, :, :m * g].reshape(b, h, m, g, d)
    added = _group_stats(state, groups)
    stats, slot = state.stats, None
    start = quantized_groups(state)
    if start:
        slot = state.head_slot[..., -1].astype(mx.int32)
    slots = []
    for j in range(m):  # group by group: the same sums in the same order on every path
        stats = stats + added[:, :, j]
        if (start + j) % state.update_interval == 0:
            slot = _ranks(_importance(state, stats, (start + j + 1) * g))
        slots.append(slot)
    slot = mx.stack(slots, axis=-1)                                  # [b, h, m]
    head_of_slot = mx.argsort(slot, axis=1)                          # [b, slot, m]
    idx = mx.broadcast_to(head_of_slot[..., None, None], groups.shape)
    by_slot = mx.take_along_axis(groups, idx, axis=1)
    by_slot = by_slot.transpose(0, 1, 4, 2, 3).reshape(b, h, d, m * g)  # tokens last
    fields.update(stats=stats, head_slot=mx.concatenate(
        [state.head_slot, slot.astype(state.head_slot.dtype)], axis=-1))
    first = 0
    for lvl, n in _counts(state, h).items():
        bits = level_bits(state)[lvl]
        if n:
            q, sc, z = quant.quantize(by_slot[:, first:first + n], bits, g,
                                      quant.dtype_of(state.cache_dtype))
        else:  # an empty level keeps zero-size arrays whose token axis matches the others
            q = mx.zeros((b, 0, d, m * g * bits // 32), mx.uint32)
            sc = z = mx.zeros((b, 0, d, m), state.lo_scales.dtype)
        for part, new in zip(_PARTS, (q, sc, z)):
            fields[f"{lvl}_{part}"] = mx.concatenate([getattr(state, f"{lvl}_{part}"), new], -1)
        first += n
    return state._replace(**fields)


# --- reference: head by head, group by group, in NumPy ---------------------------------------

def _np_group_stats(state: AdaKVState, x: np.ndarray) -> np.ndarray:
    """One head's group ``[G, d]`` (float64): its additive statistics."""
    if state.importance == "norm_variance":
        norms = np.sqrt((x * x).sum(-1))
        return np.array([norms.sum(), (norms * norms).sum()])
    g, d = x.shape
    w = min(state.obs_window, g)
    p = ref.softmax(x[g - w:] @ x.T / np.sqrt(d)).mean(0)
    return np.array([-(p * np.log(np.maximum(p, 1e-30))).sum() / np.log(g)])


def _np_importance(state: AdaKVState, stats: np.ndarray, tokens: int) -> float:
    if state.importance == "norm_variance":
        mean = stats[0] / tokens
        return stats[1] / tokens - mean * mean
    return stats[0]


def _update_reference(state: AdaKVState, keys, values, queries) -> AdaKVState:
    rd, g = state.residual_keys.dtype, state.group_size
    dtype = quant.side_dtype(quant.dtype_of(state.cache_dtype))
    b, h, s, d = keys.shape
    rows = np.concatenate([ref.to_np(state.residual_keys, np.float32),
                           ref.round_to(ref.to_np(keys, np.float32), rd)], 2)
    m = rows.shape[2] // g
    fields = dict(residual_keys=ref.to_mx(rows[:, :, m * g:], rd),
                  values=mx.concatenate([state.values, values.astype(rd)], 2), next_pos=state.next_pos + s)
    if not m:
        return state._replace(**fields)
    start = quantized_groups(state)
    counts = _counts(state, h)
    stats = ref.to_np(state.stats, np.float64)
    slot = ref.to_np(state.head_slot, np.int64)[..., -1] if start else None
    new_slots = np.zeros((b, h, m), np.int64)
    per_level = {lvl: [[] for _ in range(b)] for lvl in LEVELS}
    for i in range(b):
        for j in range(m):
            group = rows[i, :, j * g:(j + 1) * g]  # [h, G, d]
            for hd in range(h):
                stats[i, hd] += _np_group_stats(state, group[hd].astype(np.float64))
            if (start + j) % state.update_interval == 0:
                imp = [_np_importance(state, stats[i, hd], (start + j + 1) * g) for hd in range(h)]
                order = np.lexsort((np.arange(h), np.array(imp)))  # least important first
                current = np.empty(h, np.int64)
                current[order] = np.arange(h)
                if slot is None:
                    slot = np.zeros((b, h), np.int64)
                slot[i] = current
            new_slots[i, :, j] = slot[i]
            # Quantize each head of this group at the width of its slot.
            by_slot = np.argsort(slot[i])
            first = 0
            for lvl in LEVELS:
                heads = by_slot[first:first + counts[lvl]]
                first += counts[lvl]
                bits = level_bits(state)[lvl]
                per_level[lvl][i].append([ref.quantize(group[hd].T, bits, g, dtype) for hd in heads])
    for lvl in LEVELS:
        n, bits = counts[lvl], level_bits(state)[lvl]
        for p, part in enumerate(_PARTS):
            if n:  # [row][group][slot] -> [b, slot, d, tokens]
                arr = np.stack([np.stack([np.concatenate([per_level[lvl][i][j][k][p]
                                                          for j in range(m)], -1)
                                          for k in range(n)]) for i in range(b)])
            else:
                arr = np.zeros((b, 0, d, m * g * bits // 32 if part == "codes" else m), np.float32)
            new = mx.array(arr.astype(np.uint32)) if part == "codes" else ref.to_mx(arr, dtype)
            fields[f"{lvl}_{part}"] = mx.concatenate([getattr(state, f"{lvl}_{part}"), new], -1)
    slots = mx.array(new_slots).astype(state.head_slot.dtype)
    fields.update(stats=ref.to_mx(stats, mx.float32),
                  head_slot=mx.concatenate([state.head_slot, slots], -1))
    return state._replace(**fields)


# --- public functions ---------------------------------------------------------------------------

def _by_head(state: AdaKVState, per_slot: Float[Array, "b h d q"]) -> Float[Array, "b h q d"]:
    """Slot-ordered ``[b, slot, d, Q]`` to head order ``[b, h, Q, d]`` (group by group)."""
    b, h, d, q = per_slot.shape
    g = state.group_size
    x = per_slot.reshape(b, h, d, q // g, g)
    idx = state.head_slot.astype(mx.int32)[:, :, None, :, None]
    out = mx.take_along_axis(x, mx.broadcast_to(idx, x.shape), axis=1)
    return out.reshape(b, h, d, q).swapaxes(2, 3)


def get_kv(state: AdaKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Dequantized key groups (each head at its width) and the exact newest keys; exact values."""
    bits, cd = level_bits(state), quant.dtype_of(state.cache_dtype)
    parts = [quant.dequantize(*(getattr(state, f"{lvl}_{p}") for p in _PARTS), bits[lvl],
                              state.group_size, cd) for lvl in LEVELS]
    k = _by_head(state, mx.concatenate(parts, axis=1))
    return mx.concatenate([k, state.residual_keys.astype(cd)], axis=2), state.values.astype(cd)


positions = quant.every_position(lambda state: state.values.shape[2])


def error_bound(state: AdaKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """``scale/2`` plus rounding per key element (each head at its width); exact rows: their
    rounding to ``residual_dtype``."""
    bits = level_bits(state)
    parts = [quant.error_bound(getattr(state, f"{lvl}_scales"), getattr(state, f"{lvl}_zeros"),
                               bits[lvl], state.group_size) for lvl in LEVELS]
    k = _by_head(state, mx.concatenate(parts, axis=1))
    cd = quant.dtype_of(state.cache_dtype)
    k = mx.concatenate([k, quant.rounding_bound(state.residual_keys, cd)], axis=2)
    return k, quant.rounding_bound(state.values, cd)


def head_bits(state: AdaKVState) -> Int[Array, "b h g"]:
    """Bits of each head in each quantized group."""
    b, h = state.next_pos.shape
    table = mx.array(bits_by_rank(h, state.target_avg_bits, state.lo_bit, state.mid_bit,
                                  state.hi_bit), mx.int32)
    return table[state.head_slot.astype(mx.int32)]


State = AdaKVState
method = register("adakv", AdaKVState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, error_bound=error_bound,
                  dims=kivi.dims)  # residual_keys' shape, the model's dtype
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
