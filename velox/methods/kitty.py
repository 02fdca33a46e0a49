"""Kitty: 2-bit keys with a per-group precision boost for the largest key channels.

Tokens wait exact in a buffer until ``group_size`` of them complete a group; a group is
quantized at once. Keys are quantized per channel over the group's tokens (KIVI's layout);
the ``round(hi_fraction * head_dim)`` channels of largest mean magnitude in the group are
boosted to ``hi_bit``, the others get ``lo_bit``. Values are quantized per token at
``lo_bit``. Every decision depends on the group's own tokens, so a prompt absorbed in one
chunk or token by token yields bit-identical states.

Storage (``G`` groups, ``Q = G * group_size`` tokens, ``c`` boosted channels): boosted codes
``[b, h, c, Q * hi_bit / 32]`` and the others ``[b, h, d - c, Q * lo_bit / 32]`` (row ``j`` of
group ``i`` is the group's ``j``-th boosted, resp. plain, channel), the boosted channel
indices ``[b, h, G, c]``, key scales and zeros ``[b, h, G, d]``, value codes packed along the
token axis ``[b, h, d, Q * lo_bit / 32]`` with per-token scales and zeros ``[b, h, Q]``.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import nuq, quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..registry import dims_of, register
from .zipcache import chosen_first_inverse, chosen_mask

__all__ = ["KittyState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "error_bound", "boosted_channels"]


class KittyState(NamedTuple):
    """Mixed-precision key codes, low-bit value codes, their side data and the exact buffer."""

    key_hi_codes: UInt[Array, "b h c w1"]
    key_lo_codes: UInt[Array, "b h e w2"]
    key_hi_channels: UInt[Array, "b h g c"]
    key_scales: Float[Array, "b h g d"]
    key_zeros: Float[Array, "b h g d"]
    value_codes: UInt[Array, "b h d w3"]
    value_scales: Float[Array, "b h nq"]
    value_zeros: Float[Array, "b h nq"]
    buffer_keys: Float[Array, "b h r d"]
    buffer_values: Float[Array, "b h r d"]
    next_pos: Int[Array, "b h"]
    hi_fraction: float
    hi_bit: int
    lo_bit: int
    group_size: int
    backend: str


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         hi_fraction: float = 0.25, hi_bit: int = 4, lo_bit: int = 2, group_size: int = 32,
         backend: str = "auto") -> KittyState:
    """Empty Kitty state.

    Args:
        hi_fraction: fraction of key channels per group boosted to hi_bit (rounded half up).
        hi_bit: bits of the boosted key channels.
        lo_bit: bits of the other key channels and of the values.
        group_size: tokens per quantization group (keys per channel, values per token).
    """
    b, h, d = batch, kv_heads, head_dim
    c = boosted_channels(hi_fraction, d)
    sd = quant.side_dtype(dtype)
    return KittyState(
        key_hi_codes=mx.zeros((b, h, c, 0), mx.uint32), key_lo_codes=mx.zeros((b, h, d - c, 0), mx.uint32),
        key_hi_channels=mx.zeros((b, h, 0, c), nuq.index_dtype(d)),
        key_scales=mx.zeros((b, h, 0, d), sd), key_zeros=mx.zeros((b, h, 0, d), sd),
        value_codes=mx.zeros((b, h, d, 0), mx.uint32), value_scales=mx.zeros((b, h, 0), sd),
        value_zeros=mx.zeros((b, h, 0), sd), buffer_keys=mx.zeros((b, h, 0, d), dtype),
        buffer_values=mx.zeros((b, h, 0, d), dtype), next_pos=mx.zeros((b, h), mx.int32),
        hi_fraction=hi_fraction, hi_bit=hi_bit, lo_bit=lo_bit, group_size=group_size,
        backend=backend)


def boosted_channels(hi_fraction: float, head_dim: int) -> int:
    """Channels per group at ``hi_bit``: ``hi_fraction * head_dim`` rounded half up."""
    return nuq.round_count(hi_fraction, head_dim)


def _split(state: KittyState, keys, values, cat):
    """Buffer + new rows, and how many leading rows form whole groups (flushed now)."""
    bk, bv = cat(state.buffer_keys, keys), cat(state.buffer_values, values)
    g = state.group_size
    return bk, bv, g * (bk.shape[2] // g)


def _update_mlx(state: KittyState, keys, values, queries) -> KittyState:
    cat = lambda a, x: mx.concatenate([a, x], axis=2)  # noqa: E731
    bk, bv, f = _split(state, keys, values, cat)
    fields = dict(buffer_keys=bk[:, :, f:], buffer_values=bv[:, :, f:],
                  next_pos=state.next_pos + keys.shape[2])
    if f:
        b, h, _, d = bk.shape
        g, n_g, c = state.group_size, f // state.group_size, state.key_hi_codes.shape[2]
        blk = bk[:, :, :f].reshape(b, h, n_g, g, d).swapaxes(3, 4)          # [b, h, G, d, g]
        top, perm = nuq.top_k_indices(nuq.tree_sum(mx.abs(blk)), c)        # rank channels per group
        rows = mx.take_along_axis(blk, perm[..., None], axis=3)            # boosted channels first
        parts = []
        for lo, hi, bits in ((0, c, state.hi_bit), (c, d, state.lo_bit)):
            if hi > lo:
                code, sc, zr = quant.quantize(rows[:, :, :, lo:hi], bits, g)
                code = code.transpose(0, 1, 3, 2, 4).reshape(b, h, hi - lo, -1)
                parts.append((code, sc[..., 0], zr[..., 0]))
            else:
                sd = quant.side_dtype(bk.dtype)
                parts.append((mx.zeros((b, h, 0, 0), mx.uint32), mx.zeros((b, h, n_g, 0), sd),
                              mx.zeros((b, h, n_g, 0), sd)))
        inv = mx.argsort(perm, axis=-1)
        sc = mx.take_along_axis(mx.concatenate([parts[0][1], parts[1][1]], axis=-1), inv, axis=-1)
        zr = mx.take_along_axis(mx.concatenate([parts[0][2], parts[1][2]], axis=-1), inv, axis=-1)
        vq, vs, vz = nuq.affine(bv[:, :, :f], state.lo_bit, bk.dtype)
        fields.update(
            key_hi_codes=_cat3(state.key_hi_codes, parts[0][0]),
            key_lo_codes=_cat3(state.key_lo_codes, parts[1][0]),
            key_hi_channels=cat(state.key_hi_channels, top.astype(state.key_hi_channels.dtype)),
            key_scales=cat(state.key_scales, sc), key_zeros=cat(state.key_zeros, zr),
            value_codes=_cat3(state.value_codes, quant.pack(vq.swapaxes(2, 3), state.lo_bit)),
            value_scales=cat(state.value_scales, vs), value_zeros=cat(state.value_zeros, vz))
    return state._replace(**fields)


def _cat3(a, x):
    return mx.concatenate([a, x], axis=3) if x.size else a


# --- reference: channel ranking and per-channel quantization, group by group, head by head ---

def _update_reference(state: KittyState, keys, values, queries) -> KittyState:
    dtype = state.buffer_keys.dtype
    cat = lambda a, x: np.concatenate([ref.to_np(a, np.float32), ref.to_np(x, np.float32)], 2)  # noqa: E731
    bk, bv, f = _split(state, keys, values, cat)
    fields = dict(buffer_keys=ref.to_mx(bk[:, :, f:], dtype), buffer_values=ref.to_mx(bv[:, :, f:], dtype),
                  next_pos=state.next_pos + keys.shape[2])
    if f:
        b, h, _, d = bk.shape
        g, c = state.group_size, state.key_hi_codes.shape[2]
        n_g = f // g
        hi_codes = np.zeros((b, h, c, f), np.uint32)
        lo_codes = np.zeros((b, h, d - c, f), np.uint32)
        chans = np.zeros((b, h, n_g, c), np.int64)
        ks, kz = np.zeros((b, h, n_g, d), np.float32), np.zeros((b, h, n_g, d), np.float32)
        vq = np.zeros((b, h, f, d), np.uint32)
        vs, vz = np.zeros((b, h, f), np.float32), np.zeros((b, h, f), np.float32)
        for i in range(b):
            for j in range(h):
                for t in range(n_g):
                    cols = slice(t * g, (t + 1) * g)
                    block = bk[i, j, cols].T                                  # [d, g]: a row per channel
                    boosted, order = nuq.np_top_k_indices(nuq.np_tree_sum(np.abs(block)), c)
                    chans[i, j, t] = boosted
                    for r, ch in enumerate(order):                            # boosted first, then the rest
                        bits = state.hi_bit if r < c else state.lo_bit
                        q, ks[i, j, t, ch], kz[i, j, t, ch] = nuq.np_affine(block[ch], bits, dtype)
                        (hi_codes[i, j, r] if r < c else lo_codes[i, j, r - c])[cols] = q
                for t in range(f):                                            # values: per token
                    vq[i, j, t], vs[i, j, t], vz[i, j, t] = nuq.np_affine(bv[i, j, t], state.lo_bit, dtype)
        fields.update(
            key_hi_codes=_cat3(state.key_hi_codes, mx.array(nuq.np_pack(hi_codes, state.hi_bit))),
            key_lo_codes=_cat3(state.key_lo_codes, mx.array(nuq.np_pack(lo_codes, state.lo_bit))),
            key_hi_channels=mx.concatenate([state.key_hi_channels,
                                            mx.array(chans).astype(state.key_hi_channels.dtype)], axis=2),
            key_scales=mx.concatenate([state.key_scales, ref.to_mx(ks, state.key_scales.dtype)], axis=2),
            key_zeros=mx.concatenate([state.key_zeros, ref.to_mx(kz, state.key_zeros.dtype)], axis=2),
            value_codes=_cat3(state.value_codes,
                              mx.array(nuq.np_pack(np.swapaxes(vq, 2, 3), state.lo_bit))),
            value_scales=mx.concatenate([state.value_scales, ref.to_mx(vs, state.value_scales.dtype)],
                                        axis=2),
            value_zeros=mx.concatenate([state.value_zeros, ref.to_mx(vz, state.value_zeros.dtype)],
                                       axis=2))
    return state._replace(**fields)


def get_kv(state: KittyState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Dequantized groups followed by the exact buffer."""
    b, h, n_g, d = state.key_scales.shape
    if n_g == 0:
        return state.buffer_keys, state.buffer_values
    g, c, dtype = state.group_size, state.key_hi_codes.shape[2], state.buffer_keys.dtype
    parts = []
    sets = ((state.key_hi_codes, state.hi_bit, c), (state.key_lo_codes, state.lo_bit, d - c))
    for codes, bits, rows in sets:
        if rows:
            parts.append(quant.unpack(codes, bits).reshape(b, h, rows, n_g, g).swapaxes(2, 3))
    q = mx.concatenate(parts, axis=3) if len(parts) > 1 else parts[0]  # [b, h, G, d, g], boosted first
    inv = chosen_first_inverse(chosen_mask(state.key_hi_channels, d))
    q = mx.take_along_axis(q, inv[..., None], axis=3).astype(mx.float32)
    k = q * state.key_scales.astype(mx.float32)[..., None] + state.key_zeros.astype(mx.float32)[..., None]
    k = k.astype(dtype).swapaxes(3, 4).reshape(b, h, n_g * g, d)
    vq = quant.unpack(state.value_codes, state.lo_bit).swapaxes(2, 3).astype(mx.float32)
    v = (vq * state.value_scales.astype(mx.float32)[..., None]
         + state.value_zeros.astype(mx.float32)[..., None]).astype(dtype)
    return (mx.concatenate([k, state.buffer_keys], axis=2),
            mx.concatenate([v, state.buffer_values], axis=2))


positions = quant.every_position(lambda state: state.value_scales.shape[2] + state.buffer_keys.shape[2])


def error_bound(state: KittyState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Per-element bound on ``|get_kv - input|``: each channel's group bound at its bit-width."""
    b, h, n_g, d = state.key_scales.shape
    g = state.group_size
    hi = quant.error_bound(state.key_scales, state.key_zeros, state.hi_bit, 1)
    lo = quant.error_bound(state.key_scales, state.key_zeros, state.lo_bit, 1)
    boosted = chosen_mask(state.key_hi_channels, d)
    kb = mx.broadcast_to(mx.where(boosted, hi, lo)[:, :, :, None], (b, h, n_g, g, d))
    vb = quant.error_bound(state.value_scales, state.value_zeros, state.lo_bit, 1)
    vb = mx.broadcast_to(vb[..., None], (b, h, n_g * g, d))
    r = mx.zeros(state.buffer_keys.shape, mx.float32)
    return (mx.concatenate([kb.reshape(b, h, n_g * g, d), r], axis=2), mx.concatenate([vb, r], axis=2))


State = KittyState
method = register("kitty", KittyState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, error_bound=error_bound,
                  dims=dims_of("buffer_keys"))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
