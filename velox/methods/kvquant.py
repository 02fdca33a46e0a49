"""KVQuant: non-uniform (Lloyd-Max) levels, per-channel keys, dense-and-sparse outliers, sinks.

The first ``n_sink`` tokens stay exact. After them, tokens wait exact in a buffer until
``group_size`` of them complete a group; a group is quantized at once:

* keys per channel (a vector = one channel over the group's tokens), values per token (a
  vector = one token's channels);
* in each vector the ``ceil(outlier_fraction * length)`` entries of largest magnitude are
  outliers, stored exact with their index (dense-and-sparse); the others are normalized to
  ``[0, 1]`` by the vector's inlier min and range;
* the group's normalized keys (and, separately, values) fit ``2**bits`` levels by
  ``lloyd_iters`` Lloyd iterations from the uniform grid; every inlier is coded by its
  nearest level.

Every decision depends on the group's own tokens, so a prompt absorbed in one chunk or token
by token yields bit-identical states. ``outlier_fraction=0`` is pure non-uniform quantization
and ``lloyd_iters=0`` keeps the uniform grid (min/max quantization with ``2**bits`` levels).

Storage (``G`` groups, ``Q = G * group_size``, ``L = 2**bits``): key and value codes packed
along the token axis ``[b, h, d, Q * bits / 32]``, key scales and zeros ``[b, h, G, d]``,
value scales and zeros ``[b, h, Q]``, level tables ``[b, h, G, L]`` (keys and values), key
outliers and their token index in the group ``[b, h, G, d, k]``, value outliers and their
channel ``[b, h, Q, k]``, the exact sinks and buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import nuq, quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..registry import dims_of, register

__all__ = ["KVQuantState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "error_bound", "outlier_counts", "sinks_first"]


class KVQuantState(NamedTuple):
    """Exact sinks, level-coded groups with their tables and outliers, and the exact buffer."""

    sink_keys: Float[Array, "b h ns d"]
    sink_values: Float[Array, "b h ns d"]
    key_codes: UInt[Array, "b h d kw"]
    key_scales: Float[Array, "b h g d"]
    key_zeros: Float[Array, "b h g d"]
    key_levels: Float[Array, "b h g l"]
    key_outliers: Float[Array, "b h g d kk"]
    key_outlier_index: UInt[Array, "b h g d kk"]
    value_codes: UInt[Array, "b h d vw"]
    value_scales: Float[Array, "b h nq"]
    value_zeros: Float[Array, "b h nq"]
    value_levels: Float[Array, "b h g l"]
    value_outliers: Float[Array, "b h nq kv"]
    value_outlier_index: UInt[Array, "b h nq kv"]
    buffer_keys: Float[Array, "b h r d"]
    buffer_values: Float[Array, "b h r d"]
    next_pos: Int[Array, "b h"]
    bits: int
    outlier_fraction: float
    group_size: int
    lloyd_iters: int
    n_sink: int
    backend: str


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 3, outlier_fraction: float = 0.01, group_size: int = 32,
         lloyd_iters: int = 8, n_sink: int = 1, backend: str = "auto") -> KVQuantState:
    """Empty KVQuant state.

    Args:
        bits: bits per inlier: 2**bits non-uniform levels per group (nuq2/3/4).
        outlier_fraction: entries of each vector kept exact, ceil(fraction * length) (keys: a
            channel of a group; values: a token).
        group_size: tokens per group (one level table per group, keys per channel over the
            group).
        lloyd_iters: Lloyd iterations from the uniform grid (0 = uniform levels).
        n_sink: leading tokens kept exact (attention-sink aware).
    """
    b, h, d = batch, kv_heads, head_dim
    kk, kv = outlier_counts(outlier_fraction, group_size, d)
    n_levels = 1 << bits
    z = lambda *shape, t=dtype: mx.zeros((b, h) + shape, t)  # noqa: E731
    sd = quant.side_dtype(dtype)
    return KVQuantState(
        sink_keys=z(0, d), sink_values=z(0, d), key_codes=z(d, 0, t=mx.uint32), key_scales=z(0, d, t=sd),
        key_zeros=z(0, d, t=sd), key_levels=z(0, n_levels, t=sd), key_outliers=z(0, d, kk),
        key_outlier_index=z(0, d, kk, t=nuq.index_dtype(group_size)),
        value_codes=z(d, 0, t=mx.uint32), value_scales=z(0, t=sd), value_zeros=z(0, t=sd),
        value_levels=z(0, n_levels, t=sd), value_outliers=z(0, kv),
        value_outlier_index=z(0, kv, t=nuq.index_dtype(d)),
        buffer_keys=z(0, d), buffer_values=z(0, d), next_pos=mx.zeros((b, h), mx.int32),
        bits=bits, outlier_fraction=outlier_fraction, group_size=group_size,
        lloyd_iters=lloyd_iters, n_sink=n_sink, backend=backend)


def outlier_counts(outlier_fraction: float, group_size: int, head_dim: int) -> tuple[int, int]:
    """Outliers per key vector (a channel of a group) and per value vector (a token)."""
    return nuq.ceil_count(outlier_fraction, group_size), nuq.ceil_count(outlier_fraction, head_dim)


def sinks_first(state, keys, values, held_keys, held_values, cat) -> tuple:
    """New rows ``[b, h, s, d]`` go to the exact sinks (the state's ``sink_keys``,
    ``sink_values``) until ``n_sink`` are held, the rest after the rows held exact
    (``held_keys``, ``held_values``): ``(sink_keys, sink_values, keys, values)``, each
    concatenated with ``cat(old, new)``."""
    take = min(state.n_sink - state.sink_keys.shape[2], keys.shape[2])
    return (cat(state.sink_keys, keys[:, :, :take]), cat(state.sink_values, values[:, :, :take]),
            cat(held_keys, keys[:, :, take:]), cat(held_values, values[:, :, take:]))


def _route(state: KVQuantState, keys, values, cat):
    """New sinks, the buffer + remaining new rows, and how many of those form whole groups."""
    sk, sv, bk, bv = sinks_first(state, keys, values, state.buffer_keys, state.buffer_values, cat)
    g = state.group_size
    return sk, sv, bk, bv, g * (bk.shape[2] // g)


def _vectors(x, k, dtype, iters, n_levels):
    """Dense-and-sparse NUQ of the vectors ``x [b, h, G, m, n]`` (a vector per row of ``n``),
    with one level table per group: codes ``[b, h, G, m, n]``, scales and zeros ``[b, h, G, m]``,
    levels ``[b, h, G, L]``, outliers and their indices ``[b, h, G, m, k]``."""
    b, h, n_g, m, n = x.shape
    x32 = x.astype(mx.float32)
    mag = mx.abs(x32)
    out = nuq.top_k_mask(mag, k)
    lo = mx.where(out, mx.inf, x32).min(axis=-1)
    hi = mx.where(out, -mx.inf, x32).max(axis=-1)
    scales, zeros = (hi - lo).astype(dtype), lo.astype(dtype)
    s32, z32 = scales.astype(mx.float32)[..., None], zeros.astype(mx.float32)[..., None]
    u = mx.where(s32 > 0, (x32 - z32) / mx.where(s32 > 0, s32, 1.0), 0.0).reshape(b, h, n_g, m * n)
    # a non-finite point (a vector whose range is not finite) never moves the group's levels
    levels = nuq.lloyd(u, ~out.reshape(b, h, n_g, m * n) & mx.isfinite(u), n_levels, iters, dtype)
    codes = nuq.nearest(u, levels).reshape(b, h, n_g, m, n)
    idx = nuq.top_k_indices(mag, k, mask=out)[0]
    return codes, scales, zeros, levels.astype(dtype), mx.take_along_axis(x, idx, axis=-1), idx


def _update_mlx(state: KVQuantState, keys, values, queries) -> KVQuantState:
    cat = lambda a, x: mx.concatenate([a, x], axis=2)  # noqa: E731
    sk, sv, bk, bv, f = _route(state, keys, values, cat)
    fields = dict(sink_keys=sk, sink_values=sv, buffer_keys=bk[:, :, f:], buffer_values=bv[:, :, f:],
                  next_pos=state.next_pos + keys.shape[2])
    if f:
        b, h, _, d = bk.shape
        g, n_g, n_levels = state.group_size, f // state.group_size, 1 << state.bits
        dtype = quant.side_dtype(bk.dtype)
        kk, kv = state.key_outliers.shape[-1], state.value_outliers.shape[-1]
        kx = bk[:, :, :f].reshape(b, h, n_g, g, d).swapaxes(3, 4)          # a vector per channel
        kq, ks, kz, kl, ko, ki = _vectors(kx, kk, dtype, state.lloyd_iters, n_levels)
        vx = bv[:, :, :f].reshape(b, h, n_g, g, d)                          # a vector per token
        vq, vs, vz, vl, vo, vi = _vectors(vx, kv, dtype, state.lloyd_iters, n_levels)
        pack = lambda q: quant.pack(q.reshape(b, h, d, f), state.bits)     # noqa: E731  along tokens
        fields.update(
            key_codes=mx.concatenate([state.key_codes, pack(kq.transpose(0, 1, 3, 2, 4))], axis=3),
            key_scales=cat(state.key_scales, ks), key_zeros=cat(state.key_zeros, kz),
            key_levels=cat(state.key_levels, kl), key_outliers=cat(state.key_outliers, ko),
            key_outlier_index=cat(state.key_outlier_index, ki.astype(state.key_outlier_index.dtype)),
            value_codes=mx.concatenate([state.value_codes, pack(vq.transpose(0, 1, 4, 2, 3))], axis=3),
            value_scales=cat(state.value_scales, vs.reshape(b, h, f)),
            value_zeros=cat(state.value_zeros, vz.reshape(b, h, f)),
            value_levels=cat(state.value_levels, vl),
            value_outliers=cat(state.value_outliers, vo.reshape(b, h, f, kv)),
            value_outlier_index=cat(state.value_outlier_index,
                                    vi.reshape(b, h, f, kv).astype(state.value_outlier_index.dtype)))
    return state._replace(**fields)


# --- reference: vector by vector, group by group, head by head -------------------------

def _np_group(rows: np.ndarray, k: int, dtype, iters: int, n_levels: int):
    """One group's vectors ``rows [m, n]`` (float32): the rule of :func:`_vectors`."""
    m, n = rows.shape
    out = np.zeros((m, n), bool)
    scales, zeros = np.zeros(m, np.float32), np.zeros(m, np.float32)
    u = np.zeros((m, n), np.float32)
    idx = np.zeros((m, k), np.int64)
    for r in range(m):
        x = rows[r]
        out[r] = nuq.np_top_k_mask(np.abs(x), k)                  # the k largest magnitudes
        idx[r] = nuq.np_top_k_indices(np.abs(x), k)[0]
        inl = x[~out[r]]
        scales[r] = nuq.np_round(inl.max() - inl.min(), dtype)
        zeros[r] = nuq.np_round(inl.min(), dtype)
        if scales[r] > 0:
            with np.errstate(invalid="ignore"):
                u[r] = (x - zeros[r]) / scales[r]
    levels = nuq.np_lloyd(u.reshape(-1), ~out.reshape(-1) & np.isfinite(u.reshape(-1)), n_levels,
                          iters, dtype)
    codes = nuq.np_nearest(u.reshape(-1), levels).reshape(m, n)
    return codes, scales, zeros, levels, np.take_along_axis(rows, idx, axis=1), idx


def _update_reference(state: KVQuantState, keys, values, queries) -> KVQuantState:
    cat = lambda a, x: np.concatenate([ref.to_np(a, np.float32), ref.to_np(x, np.float32)], 2)  # noqa: E731
    sk, sv, bk, bv, f = _route(state, keys, values, cat)
    to = lambda x: ref.to_mx(x, keys.dtype)  # noqa: E731
    dtype = quant.side_dtype(keys.dtype)
    side = lambda x: ref.to_mx(x, dtype)  # noqa: E731
    fields = dict(sink_keys=to(sk), sink_values=to(sv), buffer_keys=to(bk[:, :, f:]),
                  buffer_values=to(bv[:, :, f:]), next_pos=state.next_pos + keys.shape[2])
    if f:
        b, h, _, d = bk.shape
        g, n_levels = state.group_size, 1 << state.bits
        n_g = f // g
        kk, kv = state.key_outliers.shape[-1], state.value_outliers.shape[-1]
        kq, vq = np.zeros((b, h, d, f), np.uint32), np.zeros((b, h, d, f), np.uint32)
        ks, kz = np.zeros((b, h, n_g, d), np.float32), np.zeros((b, h, n_g, d), np.float32)
        vs, vz = np.zeros((b, h, f), np.float32), np.zeros((b, h, f), np.float32)
        kl, vl = np.zeros((b, h, n_g, n_levels), np.float32), np.zeros((b, h, n_g, n_levels), np.float32)
        ko, ki = np.zeros((b, h, n_g, d, kk), np.float32), np.zeros((b, h, n_g, d, kk), np.int64)
        vo, vi = np.zeros((b, h, f, kv), np.float32), np.zeros((b, h, f, kv), np.int64)
        for i in range(b):
            for j in range(h):
                for t in range(n_g):
                    rows = slice(t * g, (t + 1) * g)
                    # keys: a vector per channel (rows of the transposed group)
                    kq[i, j, :, rows], ks[i, j, t], kz[i, j, t], kl[i, j, t], ko[i, j, t], ki[i, j, t] = \
                        _np_group(bk[i, j, rows].T, kk, dtype, state.lloyd_iters, n_levels)
                    # values: a vector per token
                    codes, vs[i, j, rows], vz[i, j, rows], vl[i, j, t], vo[i, j, rows], vi[i, j, rows] = \
                        _np_group(bv[i, j, rows], kv, dtype, state.lloyd_iters, n_levels)
                    vq[i, j, :, rows] = codes.T
        mxc = lambda a, x: mx.concatenate([a, x], axis=2)  # noqa: E731
        fields.update(
            key_codes=mx.concatenate([state.key_codes, mx.array(nuq.np_pack(kq, state.bits))], axis=3),
            key_scales=mxc(state.key_scales, side(ks)), key_zeros=mxc(state.key_zeros, side(kz)),
            key_levels=mxc(state.key_levels, side(kl)), key_outliers=mxc(state.key_outliers, to(ko)),
            key_outlier_index=mxc(state.key_outlier_index,
                                  mx.array(ki).astype(state.key_outlier_index.dtype)),
            value_codes=mx.concatenate([state.value_codes, mx.array(nuq.np_pack(vq, state.bits))], axis=3),
            value_scales=mxc(state.value_scales, side(vs)), value_zeros=mxc(state.value_zeros, side(vz)),
            value_levels=mxc(state.value_levels, side(vl)), value_outliers=mxc(state.value_outliers, to(vo)),
            value_outlier_index=mxc(state.value_outlier_index,
                                    mx.array(vi).astype(state.value_outlier_index.dtype)))
    return state._replace(**fields)


def _codes(state: KVQuantState):
    """Unpacked key codes ``[b, h, G, d, g]`` and value codes ``[b, h, G, g, d]``."""
    b, h, n_g, d = state.key_scales.shape
    g = state.group_size
    kq = quant.unpack(state.key_codes, state.bits).reshape(b, h, d, n_g, g).transpose(0, 1, 3, 2, 4)
    vq = quant.unpack(state.value_codes, state.bits).reshape(b, h, d, n_g, g).transpose(0, 1, 3, 4, 2)
    return kq, vq


def _decode(codes, levels, scales, zeros, dtype):
    """``zero + scale * levels[code]`` for codes ``[b, h, G, m, n]``, scales ``[b, h, G, m]``."""
    b, h, n_g, m, n = codes.shape
    q = codes.reshape(b, h, n_g, m * n).astype(mx.int32)
    lv = mx.take_along_axis(levels.astype(mx.float32), q, axis=-1).reshape(b, h, n_g, m, n)
    x = zeros.astype(mx.float32)[..., None] + scales.astype(mx.float32)[..., None] * lv
    return x.astype(dtype)


def get_kv(state: KVQuantState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Exact sinks, dequantized groups (outliers put back), exact buffer."""
    b, h, n_g, d = state.key_scales.shape
    cat = lambda *xs: mx.concatenate(xs, axis=2)  # noqa: E731
    if n_g == 0:
        return cat(state.sink_keys, state.buffer_keys), cat(state.sink_values, state.buffer_values)
    g, dtype = state.group_size, state.buffer_keys.dtype
    kq, vq = _codes(state)
    k = _decode(kq, state.key_levels, state.key_scales, state.key_zeros, dtype)
    k = mx.put_along_axis(k, state.key_outlier_index.astype(mx.int32), state.key_outliers, axis=-1)
    v = _decode(vq, state.value_levels, state.value_scales.reshape(b, h, n_g, g),
                state.value_zeros.reshape(b, h, n_g, g), dtype).reshape(b, h, n_g * g, d)
    v = mx.put_along_axis(v, state.value_outlier_index.astype(mx.int32), state.value_outliers, axis=-1)
    return (cat(state.sink_keys, k.swapaxes(3, 4).reshape(b, h, n_g * g, d), state.buffer_keys),
            cat(state.sink_values, v, state.buffer_values))


positions = quant.every_position(lambda state: state.sink_keys.shape[2] + state.value_scales.shape[2]
                           + state.buffer_keys.shape[2])


def error_bound(state: KVQuantState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Per-element bound on ``|get_kv - input|``: half the gap to the neighbouring level (times
    the vector's range, plus rounding) for inliers; zero for outliers, sinks and the buffer."""
    b, h, n_g, d = state.key_scales.shape
    g = state.group_size
    zs = lambda x: mx.zeros(x.shape, mx.float32)  # noqa: E731
    cat = lambda *xs: mx.concatenate(xs, axis=2)  # noqa: E731
    kb, vb = mx.zeros((b, h, 0, d), mx.float32), mx.zeros((b, h, 0, d), mx.float32)
    if n_g:
        kq, vq = _codes(state)
        kb = nuq.levels_error_bound(kq.reshape(b, h, n_g, d * g), state.key_levels,
                                    mx.repeat(state.key_scales, g, axis=-1),
                                    mx.repeat(state.key_zeros, g, axis=-1)).reshape(b, h, n_g, d, g)
        kb = mx.put_along_axis(kb, state.key_outlier_index.astype(mx.int32), zs(state.key_outliers),
                               axis=-1)
        kb = kb.swapaxes(3, 4).reshape(b, h, n_g * g, d)
        vb = nuq.levels_error_bound(vq.reshape(b, h, n_g, g * d), state.value_levels,
                                    mx.repeat(state.value_scales.reshape(b, h, n_g, g), d, axis=-1),
                                    mx.repeat(state.value_zeros.reshape(b, h, n_g, g), d, axis=-1))
        vb = mx.put_along_axis(vb.reshape(b, h, n_g * g, d), state.value_outlier_index.astype(mx.int32),
                               zs(state.value_outliers), axis=-1)
    return (cat(zs(state.sink_keys), kb, zs(state.buffer_keys)),
            cat(zs(state.sink_values), vb, zs(state.buffer_values)))


State = KVQuantState
method = register("kvquant", KVQuantState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, error_bound=error_bound,
                  dims=dims_of("buffer_keys"))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
