"""GEAR: group quantization plus a low-rank and a sparse correction of its error.

Tokens are compressed in blocks of ``group_size`` (``G``); the ``T mod G`` newest wait exact
(the streaming buffer). Per head and block ``X [G, d]`` (keys, and values unless
``quantize_values=False``): the ``k = round(sparse_fraction * G * d / 2)`` largest and ``k``
smallest entries are kept exact (value and index); the others are quantized, outliers left
out of the ranges (keys per channel along the tokens, values per token in groups of ``G``
channels): ``D``; the residual ``R = X - D`` (zero at the outliers) gets a truncated SVD of
width ``rank``, ``R ~ L Rt`` (``L = U s``, float16 like the scales and zeros), whose
components after those holding ``energy_threshold`` of ``|R|^2`` are zeroed. ``get_kv`` is
``D + L Rt`` with the outliers restored. Blocks depend on their own tokens only: one chunk
or token-by-token decoding give bit-identical states. Error bound: the quantization bound plus ``|L Rt|``.

Shapes: ``keys_codes [b, h, d, Q*bits/32]``, ``keys_scales``/``_zeros [b, h, d, Q/G]``,
``values_codes [b, h, Q, d*bits/32]``, ``values_scales``/``_zeros [b, h, Q, d/G]``,
``*_left [b, h, Q, r]``, ``*_right [b, h, Q/G, r, d]``, ``*_outliers`` and
``*_outlier_index [b, h, Q/G, 2k]`` (offsets in the block's ``G*d`` entries),
``residual_* [b, h, n, d]``.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..ordering import order_key, order_key_np
from ..registry import dims_of, register

__all__ = ["GearState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "error_bound", "outlier_count", "base_reconstruction"]

_FIELDS = ("codes", "scales", "zeros", "left", "right", "outliers", "outlier_index")


class GearState(NamedTuple):
    """Per block: codes, scales, zeros, low-rank factors and exact outliers; exact tail."""

    keys_codes: UInt[Array, "b h d kw"]
    keys_scales: Float[Array, "b h d nb"]
    keys_zeros: Float[Array, "b h d nb"]
    keys_left: Float[Array, "b h q r"]
    keys_right: Float[Array, "b h nb r d"]
    keys_outliers: Float[Array, "b h nb k"]
    keys_outlier_index: UInt[Array, "b h nb k"]
    values_codes: UInt[Array, "b h q vw"]
    values_scales: Float[Array, "b h q vg"]
    values_zeros: Float[Array, "b h q vg"]
    values_left: Float[Array, "b h q r"]
    values_right: Float[Array, "b h nb r d"]
    values_outliers: Float[Array, "b h nb k"]
    values_outlier_index: UInt[Array, "b h nb k"]
    residual_keys: Float[Array, "b h n d"]
    residual_values: Float[Array, "b h n d"]
    next_pos: Int[Array, "b h"]
    bits: int
    rank: int
    energy_threshold: float
    sparse_fraction: float
    group_size: int
    quantize_values: bool
    backend: str


def outlier_count(sparse_fraction: float, group_size: int, head_dim: int) -> int:
    """Outliers per block and head: ``2 * round(sparse_fraction * G * d / 2)``."""
    return 2 * int(round(sparse_fraction * group_size * head_dim / 2))


def _index_dtype(group_size: int, head_dim: int) -> mx.Dtype:
    return mx.uint16 if group_size * head_dim <= 1 << 16 else mx.uint32


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, rank: int = 2, energy_threshold: float = 0.9,
         sparse_fraction: float = 0.01, group_size: int = 32, quantize_values: bool = True,
         backend: str = "auto") -> GearState:
    """Empty GEAR state.

    Args:
        bits: bits per quantized element.
        rank: width of the low-rank residual factors per head and block (0: no low-rank term).
        energy_threshold: components after the first ones holding this fraction of the
            residual's energy are zeroed.
        sparse_fraction: fraction of each block's entries kept exact (half the largest, half
            the smallest).
        group_size: tokens per block (and per key group); channels per value group.
        quantize_values: compress values too (else they are stored exact).
    """
    b, h, d, g, r = batch, kv_heads, head_dim, group_size, rank
    k = outlier_count(sparse_fraction, g, d)
    idx = _index_dtype(g, d)
    sd = quant.side_dtype(dtype)
    z = lambda *shape, t=sd: mx.zeros(shape, t)  # noqa: E731
    return GearState(
        keys_codes=z(b, h, d, 0, t=mx.uint32), keys_scales=z(b, h, d, 0), keys_zeros=z(b, h, d, 0),
        keys_left=z(b, h, 0, r), keys_right=z(b, h, 0, r, d), keys_outliers=z(b, h, 0, k, t=dtype),
        keys_outlier_index=z(b, h, 0, k, t=idx),
        values_codes=z(b, h, 0, d * bits // 32, t=mx.uint32), values_scales=z(b, h, 0, d // g),
        values_zeros=z(b, h, 0, d // g), values_left=z(b, h, 0, r), values_right=z(b, h, 0, r, d),
        values_outliers=z(b, h, 0, k, t=dtype), values_outlier_index=z(b, h, 0, k, t=idx),
        residual_keys=z(b, h, 0, d, t=dtype), residual_values=z(b, h, 0, d, t=dtype),
        next_pos=z(b, h, t=mx.int32), bits=bits, rank=rank, energy_threshold=energy_threshold,
        sparse_fraction=sparse_fraction, group_size=group_size, quantize_values=quantize_values,
        backend=backend)


def quantized_blocks(state: GearState) -> int:
    return state.keys_scales.shape[-1]


def _kinds(state: GearState) -> tuple[str, ...]:
    return ("keys", "values") if state.quantize_values else ("keys",)


# --- mlx -----------------------------------------------------------------------------------

def _outliers(x: Float[Array, "*batch n"], k: int):
    """Indices of the ``k`` smallest then the ``k`` largest entries (ties: the lower index is
    the smaller), and the mask of them."""
    order = mx.argsort(order_key(x), axis=-1)
    n = x.shape[-1]
    idx = mx.concatenate([order[..., :k], order[..., n - k:]], axis=-1).astype(mx.int32)
    mask = mx.zeros(x.shape, mx.bool_)
    if k:
        mask = mx.put_along_axis(mask, idx, mx.array(True), axis=-1)
    return idx, mask


def _lowrank(resid: Float[Array, "*batch G d"], rank: int, threshold: float, dtype: mx.Dtype):
    """Truncated SVD factors ``L [*, G, r]``, ``Rt [*, r, d]`` (cache dtype), energy-trimmed."""
    g, d = resid.shape[-2:]
    if rank == 0:
        batch = resid.shape[:-2]
        return mx.zeros((*batch, g, 0), dtype), mx.zeros((*batch, 0, d), dtype)
    u, s, vt = mx.linalg.svd(resid, stream=mx.cpu)
    r = rank
    s = s[..., :r]
    energy = s * s
    total = (resid * resid).sum(axis=(-2, -1))[..., None]
    before = mx.cumsum(energy, axis=-1) - energy  # energy of the components before each one
    keep = before < threshold * total
    s = mx.where(keep, s, 0.0)
    return (u[..., :r] * s[..., None, :]).astype(dtype), vt[..., :r, :].astype(dtype)


def _correction(left: Float[Array, "*batch G r"],
                right: Float[Array, "*batch r d"]) -> Float[Array, "*batch G d"]:
    """``L @ Rt`` in float32, summed component by component (the same order on every path)."""
    out = None
    for j in range(left.shape[-1]):
        term = left[..., :, j:j + 1].astype(mx.float32) * right[..., j:j + 1, :].astype(mx.float32)
        out = term if out is None else out + term
    return out


def _compress(state: GearState, kind: str, blocks: Float[Array, "b h m G d"]) -> dict:
    """New fields of ``m`` blocks of ``kind``."""
    b, h, m, g, d = blocks.shape
    dtype = blocks.dtype
    k = outlier_count(state.sparse_fraction, g, d)
    x = blocks.astype(mx.float32)
    flat = x.reshape(b, h, m, g * d)
    idx, mask = _outliers(flat, k // 2)
    mask = mask.reshape(b, h, m, g, d)
    # Quantize with the outliers out of the ranges: put each group's inlier minimum in their place.
    if kind == "keys":  # per channel along the block's tokens: groups are [.., d, G]
        xt, mt = x.swapaxes(-1, -2), mask.swapaxes(-1, -2)
        fill = mx.where(mt, mx.inf, xt).min(axis=-1, keepdims=True)
        fill = mx.where(mx.isinf(fill), 0.0, fill)
        xq = mx.where(mt, fill, xt).astype(dtype)                      # [b, h, m, d, G]
        xq = xq.transpose(0, 1, 3, 2, 4).reshape(b, h, d, m * g)
        codes, scales, zeros = quant.quantize(xq, state.bits, g)
        deq = quant.dequantize_f32(codes, scales, zeros, state.bits, g)
        deq = deq.reshape(b, h, d, m, g).transpose(0, 1, 3, 4, 2)    # [b, h, m, G, d]
    else:  # per token, groups of G channels
        grp = x.reshape(b, h, m, g, d // g, g)
        gm = mask.reshape(b, h, m, g, d // g, g)
        fill = mx.where(gm, mx.inf, grp).min(axis=-1, keepdims=True)
        fill = mx.where(mx.isinf(fill), 0.0, fill)
        xq = mx.where(gm, fill, grp).reshape(b, h, m * g, d).astype(dtype)
        codes, scales, zeros = quant.quantize(xq, state.bits, g)
        deq = quant.dequantize_f32(codes, scales, zeros, state.bits, g).reshape(b, h, m, g, d)
    resid = mx.where(mask, 0.0, x - deq)
    resid = mx.where(mx.isfinite(resid), resid, 0.0)  # a non-finite group gets no correction
    left, right = _lowrank(resid, state.rank, state.energy_threshold, quant.side_dtype(dtype))
    vals = mx.take_along_axis(flat, idx, axis=-1).astype(dtype)
    new = {"codes": codes, "scales": scales, "zeros": zeros,
           "left": left.reshape(b, h, m * g, state.rank), "right": right, "outliers": vals,
           "outlier_index": idx.astype(getattr(state, f"{kind}_outlier_index").dtype)}
    return {f"{kind}_{f}": mx.concatenate([getattr(state, f"{kind}_{f}"), new[f]], axis=_axis(kind, f))
            for f in _FIELDS}


def _axis(kind: str, field: str) -> int:
    """The token (or block) axis of a stored field: keys' codes hold tokens last."""
    return -1 if kind == "keys" and field in ("codes", "scales", "zeros") else 2


def _update_mlx(state: GearState, keys, values, queries) -> GearState:
    g, s = state.group_size, keys.shape[2]
    b, h, _, d = keys.shape
    fields = {"next_pos": state.next_pos + s}
    for kind, x in (("keys", keys), ("values", values)):
        rows = mx.concatenate([getattr(state, f"residual_{kind}"), x], axis=2)
        if kind not in _kinds(state):
            fields[f"residual_{kind}"] = rows
            continue
        m = rows.shape[2] // g
        fields[f"residual_{kind}"] = rows[:, :, m * g:]
        if m:
            fields.update(_compress(state, kind, rows[:, :, :m * g].reshape(b, h, m, g, d)))
    return state._replace(**fields)


# --- reference: head by head, block by block, in NumPy ----------------------------------------

def _np_block(state: GearState, kind: str, x: np.ndarray, dtype: mx.Dtype) -> dict:
    """One head's block ``x [G, d]`` (float32): its stored fields, tokens on the first axis
    (keys' codes, scales and zeros: channels first, tokens last, as stored)."""
    g, d = x.shape
    bits, r = state.bits, state.rank
    k = outlier_count(state.sparse_fraction, g, d) // 2
    order = np.argsort(order_key_np(x.ravel()))  # (value, index), as the mlx path
    idx = np.concatenate([order[:k], order[g * d - k:]])
    mask = np.zeros(g * d, bool)
    mask[idx] = True
    mask = mask.reshape(g, d)
    # Quantization groups: a channel's G tokens (keys) or a token's G channels (values);
    # outliers take the group's inlier minimum so they do not widen its range.
    lines = ([(slice(None), c) for c in range(d)] if kind == "keys"
             else [(t, slice(c * g, (c + 1) * g)) for t in range(g) for c in range(d // g)])
    codes = np.zeros((g, d), np.uint32)
    deq = np.zeros_like(x)
    scales, zeros = [], []
    for line in lines:
        vals, out = x[line], mask[line]
        fill = vals[~out].min() if (~out).any() else np.float32(0)
        q, scale, zero = ref.quantize_group(np.where(out, fill, vals).astype(np.float32), bits,
                                            quant.side_dtype(dtype))
        codes[line], deq[line] = q, q.astype(np.float32) * scale + zero
        scales.append(scale)
        zeros.append(zero)
    with np.errstate(invalid="ignore"):
        resid = np.where(mask, np.float32(0), x - deq)
        resid = np.where(np.isfinite(resid), resid, np.float32(0))  # a non-finite group: none
    if r:  # the SVD routine of the mlx path, so the factors agree bit for bit
        u, s, vt = (np.array(a) for a in mx.linalg.svd(mx.array(resid), stream=mx.cpu))
        s = s[:r]
        energy = s * s
        before = np.cumsum(energy) - energy
        s = np.where(before < np.float32(state.energy_threshold) * (resid * resid).sum(),
                     s, np.float32(0))
        left, right = u[:, :r] * s[None, :], vt[:r]
    else:
        left, right = np.zeros((g, 0), np.float32), np.zeros((0, d), np.float32)
    shape = (d, 1) if kind == "keys" else (g, d // g)
    return {"codes": codes.T if kind == "keys" else codes,
            "scales": np.array(scales, np.float32).reshape(shape),
            "zeros": np.array(zeros, np.float32).reshape(shape), "left": left, "right": right[None],
            "outliers": x.ravel()[idx][None], "outlier_index": idx[None]}


def _update_reference(state: GearState, keys, values, queries) -> GearState:
    dtype, g, s = state.residual_keys.dtype, state.group_size, keys.shape[2]
    b, h, _, d = keys.shape
    fields = {"next_pos": state.next_pos + s}
    for kind, x in (("keys", keys), ("values", values)):
        rows = np.concatenate([ref.to_np(getattr(state, f"residual_{kind}"), np.float32),
                               ref.to_np(x, np.float32)], axis=2)
        m = rows.shape[2] // g if kind in _kinds(state) else 0
        fields[f"residual_{kind}"] = ref.to_mx(rows[:, :, m * g:], dtype)
        if not m:
            continue
        blocks = [[[_np_block(state, kind, rows[i, j, n * g:(n + 1) * g], dtype) for n in range(m)]
                   for j in range(h)] for i in range(b)]
        for f in _FIELDS:
            axis = -1 if _axis(kind, f) == -1 else 0  # the blocks' token (or block) axis
            new = np.stack([np.stack([np.concatenate([blk[f] for blk in head], axis=axis)
                                      for head in row]) for row in blocks])
            old = getattr(state, f"{kind}_{f}")
            if f == "codes":
                new = mx.array(ref.pack_codes(new.astype(np.uint32), state.bits))
            elif f == "outlier_index":
                new = mx.array(new.astype(np.int64)).astype(old.dtype)
            else:
                new = ref.to_mx(new, old.dtype)
            fields[f"{kind}_{f}"] = mx.concatenate([old, new], axis=_axis(kind, f))
    return state._replace(**fields)


# --- public functions ---------------------------------------------------------------------------

def base_reconstruction(state: GearState, kind: str) -> Float[Array, "b h q d"]:
    """The quantized part ``D`` of the compressed blocks (float32, no correction, no outliers)."""
    b, h, _, d = state.residual_keys.shape
    g = state.group_size
    deq = quant.dequantize_f32(getattr(state, f"{kind}_codes"), getattr(state, f"{kind}_scales"),
                               getattr(state, f"{kind}_zeros"), state.bits, g)
    return deq.swapaxes(2, 3) if kind == "keys" else deq


def _blocks(state: GearState, kind: str) -> tuple:
    """(D + L Rt before the outliers, the correction L Rt), both ``[b, h, nb, G, d]`` float32."""
    b, h, _, d = state.residual_keys.shape
    g, n, r = state.group_size, quantized_blocks(state), state.rank
    base = base_reconstruction(state, kind).reshape(b, h, n, g, d)
    if not r:
        return base, mx.zeros(base.shape, mx.float32)
    corr = _correction(getattr(state, f"{kind}_left").reshape(b, h, n, g, r),
                       getattr(state, f"{kind}_right"))
    return base + corr, corr


def get_kv(state: GearState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """``D + L Rt`` with exact outliers per compressed block, then the exact newest tokens."""
    b, h, _, d = state.residual_keys.shape
    g, n = state.group_size, quantized_blocks(state)
    out = []
    for kind in ("keys", "values"):
        tail = getattr(state, f"residual_{kind}")
        if kind not in _kinds(state):
            out.append(tail)
            continue
        x, _ = _blocks(state, kind)
        flat = x.reshape(b, h, n, g * d)
        idx = getattr(state, f"{kind}_outlier_index").astype(mx.int32)
        if idx.shape[-1]:
            flat = mx.put_along_axis(flat, idx, getattr(state, f"{kind}_outliers").astype(mx.float32),
                                     axis=-1)
        out.append(mx.concatenate([flat.reshape(b, h, n * g, d).astype(tail.dtype), tail], axis=2))
    return out[0], out[1]


positions = quant.every_position(lambda state: state.residual_values.shape[2] + (
    quantized_blocks(state) * state.group_size if state.quantize_values else 0))


def error_bound(state: GearState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Quantization bound plus the size of the low-rank correction at each element.

    ``|x - D| <= scale/2 + rounding`` (``quant.error_bound``) holds for the inliers; adding
    ``C = L Rt`` can move an entry by ``|C|``, plus the rounding of the sum (float32, then
    the cache dtype). Outliers are exact (the bound still holds there).
    """
    b, h, _, d = state.residual_keys.shape
    g, n, bits = state.group_size, quantized_blocks(state), state.bits
    u = quant.unit_roundoff(state.residual_keys.dtype)
    levels = (1 << bits) - 1
    out = []
    for kind in ("keys", "values"):
        tail = mx.zeros(getattr(state, f"residual_{kind}").shape, mx.float32)
        if kind not in _kinds(state):
            out.append(tail)
            continue
        sc, zr = getattr(state, f"{kind}_scales"), getattr(state, f"{kind}_zeros")
        bound = quant.error_bound(sc, zr, bits, g)
        top = mx.repeat(mx.abs(zr.astype(mx.float32)) + levels * sc.astype(mx.float32), g, axis=-1)
        if kind == "keys":
            bound, top = bound.swapaxes(2, 3), top.swapaxes(2, 3)
        _, corr = _blocks(state, kind)
        corr = mx.abs(corr.reshape(b, h, n * g, d))
        bound = bound + (1 + 2 * u) * corr + 2.0 ** -23 * (top + corr)
        out.append(mx.concatenate([bound, tail], axis=2))
    return out[0], out[1]


State = GearState
method = register("gear", GearState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, error_bound=error_bound,
                  dims=dims_of("residual_keys"))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
