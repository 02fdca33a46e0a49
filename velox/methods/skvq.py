"""SKVQ: sliding-window quantization with channel reordering and clipped per-token groups.

The first ``n_sink`` tokens and the newest ``window`` tokens stay exact; a token leaving the
window is quantized on its own, keys and values alike: its channels are permuted so that
each group of ``group_size`` channels holds channels of similar magnitude, and each group gets
an affine range clipped to ``[alpha * min, alpha * max]`` (values outside saturate).

The permutation (channels sorted by their largest magnitude, descending) and the per-group
clip factors (the ``alpha`` of the grid 1.0, 0.95, ..., 0.5 with the least squared error,
ties to the larger; or ``clip_alpha`` for every group without ``clip_search``) are calibrated
once, when the first token leaves the window, on the tokens at positions ``n_sink`` to
``n_sink + max(window, 1) - 1``, and frozen. The calibration tokens and the quantization of
each token depend on positions only, so a prompt absorbed in one chunk or token by token
yields bit-identical states.

Storage (``Q`` quantized tokens, ``G = d / group_size``): key and value codes per token,
packed along the permuted channels ``[b, h, Q, d * bits / 32]``, scales and zeros
``[b, h, Q, G]``, the permutations ``[b, h, d]``, the clip factors ``[b, h, G]`` (float32), and
the exact sinks and window.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import nuq, quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..registry import register
from .kvquant import sinks_first

__all__ = ["SKVQState", "State", "init", "update", "get_kv", "nbytes", "positions", "error_bound",
           "CLIP_GRID"]

#: Clip factors the search tries, largest first (ties go to the larger factor).
CLIP_GRID = tuple(1.0 - 0.05 * i for i in range(11))


class SKVQState(NamedTuple):
    """Exact sinks and window, per-token codes with scales and zeros, frozen calibration."""

    sink_keys: Float[Array, "b h ns d"]
    sink_values: Float[Array, "b h ns d"]
    key_codes: UInt[Array, "b h nq kw"]
    key_scales: Float[Array, "b h nq g"]
    key_zeros: Float[Array, "b h nq g"]
    value_codes: UInt[Array, "b h nq vw"]
    value_scales: Float[Array, "b h nq g"]
    value_zeros: Float[Array, "b h nq g"]
    key_perm: UInt[Array, "b h d"]
    value_perm: UInt[Array, "b h d"]
    key_clip: Float[Array, "b h g"]
    value_clip: Float[Array, "b h g"]
    window_keys: Float[Array, "b h nw d"]
    window_values: Float[Array, "b h nw d"]
    next_pos: Int[Array, "b h"]
    bits_key: int
    bits_value: int
    group_size: int
    window: int
    n_sink: int
    reorder: bool
    clip_search: bool
    clip_alpha: float
    residual_dtype: str
    cache_dtype: str
    backend: str


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits_key: int = 2, bits_value: int = 2, group_size: int = 32, window: int = 128,
         n_sink: int = 5, reorder: bool = True, clip_search: bool = True, clip_alpha: float = 1.0,
         residual_dtype: str = "float16", backend: str = "auto") -> SKVQState:
    """Empty SKVQ state (identity permutations and ``clip_alpha`` until calibration).

    Args:
        bits_key: bits per key element.
        bits_value: bits per value element.
        group_size: channels per quantization group (per token, after reordering).
        window: newest tokens kept exact (the sliding window); also the calibration length.
        n_sink: leading tokens kept exact (attention sinks).
        reorder: permute channels so each group holds channels of similar magnitude.
        clip_search: search each group's clip factor on the calibration window (grid 1.0, 0.95,
            ..., 0.5).
        clip_alpha: clip factor of every group when clip_search is false.
        residual_dtype: dtype of the rows held exact ("model": the cache dtype); scales and
            zeros are float16 (bfloat16 for a bfloat16 cache).
    """
    b, h, d = batch, kv_heads, head_dim
    n_g = d // group_size
    sd, rd = quant.side_dtype(dtype), quant.exact_dtype(residual_dtype, dtype)
    z = lambda *shape, t=sd: mx.zeros((b, h) + shape, t)  # noqa: E731
    ident = mx.zeros((b, h, 1), nuq.index_dtype(d)) + mx.arange(d).astype(nuq.index_dtype(d))
    clip = mx.full((b, h, n_g), clip_alpha, mx.float32)
    return SKVQState(
        sink_keys=z(0, d, t=rd), sink_values=z(0, d, t=rd),
        key_codes=z(0, d * bits_key // 32, t=mx.uint32), key_scales=z(0, n_g), key_zeros=z(0, n_g),
        value_codes=z(0, d * bits_value // 32, t=mx.uint32), value_scales=z(0, n_g),
        value_zeros=z(0, n_g), key_perm=ident, value_perm=ident, key_clip=clip, value_clip=clip,
        window_keys=z(0, d, t=rd), window_values=z(0, d, t=rd), next_pos=mx.zeros((b, h), mx.int32),
        bits_key=bits_key, bits_value=bits_value, group_size=group_size, window=window,
        n_sink=n_sink, reorder=reorder, clip_search=clip_search, clip_alpha=clip_alpha,
        residual_dtype=residual_dtype, cache_dtype=quant.dtype_name(dtype), backend=backend)


def _dims(state: SKVQState) -> tuple[int, int, int, mx.Dtype]:
    """``(batch, kv_heads, head_dim, dtype)``: the model's dtype, not the exact rows'."""
    b, h, _, d = state.window_keys.shape
    return b, h, d, quant.dtype_of(state.cache_dtype)


def _route(state: SKVQState, keys, values, cat):
    """New sinks, the window + remaining new rows, and how many leave the window (flushed)."""
    sk, sv, wk, wv = sinks_first(state, keys, values, state.window_keys, state.window_values, cat)
    return sk, sv, wk, wv, max(wk.shape[2] - state.window, 0)


def _calibrate(x, bits, group_size, dtype, state: SKVQState):
    """Permutation ``[b, h, d]`` and clip factors ``[b, h, G]`` from calibration rows ``x [b, h, c, d]``."""
    b, h, c, d = x.shape
    n_g = d // group_size
    x = x.astype(mx.float32)
    if state.reorder:  # largest magnitude first (ties: lower channel first)
        perm = mx.argsort(-nuq.order_key(mx.abs(x).max(axis=2)), axis=-1).astype(mx.int32)
    else:
        perm = mx.broadcast_to(mx.arange(d, dtype=mx.int32), (b, h, d))
    if not state.clip_search:
        return perm, mx.full((b, h, n_g), state.clip_alpha, mx.float32)
    grp = mx.take_along_axis(x, perm[:, :, None, :], axis=-1).reshape(b, h, c, n_g, group_size)
    errs = []
    for a in CLIP_GRID:  # a static loop over the grid
        q, sc, zr = nuq.affine(grp, bits, dtype, alpha=mx.array(a, mx.float32))
        e = q.astype(mx.float32) * sc.astype(mx.float32)[..., None] + zr.astype(mx.float32)[..., None] - grp
        errs.append(nuq.tree_sum((e * e).transpose(0, 1, 3, 2, 4).reshape(b, h, n_g, c * group_size)))
    err = mx.stack(errs, axis=-1)                                           # [b, h, G, A]
    err = mx.where(mx.isnan(err), mx.inf, err)  # a non-finite window: alpha = 1 where all are
    first = mx.where(err == err.min(axis=-1, keepdims=True), mx.arange(len(CLIP_GRID)), len(CLIP_GRID))
    return perm, mx.array(CLIP_GRID, mx.float32)[first.min(axis=-1)]


def _quantize_rows(x, perm, clip, bits, group_size, dtype):
    """Per-token codes of ``x [b, h, f, d]`` in permuted channel order, clipped groups."""
    b, h, f, d = x.shape
    xp = mx.take_along_axis(x, perm.astype(mx.int32)[:, :, None, :], axis=-1)
    q, sc, zr = nuq.affine(xp.reshape(b, h, f, d // group_size, group_size), bits, dtype,
                           alpha=clip[:, :, None, :])
    return quant.pack(q.reshape(b, h, f, d), bits), sc, zr


def _update_mlx(state: SKVQState, keys, values, queries) -> SKVQState:
    cat = lambda a, x: mx.concatenate([a, x.astype(a.dtype)], axis=2)  # noqa: E731
    sk, sv, wk, wv, f = _route(state, keys, values, cat)
    fields = dict(sink_keys=sk, sink_values=sv, window_keys=wk[:, :, f:], window_values=wv[:, :, f:],
                  next_pos=state.next_pos + keys.shape[2])
    if not f:
        return state._replace(**fields)
    dtype, g = quant.side_dtype(keys.dtype), state.group_size
    kp, vp, kc, vc = state.key_perm, state.value_perm, state.key_clip, state.value_clip
    if state.key_codes.shape[2] == 0:  # the first flush: calibrate on the first window
        c = max(state.window, 1)
        kp, kc = _calibrate(wk[:, :, :c], state.bits_key, g, dtype, state)
        vp, vc = _calibrate(wv[:, :, :c], state.bits_value, g, dtype, state)
        kp, vp = kp.astype(state.key_perm.dtype), vp.astype(state.value_perm.dtype)
    kq, ks, kz = _quantize_rows(wk[:, :, :f], kp, kc, state.bits_key, g, dtype)
    vq, vs, vz = _quantize_rows(wv[:, :, :f], vp, vc, state.bits_value, g, dtype)
    fields.update(key_codes=cat(state.key_codes, kq), key_scales=cat(state.key_scales, ks),
                  key_zeros=cat(state.key_zeros, kz), value_codes=cat(state.value_codes, vq),
                  value_scales=cat(state.value_scales, vs), value_zeros=cat(state.value_zeros, vz),
                  key_perm=kp, value_perm=vp, key_clip=kc, value_clip=vc)
    return state._replace(**fields)


# --- reference: calibration and per-token groups, head by head ----------------------------

def _np_calibrate(x: np.ndarray, bits: int, group_size: int, dtype, state: SKVQState):
    """One head: permutation ``[d]`` and clip factors ``[G]`` from calibration rows ``x [c, d]``."""
    c, d = x.shape
    perm = np.argsort(-nuq.np_order_key(np.abs(x).max(axis=0))) if state.reorder else np.arange(d)
    n_g = d // group_size
    if not state.clip_search:
        return perm, np.full(n_g, state.clip_alpha, np.float32)
    clip = np.zeros(n_g, np.float32)
    for t in range(n_g):
        grp = x[:, perm[t * group_size:(t + 1) * group_size]]                # [c, group_size]
        errs = []
        for a in CLIP_GRID:
            q, sc, zr = nuq.np_affine(grp, bits, dtype, alpha=np.float32(a))
            e = q.astype(np.float32) * sc[:, None] + zr[:, None] - grp
            errs.append(nuq.np_tree_sum((e * e).reshape(-1)))
        errs = np.where(np.isnan(errs), np.inf, errs)
        clip[t] = np.float32(CLIP_GRID[int(np.argmin(errs))])                 # first minimum
    return perm, clip


def _update_reference(state: SKVQState, keys, values, queries) -> SKVQState:
    rd = state.window_keys.dtype
    dtype = quant.side_dtype(keys.dtype)
    cat = lambda a, x: np.concatenate([ref.to_np(a, np.float32),  # noqa: E731  (held in rd)
                                       ref.round_to(ref.to_np(x, np.float32), rd)], 2)
    sk, sv, wk, wv, f = _route(state, keys, values, cat)
    to = lambda x: ref.to_mx(x, dtype)  # noqa: E731
    ex = lambda x: ref.to_mx(x, rd)  # noqa: E731
    fields = dict(sink_keys=ex(sk), sink_values=ex(sv), window_keys=ex(wk[:, :, f:]),
                  window_values=ex(wv[:, :, f:]), next_pos=state.next_pos + keys.shape[2])
    if not f:
        return state._replace(**fields)
    b, h, _, d = wk.shape
    g = state.group_size
    n_g = d // g
    out = {}
    for kind, rows, bits in (("key", wk, state.bits_key), ("value", wv, state.bits_value)):
        perm = ref.to_np(getattr(state, f"{kind}_perm"), np.int64)
        clip = ref.to_np(getattr(state, f"{kind}_clip"), np.float32)
        codes = np.zeros((b, h, f, d), np.uint32)
        scales, zeros = np.zeros((b, h, f, n_g), np.float32), np.zeros((b, h, f, n_g), np.float32)
        for i in range(b):
            for j in range(h):
                if state.key_codes.shape[2] == 0:  # the first flush: calibrate on the first window
                    perm[i, j], clip[i, j] = _np_calibrate(rows[i, j, :max(state.window, 1)], bits, g,
                                                           dtype, state)
                for t in range(f):  # each token on its own: permute, then clipped groups
                    x = rows[i, j, t][perm[i, j]]
                    for c in range(n_g):
                        cols = slice(c * g, (c + 1) * g)
                        codes[i, j, t, cols], scales[i, j, t, c], zeros[i, j, t, c] = \
                            nuq.np_affine(x[cols], bits, dtype, alpha=clip[i, j, c])
        old = getattr(state, f"{kind}_codes")
        out.update({
            f"{kind}_codes": mx.concatenate([old, mx.array(nuq.np_pack(codes, bits))], axis=2),
            f"{kind}_scales": mx.concatenate([getattr(state, f"{kind}_scales"), to(scales)], axis=2),
            f"{kind}_zeros": mx.concatenate([getattr(state, f"{kind}_zeros"), to(zeros)], axis=2),
            f"{kind}_perm": mx.array(perm).astype(getattr(state, f"{kind}_perm").dtype),
            f"{kind}_clip": mx.array(clip, mx.float32)})
    return state._replace(**fields, **out)


def _unpermute(x, perm):
    """Rows ``[b, h, n, d]`` in permuted channel order back to the original order."""
    inv = mx.argsort(perm.astype(mx.int32), axis=-1)
    return mx.take_along_axis(x, inv[:, :, None, :], axis=-1)


def _dequantize(codes, scales, zeros, perm, bits, group_size, dtype):
    b, h, n, _ = codes.shape
    d = perm.shape[-1]
    q = quant.unpack(codes, bits).astype(mx.float32).reshape(b, h, n, d // group_size, group_size)
    x = q * scales.astype(mx.float32)[..., None] + zeros.astype(mx.float32)[..., None]
    return _unpermute(x.reshape(b, h, n, d).astype(dtype), perm)


def get_kv(state: SKVQState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Exact sinks, dequantized tokens, exact window (model dtype)."""
    dtype, g = quant.dtype_of(state.cache_dtype), state.group_size
    k = _dequantize(state.key_codes, state.key_scales, state.key_zeros, state.key_perm, state.bits_key, g,
                    dtype)
    v = _dequantize(state.value_codes, state.value_scales, state.value_zeros, state.value_perm,
                    state.bits_value, g, dtype)
    return (mx.concatenate([state.sink_keys.astype(dtype), k, state.window_keys.astype(dtype)], axis=2),
            mx.concatenate([state.sink_values.astype(dtype), v, state.window_values.astype(dtype)], axis=2))


positions = quant.every_position(lambda state: state.sink_keys.shape[2] + state.key_codes.shape[2]
                           + state.window_keys.shape[2])


def error_bound(state: SKVQState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Per-element bound on ``|get_kv - input|``: scale/2 plus rounding plus the clipping
    excess ``(1/alpha - 1) * max(|lo|, |hi|)`` of the token's group; for exact rows, their
    rounding to ``residual_dtype``."""
    out = []
    for kind, bits in (("key", state.bits_key), ("value", state.bits_value)):
        sc, zr = getattr(state, f"{kind}_scales"), getattr(state, f"{kind}_zeros")
        bound = nuq.affine_bound(sc, zr, bits, alpha=getattr(state, f"{kind}_clip")[:, :, None, :])
        bound = _unpermute(mx.repeat(bound, state.group_size, axis=-1), getattr(state, f"{kind}_perm"))
        cd = quant.dtype_of(state.cache_dtype)
        sink = quant.rounding_bound(getattr(state, f"sink_{kind}s"), cd)
        win = quant.rounding_bound(getattr(state, f"window_{kind}s"), cd)
        out.append(mx.concatenate([sink, bound, win], axis=2))
    return out[0], out[1]


State = SKVQState
method = register("skvq", SKVQState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, error_bound=error_bound, dims=_dims)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
