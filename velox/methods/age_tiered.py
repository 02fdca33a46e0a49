"""AgeTiered: token age sets the bit-width; groups are re-quantized coarser as they age.

Tokens move between tiers in units of ``group_size`` (``G``) positions. Keys are quantized
per channel along the unit's tokens, values per token in groups of ``G`` channels (KIVI's
layout: per-channel values lose far more at 2 bits, +47% perplexity against +13% for KIVI
on SmolLM2). After ``T`` tokens, group ``j`` (newest token aged ``T - (j+1)G``) is at
``bits_recent`` while that age is below ``recent_boundary``, at ``bits_mid`` below
``mid_boundary`` and at ``bits_old`` after: never coarser than its newest token's age
entitles. The ``T mod G`` newest tokens wait exact. An aging group is re-quantized from its
previous tier's codes (exact values are not kept: a copy would cost more than the tiers
save): with ``bits_mid | bits_recent`` and ``bits_old | bits_mid``, ``k = (2**B-1)/(2**b-1)``
is an odd integer, the coarse grid (step ``k * scale``, same zero) is a subgrid of the fine
one, the coarse code is ``round(q / k)`` and the error stays within half the coarse step, as
for direct quantization. Codes depend on the values only, not on when a group aged: one
chunk or token-by-token decoding give bit-identical states.

Scales and zeros are float16 (``velox.quant.side_dtype``); the ``< G`` exact tokens keep the
model's dtype.

Shapes: ``<tier>_keys_codes [b, h, d, n_tier*bits/32]`` (tokens last, MLX's packing),
``_scales``/``_zeros [b, h, d, n_tier/G]``; ``<tier>_values_codes [b, h, n_tier, d*bits/32]``,
``_scales``/``_zeros [b, h, n_tier, d/G]``; ``residual_* [b, h, r, d]`` (r < G).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..registry import dims_of, register

__all__ = ["AgeTieredState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "error_bound", "tier_bits", "tier_counts"]

TIERS = ("old", "mid", "recent")  # storage (and position) order: oldest groups first
_PARTS = ("codes", "scales", "zeros")


class AgeTieredState(NamedTuple):
    """Per tier: packed codes, scales and zeros of keys and values; the exact newest tokens."""

    old_keys_codes: UInt[Array, "b h d wo"]
    old_keys_scales: Float[Array, "b h d go"]
    old_keys_zeros: Float[Array, "b h d go"]
    old_values_codes: UInt[Array, "b h no vo"]
    old_values_scales: Float[Array, "b h no gv"]
    old_values_zeros: Float[Array, "b h no gv"]
    mid_keys_codes: UInt[Array, "b h d wm"]
    mid_keys_scales: Float[Array, "b h d gm"]
    mid_keys_zeros: Float[Array, "b h d gm"]
    mid_values_codes: UInt[Array, "b h nm vm"]
    mid_values_scales: Float[Array, "b h nm gv"]
    mid_values_zeros: Float[Array, "b h nm gv"]
    recent_keys_codes: UInt[Array, "b h d wr"]
    recent_keys_scales: Float[Array, "b h d gr"]
    recent_keys_zeros: Float[Array, "b h d gr"]
    recent_values_codes: UInt[Array, "b h nr vr"]
    recent_values_scales: Float[Array, "b h nr gv"]
    recent_values_zeros: Float[Array, "b h nr gv"]
    residual_keys: Float[Array, "b h r d"]
    residual_values: Float[Array, "b h r d"]
    next_pos: Int[Array, "b h"]
    recent_boundary: int
    mid_boundary: int
    bits_recent: int
    bits_mid: int
    bits_old: int
    group_size: int
    backend: str


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         recent_boundary: int = 128, mid_boundary: int = 1024, bits_recent: int = 8,
         bits_mid: int = 4, bits_old: int = 2, group_size: int = 32,
         backend: str = "auto") -> AgeTieredState:
    """Empty AgeTiered state.

    Args:
        recent_boundary: a group is recent (bits_recent) while its newest token is younger than
            this.
        mid_boundary: a group is middle-aged (bits_mid) while its newest token is younger than
            this, old after.
        bits_recent: bits per element of recent groups.
        bits_mid: bits per element of middle-aged groups (divides bits_recent).
        bits_old: bits per element of old groups (divides bits_mid).
        group_size: tokens per group; each channel of a group has one scale and zero.
    """
    b, h, d = batch, kv_heads, head_dim
    sd, bits = quant.side_dtype(dtype), {"old": bits_old, "mid": bits_mid, "recent": bits_recent}
    empty = {}
    for tier in TIERS:
        empty[f"{tier}_keys_codes"] = mx.zeros((b, h, d, 0), mx.uint32)
        empty[f"{tier}_keys_scales"] = mx.zeros((b, h, d, 0), sd)
        empty[f"{tier}_keys_zeros"] = mx.zeros((b, h, d, 0), sd)
        empty[f"{tier}_values_codes"] = mx.zeros((b, h, 0, d * bits[tier] // 32), mx.uint32)
        empty[f"{tier}_values_scales"] = mx.zeros((b, h, 0, d // group_size), sd)
        empty[f"{tier}_values_zeros"] = mx.zeros((b, h, 0, d // group_size), sd)
    return AgeTieredState(**empty, residual_keys=mx.zeros((b, h, 0, d), dtype),
                          residual_values=mx.zeros((b, h, 0, d), dtype),
                          next_pos=mx.zeros((b, h), mx.int32), recent_boundary=recent_boundary,
                          mid_boundary=mid_boundary, bits_recent=bits_recent, bits_mid=bits_mid,
                          bits_old=bits_old, group_size=group_size, backend=backend)


# --- the tier rule (static: a function of the token count only) ---------------------------

def tier_bits(state: AgeTieredState) -> dict[str, int]:
    return {"old": state.bits_old, "mid": state.bits_mid, "recent": state.bits_recent}


def tier_counts(total: int, group_size: int, recent_boundary: int,
                mid_boundary: int) -> dict[str, int]:
    """Groups per tier after ``total`` tokens (group ``j`` is old iff ``total-(j+1)G >= mid``)."""
    groups = total // group_size
    old = min(groups, max(0, (total - mid_boundary) // group_size))
    old_or_mid = min(groups, max(0, (total - recent_boundary) // group_size))
    return {"old": old, "mid": old_or_mid - old, "recent": groups - old_or_mid}


def _stored_groups(state: AgeTieredState, tier: str) -> int:
    return getattr(state, f"{tier}_keys_scales").shape[-1]


def _tokens(state: AgeTieredState) -> int:
    return sum(_stored_groups(state, t) for t in TIERS) * state.group_size + state.residual_keys.shape[2]


def _ratio(fine: int, coarse: int) -> int:
    """Odd integer ``k`` with ``2**fine - 1 = k * (2**coarse - 1)``."""
    return ((1 << fine) - 1) // ((1 << coarse) - 1)


# --- mlx -------------------------------------------------------------------------------------

def _requantize(codes: UInt[Array, "*batch m"], scales, bits_from: int, bits_to: int):
    """Codes on the nested coarser grid: ``round(q / k)`` (``k`` odd: no ties), step ``k * scale``."""
    k = _ratio(bits_from, bits_to)
    if k == 1:
        return codes, scales
    coarse = (codes + (k - 1) // 2) // k
    return coarse.astype(mx.uint32), (scales.astype(mx.float32) * k).astype(scales.dtype)


def _unit(kind: str, g: int) -> int:
    """Scale (and zero) entries per unit of ``g`` tokens along a run's last axis."""
    return 1 if kind == "keys" else g


def _take(run: tuple, start: int, stop: int | None, g: int, unit: int) -> tuple:
    """Units ``[start, stop)`` of a run: unpacked ``(codes, scales, zeros)``, tokens last
    (codes ``g`` per unit, scales ``unit`` per unit)."""
    codes, scales, zeros = run
    end = None if stop is None else stop * unit
    return (codes[..., start * g:None if stop is None else stop * g],
            scales[..., start * unit:end], zeros[..., start * unit:end])


def _cat(a: tuple, b: tuple, axis: int = -1) -> tuple:
    return tuple(mx.concatenate([x, y], axis=axis) for x, y in zip(a, b))


def _to_run(kind: str, codes, scales, zeros, bits: int) -> tuple:
    """Stored (packed) codes to a run: keys ``[b, h, d, n]``; values transposed to tokens
    last, codes ``[b, h, d, n]``, scales ``[b, h, d/G, n]``."""
    if kind == "keys":
        return quant.unpack(codes, bits), scales, zeros
    return quant.unpack(codes, bits).swapaxes(2, 3), scales.swapaxes(2, 3), zeros.swapaxes(2, 3)


def _from_run(kind: str, run: tuple, bits: int) -> tuple:
    """Inverse of :func:`_to_run`: the stored layout, codes packed."""
    codes, scales, zeros = run
    if kind == "keys":
        return quant.pack(codes, bits), scales, zeros
    return quant.pack(codes.swapaxes(2, 3), bits), scales.swapaxes(2, 3), zeros.swapaxes(2, 3)


def _stored_slice(kind: str, stored: tuple, start: int, stop: int | None, g: int, bits: int) -> tuple:
    """Units ``[start, stop)`` of a tier's stored (packed) arrays, without unpacking."""
    codes, scales, zeros = stored
    if kind == "keys":
        w = g * bits // 32
        return (codes[..., start * w:None if stop is None else stop * w], scales[..., start:stop],
                zeros[..., start:stop])
    end = None if stop is None else stop * g
    return codes[:, :, start * g:end], scales[:, :, start * g:end], zeros[:, :, start * g:end]


def _update_mlx(state: AgeTieredState, keys, values, queries) -> AgeTieredState:
    g, s = state.group_size, keys.shape[2]
    bits = tier_bits(state)
    before = {t: _stored_groups(state, t) for t in TIERS}
    after = tier_counts(_tokens(state) + s, g, state.recent_boundary, state.mid_boundary)
    new_groups = sum(after.values()) - sum(before.values())
    fields = {"next_pos": state.next_pos + s}
    for kind, x in (("keys", keys), ("values", values)):
        rows = mx.concatenate([getattr(state, f"residual_{kind}"), x], axis=2)
        fields[f"residual_{kind}"] = rows[:, :, new_groups * g:]
        u, axis = _unit(kind, g), (-1 if kind == "keys" else 2)
        # Units entering a tier (runs: unpacked, tokens last, newer than the tier's stored
        # units): new complete units enter "recent"; a tier's oldest units move to the next.
        entering = None
        if new_groups:
            block = rows[:, :, :new_groups * g]
            if kind == "keys":  # per channel along the tokens
                q, sc, z = quant.quantize(block.swapaxes(2, 3), bits["recent"], g)
            else:               # per token along the channels
                q, sc, z = quant.quantize(block, bits["recent"], g)
            entering = _to_run(kind, q, sc, z, bits["recent"])
        for tier, coarser in (("recent", "mid"), ("mid", "old"), ("old", None)):
            stored = tuple(getattr(state, f"{tier}_{kind}_{p}") for p in _PARTS)
            n_in = 0 if entering is None else entering[1].shape[-1] // u
            leave = before[tier] + n_in - after[tier]
            old = min(leave, before[tier])  # leaving from the stored units, then from entering
            kept = _stored_slice(kind, stored, old, None, g, bits[tier])
            leaving = None
            if old:
                leaving = _to_run(kind, *_stored_slice(kind, stored, 0, old, g, bits[tier]), bits[tier])
            if n_in > leave - old:
                stay = _from_run(kind, _take(entering, leave - old, None, g, u), bits[tier])
                kept = _cat(kept, stay, axis)
            if leave > old:
                through = _take(entering, 0, leave - old, g, u)
                leaving = through if leaving is None else _cat(leaving, through)
            for p, arr in zip(_PARTS, kept):
                fields[f"{tier}_{kind}_{p}"] = arr
            entering = None
            if leaving is not None:
                codes, scales = _requantize(leaving[0], leaving[1], bits[tier], bits[coarser])
                entering = (codes, scales, leaving[2])
    return state._replace(**fields)


# --- reference: group by group, head by head, in NumPy ------------------------------------

def _np_quantize_rows(x: np.ndarray, bits: int, dtype: mx.Dtype):
    """One group ``[d, G]`` (float32): each channel (row) is a quantization group."""
    rows = [ref.quantize_group(row, bits, dtype) for row in x]
    return (np.stack([r[0] for r in rows]), np.array([r[1] for r in rows], np.float32),
            np.array([r[2] for r in rows], np.float32))


class _Group(NamedTuple):
    tier: str
    codes: np.ndarray   # keys [d, G], values [G, d]; uint32
    scale: np.ndarray   # keys [d], values [G, d/G]; float32 (the stored value)
    zero: np.ndarray


def _np_target_tier(state: AgeTieredState, j: int, total: int) -> str:
    age = total - (j + 1) * state.group_size  # age of the group's newest token
    if age < state.recent_boundary:
        return "recent"
    return "mid" if age < state.mid_boundary else "old"


def _np_stored(state: AgeTieredState, kind: str, tier: str, i: int, h: int) -> list:
    """The stored units of one head's tier, oldest first."""
    g, bits = state.group_size, tier_bits(state)[tier]
    if getattr(state, f"{tier}_{kind}_scales").size == 0:
        return []
    codes = ref.unpack_codes(ref.to_np(getattr(state, f"{tier}_{kind}_codes")[i, h], np.uint32), bits)
    scales = ref.to_np(getattr(state, f"{tier}_{kind}_scales")[i, h], np.float32)
    zeros = ref.to_np(getattr(state, f"{tier}_{kind}_zeros")[i, h], np.float32)
    if kind == "keys":   # codes [d, n], scales [d, n/G]
        return [_Group(tier, codes[:, k * g:(k + 1) * g], scales[:, k], zeros[:, k])
                for k in range(scales.shape[1])]
    return [_Group(tier, codes[k * g:(k + 1) * g], scales[k * g:(k + 1) * g], zeros[k * g:(k + 1) * g])
            for k in range(scales.shape[0] // g)]          # codes [n, d], scales [n, d/G]


def _np_head(state: AgeTieredState, kind: str, i: int, h: int, rows: np.ndarray, total: int):
    """One head's groups after the update: ``{tier: (packed codes, scales, zeros)}`` in the
    stored layout."""
    dtype, g, bits = quant.side_dtype(state.residual_keys.dtype), state.group_size, tier_bits(state)
    groups: list[_Group] = []
    for tier in TIERS:  # stored groups, oldest first
        groups += _np_stored(state, kind, tier, i, h)
    for k in range(rows.shape[0] // g):  # new complete groups start in the recent tier
        block = rows[k * g:(k + 1) * g]
        if kind == "keys":
            codes, scale, zero = _np_quantize_rows(block.T, bits["recent"], dtype)
        else:
            words, scale, zero = ref.quantize(block, bits["recent"], g, dtype)
            codes = ref.unpack_codes(words, bits["recent"])
        groups.append(_Group("recent", codes, scale, zero))
    order = ["recent", "mid", "old"]
    for j, grp in enumerate(groups):
        target = order.index(_np_target_tier(state, j, total))
        while order.index(grp.tier) < target:  # one tier at a time: recent -> mid -> old
            coarser = order[order.index(grp.tier) + 1]
            k = _ratio(bits[grp.tier], bits[coarser])
            codes = (grp.codes + (k - 1) // 2) // k  # nearest multiple of k (k is odd: no ties)
            scale = ref.round_to(grp.scale * np.float32(k), dtype)
            grp = _Group(coarser, codes.astype(np.uint32), scale, grp.zero)
        groups[j] = grp
    out = {}
    d = rows.shape[1]
    for tier in TIERS:
        mine = [grp for grp in groups if grp.tier == tier]
        if kind == "keys":
            codes = np.concatenate([grp.codes for grp in mine], 1) if mine else np.zeros((d, 0), np.uint32)
            side = lambda xs: np.stack(xs, 1) if xs else np.zeros((d, 0), np.float32)  # noqa: E731
            packed = ref.pack_codes(codes, bits[tier])
        else:
            side = (lambda xs: np.concatenate(xs, 0) if xs  # noqa: E731
                    else np.zeros((0, d // g), np.float32))
            packed = (ref.pack_codes(np.concatenate([grp.codes for grp in mine], 0), bits[tier]) if mine
                      else np.zeros((0, d * bits[tier] // 32), np.uint32))
        out[tier] = (packed, side([grp.scale for grp in mine]), side([grp.zero for grp in mine]))
    return out


def _update_reference(state: AgeTieredState, keys, values, queries) -> AgeTieredState:
    dtype, g = state.residual_keys.dtype, state.group_size
    s = keys.shape[2]
    total = _tokens(state) + s
    b, h = state.next_pos.shape
    fields = {"next_pos": state.next_pos + s}
    for kind, x in (("keys", keys), ("values", values)):
        rows = np.concatenate([ref.to_np(getattr(state, f"residual_{kind}"), np.float32),
                               ref.to_np(x, np.float32)], axis=2)
        done = g * (rows.shape[2] // g)
        heads = [[_np_head(state, kind, i, j, rows[i, j, :done], total) for j in range(h)]
                 for i in range(b)]
        for tier in TIERS:
            for n, part in enumerate(_PARTS):
                arr = np.stack([np.stack([heads[i][j][tier][n] for j in range(h)]) for i in range(b)])
                fields[f"{tier}_{kind}_{part}"] = (mx.array(arr) if part == "codes"
                                                   else ref.to_mx(arr, quant.side_dtype(dtype)))
        fields[f"residual_{kind}"] = ref.to_mx(rows[:, :, done:], dtype)
    return state._replace(**fields)


# --- public functions ----------------------------------------------------------------------

def get_kv(state: AgeTieredState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Dequantized old, mid and recent groups, then the exact newest tokens."""
    bits = tier_bits(state)
    out = []
    for kind in ("keys", "values"):
        parts = [quant.dequantize(*(getattr(state, f"{tier}_{kind}_{p}") for p in _PARTS),
                                  bits[tier], state.group_size, state.residual_keys.dtype)
                 for tier in TIERS]
        if kind == "keys":
            parts = [x.swapaxes(2, 3) for x in parts]
        out.append(mx.concatenate(parts + [getattr(state, f"residual_{kind}")], axis=2))
    return out[0], out[1]


positions = quant.every_position(_tokens)


def _requant_stages(state: AgeTieredState, tier: str) -> int:
    """Grid changes a group of ``tier`` went through (``k = 1`` steps change nothing)."""
    steps = {"recent": [], "mid": [("recent", "mid")], "old": [("recent", "mid"), ("mid", "old")]}
    bits = tier_bits(state)
    return sum(_ratio(bits[a], bits[c]) > 1 for a, c in steps[tier])


def error_bound(
        state: AgeTieredState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Per-element bound on ``|get_kv - input|``: half the tier's step plus rounding terms.

    The nested-grid re-quantization keeps the error within half the coarse step; each
    re-quantization adds rounding terms (the scale is rounded to float16 at every step, and
    the finer codes were computed against a rounded scale): ``2 (L + 1) u scale``
    per step, ``L = 2**bits - 1``, ``u`` the side dtype's unit roundoff (twice what they need).
    """
    bits = tier_bits(state)
    u = quant.unit_roundoff(quant.side_dtype(state.residual_keys.dtype))
    out = []
    for kind in ("keys", "values"):
        parts = []
        for tier in TIERS:
            scales = getattr(state, f"{tier}_{kind}_scales")
            bound = quant.error_bound(scales, getattr(state, f"{tier}_{kind}_zeros"), bits[tier],
                                      state.group_size)
            extra = _requant_stages(state, tier) * 2 * (1 << bits[tier]) * u
            bound = bound + extra * mx.repeat(scales.astype(mx.float32), state.group_size, axis=-1)
            parts.append(bound.swapaxes(2, 3) if kind == "keys" else bound)
        parts.append(mx.zeros(getattr(state, f"residual_{kind}").shape, mx.float32))
        out.append(mx.concatenate(parts, axis=2))
    return out[0], out[1]


State = AgeTieredState
method = register("age_tiered", AgeTieredState, init,
                  {"reference": _update_reference, "mlx": _update_mlx}, get_kv=get_kv,
                  positions=positions, error_bound=error_bound, dims=dims_of("residual_keys"))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
