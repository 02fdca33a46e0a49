"""ZipCache: salient tokens at high precision, chosen by normalized attention score.

Tokens wait exact in a buffer until ``group_size`` of them complete a group; a group is
quantized at once. In each group the ``round(hi_fraction * group_size)`` tokens of largest
*normalized attention score* (the attention a token has received, divided by the number of
queries that could attend to it) are salient and get ``hi_bits``, the others ``lo_bits``.
Keys are quantized per channel over the group's salient tokens and, separately, over its other
tokens; values (``quantize_values``) per token after dividing each channel by
``sqrt(max |v|)`` over the group (channel-separable token-wise quantization), at the token's
bit-width.

Chunk rule: each update adds the attention of its ``s`` queries (real queries grouped per kv
head, averaged over the group; or the new keys as proxies), causal, over every stored token
(quantized ones as dequantized) and the new ones, to the score of each buffered token. A
group's saliency therefore counts the queries seen up to the call that completes it: a prompt
absorbed in one chunk scores its groups with later queries than token-by-token decoding does,
so the two states agree exactly only when every group is salient or none is
(``hi_fraction`` 0 or 1).

Storage (``G`` groups of ``g``, ``k`` salient tokens per group): salient key codes ``[b, h,
G*k, d * hi_bits / 32]`` and the others ``[b, h, G*(g-k), d * lo_bits / 32]`` (token rows
packed along the channels, in position order within each set), per-channel scales and zeros of
each set ``[b, h, G, d]``, the salient indices ``[b, h, G, k]``; values likewise, with
per-channel factors ``[b, h, G, d]`` and per-token scales and zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import nuq, quant
from .. import reference as ref
from .._typing import Array, Bool, Float, Int, UInt
from ..attention import candidate_mass, scoring_queries
from ..registry import dims_of, register

__all__ = ["ZipCacheState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "error_bound", "salient_tokens", "chosen_mask", "chosen_first_inverse"]
_U32 = 2.0 ** -24


class ZipCacheState(NamedTuple):
    """Mixed-precision key/value codes, their side data, salient indices and the exact buffer."""

    key_hi_codes: UInt[Array, "b h nh kw1"]
    key_lo_codes: UInt[Array, "b h nl kw2"]
    key_hi_scales: Float[Array, "b h gh d"]
    key_hi_zeros: Float[Array, "b h gh d"]
    key_lo_scales: Float[Array, "b h gl d"]
    key_lo_zeros: Float[Array, "b h gl d"]
    salient: UInt[Array, "b h g k"]
    value_hi_codes: UInt[Array, "b h vh vw1"]
    value_lo_codes: UInt[Array, "b h vl vw2"]
    value_channels: Float[Array, "b h gv d"]
    value_hi_scales: Float[Array, "b h vh"]
    value_hi_zeros: Float[Array, "b h vh"]
    value_lo_scales: Float[Array, "b h vl"]
    value_lo_zeros: Float[Array, "b h vl"]
    values: Float[Array, "b h ve d"]
    buffer_keys: Float[Array, "b h r d"]
    buffer_values: Float[Array, "b h r d"]
    buffer_scores: Float[Array, "b h r"]
    next_pos: Int[Array, "b h"]
    hi_bits: int
    lo_bits: int
    hi_fraction: float
    group_size: int
    quantize_values: bool
    backend: str


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         hi_bits: int = 4, lo_bits: int = 2, hi_fraction: float = 0.2, group_size: int = 32,
         quantize_values: bool = True, backend: str = "auto") -> ZipCacheState:
    """Empty ZipCache state.

    Args:
        hi_bits: bits of the salient tokens.
        lo_bits: bits of the other tokens.
        hi_fraction: fraction of each group's tokens kept at hi_bits (rounded half up).
        group_size: tokens per group (saliency ranking and quantization).
        quantize_values: quantize values too (false: values stay exact).
    """
    b, h, d = batch, kv_heads, head_dim
    k = salient_tokens(hi_fraction, group_size)
    z = lambda *shape, t=quant.side_dtype(dtype): mx.zeros((b, h) + shape, t)  # noqa: E731
    return ZipCacheState(
        key_hi_codes=z(0, d * hi_bits // 32, t=mx.uint32),
        key_lo_codes=z(0, d * lo_bits // 32, t=mx.uint32),
        key_hi_scales=z(0, d), key_hi_zeros=z(0, d), key_lo_scales=z(0, d), key_lo_zeros=z(0, d),
        salient=z(0, k, t=nuq.index_dtype(group_size)),
        value_hi_codes=z(0, d * hi_bits // 32, t=mx.uint32),
        value_lo_codes=z(0, d * lo_bits // 32, t=mx.uint32), value_channels=z(0, d),
        value_hi_scales=z(0), value_hi_zeros=z(0), value_lo_scales=z(0), value_lo_zeros=z(0),
        values=z(0, d, t=dtype), buffer_keys=z(0, d, t=dtype), buffer_values=z(0, d, t=dtype),
        buffer_scores=z(0, t=mx.float32), next_pos=mx.zeros((b, h), mx.int32), hi_bits=hi_bits,
        lo_bits=lo_bits, hi_fraction=hi_fraction, group_size=group_size,
        quantize_values=quantize_values, backend=backend)


def salient_tokens(hi_fraction: float, group_size: int) -> int:
    """Salient tokens per group: ``hi_fraction * group_size`` rounded half up."""
    return nuq.round_count(hi_fraction, group_size)


def _groups(state: ZipCacheState) -> int:
    return state.salient.shape[2]


def _scored(state: ZipCacheState) -> bool:
    """Whether saliency decides anything (some but not all tokens of a group are salient)."""
    return 0 < state.salient.shape[3] < state.group_size


def _cat(a, x, axis=2):
    return mx.concatenate([a, x], axis=axis)


def _update_mlx(state: ZipCacheState, keys, values, queries) -> ZipCacheState:
    b, h, s, d = keys.shape
    g, k, dtype = state.group_size, state.salient.shape[3], keys.dtype
    bk, bv = _cat(state.buffer_keys, keys), _cat(state.buffer_values, values)
    r = state.buffer_keys.shape[2]
    if _scored(state):
        stored = _cat(_dequantize_keys(state), state.buffer_keys)
        mass = candidate_mass(scoring_queries(keys, queries), stored, keys)
        n = stored.shape[2] - r
        acc = _cat(state.buffer_scores + mass[:, :, n:n + r], mass[:, :, n + r:])
    else:
        acc = mx.zeros((b, h, r + s), mx.float32)
    f = g * ((r + s) // g)
    fields = dict(buffer_keys=bk[:, :, f:], buffer_values=bv[:, :, f:], buffer_scores=acc[:, :, f:],
                  next_pos=state.next_pos + s)
    if not f:
        return state._replace(**fields)
    n_g = f // g
    # normalized attention score: accumulated attention / queries that could attend the token
    seen = mx.arange(r + s, 0, -1, dtype=mx.float32)[:f]
    top, perm = nuq.top_k_indices((acc[:, :, :f] / seen).reshape(b, h, n_g, g), k)
    order = lambda x: mx.take_along_axis(x.reshape(b, h, n_g, g, d), perm[..., None], axis=3)  # noqa: E731
    kk, vv = order(bk[:, :, :f]), order(bv[:, :, :f])                    # salient tokens first
    fields.update(salient=_cat(state.salient, top.astype(state.salient.dtype)))
    for name, lo, hi, bits in (("hi", 0, k, state.hi_bits), ("lo", k, g, state.lo_bits)):
        if hi == lo:
            continue
        code, sc, zr = nuq.affine(kk[:, :, :, lo:hi].swapaxes(3, 4), bits, dtype)   # per channel
        fields.update({
            f"key_{name}_codes": _cat(getattr(state, f"key_{name}_codes"),
                                      _pack_rows(code.swapaxes(3, 4), bits)),
            f"key_{name}_scales": _cat(getattr(state, f"key_{name}_scales"), sc),
            f"key_{name}_zeros": _cat(getattr(state, f"key_{name}_zeros"), zr)})
    if not state.quantize_values:
        fields.update(values=_cat(state.values, bv[:, :, :f]))
        return state._replace(**fields)
    chan = mx.sqrt(mx.abs(vv.astype(mx.float32)).max(axis=3)).astype(quant.side_dtype(dtype))
    c32 = chan.astype(mx.float32)[:, :, :, None]
    y = vv.astype(mx.float32) / mx.where(c32 > 0, c32, 1.0)
    fields.update(value_channels=_cat(state.value_channels, chan))
    for name, lo, hi, bits in (("hi", 0, k, state.hi_bits), ("lo", k, g, state.lo_bits)):
        if hi == lo:
            continue
        code, sc, zr = nuq.affine(y[:, :, :, lo:hi], bits, dtype)                    # per token
        fields.update({
            f"value_{name}_codes": _cat(getattr(state, f"value_{name}_codes"), _pack_rows(code, bits)),
            f"value_{name}_scales": _cat(getattr(state, f"value_{name}_scales"), sc.reshape(b, h, -1)),
            f"value_{name}_zeros": _cat(getattr(state, f"value_{name}_zeros"), zr.reshape(b, h, -1))})
    return state._replace(**fields)


def _pack_rows(codes, bits):
    """``[b, h, G, m, d]`` codes -> ``[b, h, G*m, d*bits/32]`` token rows packed along channels."""
    b, h, n_g, m, d = codes.shape
    return quant.pack(codes.reshape(b, h, n_g * m, d), bits)


# --- reference: saliency token by token, quantization group by group, head by head -------

def _update_reference(state: ZipCacheState, keys, values, queries) -> ZipCacheState:
    dtype = keys.dtype
    sd = quant.side_dtype(dtype)
    b, h, s, d = keys.shape
    g, k = state.group_size, state.salient.shape[3]
    r = state.buffer_keys.shape[2]
    bk = np.concatenate([ref.to_np(state.buffer_keys, np.float32), ref.to_np(keys, np.float32)], 2)
    bv = np.concatenate([ref.to_np(state.buffer_values, np.float32), ref.to_np(values, np.float32)], 2)
    acc = np.zeros((b, h, r + s))
    if _scored(state):
        stored = np.concatenate([ref.to_np(_dequantize_keys(state)), ref.to_np(state.buffer_keys)], 2)
        allk = np.concatenate([stored, ref.to_np(keys)], 2)
        q = ref.scoring_queries(ref.to_np(keys), None if queries is None else ref.to_np(queries))
        n = stored.shape[2] - r
        pos = np.arange(allk.shape[2])
        for i in range(b):
            for j in range(h):
                acc[i, j, :r] = ref.to_np(state.buffer_scores)[i, j]
                for t in range(s):  # each query of the chunk, causal, averaged over its heads
                    w = ref.attention_weights(q[i, j, :, t:t + 1], allk[i, j], pos, pos[n + r + t:][:1])
                    acc[i, j] += w[:, 0, n:].mean(0)
    f = g * ((r + s) // g)
    fields = dict(buffer_keys=ref.to_mx(bk[:, :, f:], dtype), buffer_values=ref.to_mx(bv[:, :, f:], dtype),
                  buffer_scores=ref.to_mx(acc[:, :, f:], mx.float32), next_pos=state.next_pos + s)
    if not f:
        return state._replace(**fields)
    n_g = f // g
    score = acc.astype(np.float32)[:, :, :f] / np.arange(r + s, 0, -1, dtype=np.float32)[:f]
    sizes = {"hi": (k, state.hi_bits), "lo": (g - k, state.lo_bits)}
    sal = np.zeros((b, h, n_g, k), np.int64)
    kc = {nm: np.zeros((b, h, n_g, m, d), np.uint32) for nm, (m, _) in sizes.items()}
    ks = {nm: np.zeros((b, h, n_g, d), np.float32) for nm in sizes}
    kz = {nm: np.zeros((b, h, n_g, d), np.float32) for nm in sizes}
    vc = {nm: np.zeros((b, h, n_g, m, d), np.uint32) for nm, (m, _) in sizes.items()}
    vs = {nm: np.zeros((b, h, n_g, m), np.float32) for nm, (m, _) in sizes.items()}
    vz = {nm: np.zeros((b, h, n_g, m), np.float32) for nm, (m, _) in sizes.items()}
    chan = np.zeros((b, h, n_g, d), np.float32)
    for i in range(b):
        for j in range(h):
            for t in range(n_g):
                rows = slice(t * g, (t + 1) * g)
                sal[i, j, t], order = nuq.np_top_k_indices(score[i, j, rows], k)
                kk, vv = bk[i, j, rows][order], bv[i, j, rows][order]     # salient tokens first
                chan[i, j, t] = nuq.np_round(np.sqrt(np.abs(vv).max(axis=0)), sd)
                y = vv / np.where(chan[i, j, t] > 0, chan[i, j, t], np.float32(1.0))
                for nm, lo, hi in (("hi", 0, k), ("lo", k, g)):
                    bits = sizes[nm][1]
                    if hi == lo:
                        continue
                    for c in range(d):  # keys: per channel over the set's tokens
                        kc[nm][i, j, t, :, c], ks[nm][i, j, t, c], kz[nm][i, j, t, c] = \
                            nuq.np_affine(kk[lo:hi, c], bits, dtype)
                    for m in range(hi - lo):  # values: per token, channel-separable
                        vc[nm][i, j, t, m], vs[nm][i, j, t, m], vz[nm][i, j, t, m] = \
                            nuq.np_affine(y[lo + m], bits, dtype)
    fields.update(salient=_cat(state.salient, mx.array(sal).astype(state.salient.dtype)))
    for nm, (m, bits) in sizes.items():
        if not m:
            continue
        fields.update({
            f"key_{nm}_codes": _cat(getattr(state, f"key_{nm}_codes"),
                                    mx.array(nuq.np_pack(kc[nm].reshape(b, h, n_g * m, d), bits))),
            f"key_{nm}_scales": _cat(getattr(state, f"key_{nm}_scales"), ref.to_mx(ks[nm], sd)),
            f"key_{nm}_zeros": _cat(getattr(state, f"key_{nm}_zeros"), ref.to_mx(kz[nm], sd))})
        if state.quantize_values:
            fields.update({
                f"value_{nm}_codes": _cat(getattr(state, f"value_{nm}_codes"),
                                          mx.array(nuq.np_pack(vc[nm].reshape(b, h, n_g * m, d), bits))),
                f"value_{nm}_scales": _cat(getattr(state, f"value_{nm}_scales"),
                                           ref.to_mx(vs[nm].reshape(b, h, -1), sd)),
                f"value_{nm}_zeros": _cat(getattr(state, f"value_{nm}_zeros"),
                                          ref.to_mx(vz[nm].reshape(b, h, -1), sd))})
    if state.quantize_values:
        fields["value_channels"] = _cat(state.value_channels, ref.to_mx(chan, sd))
    else:
        fields["values"] = _cat(state.values, ref.to_mx(bv[:, :, :f], dtype))
    return state._replace(**fields)


def chosen_mask(index: UInt[Array, "*batch k"], n: int) -> Bool[Array, "*batch n"]:
    """``[*batch, n]``: whether each of ``n`` slots is one of the ``k`` chosen in ``index``."""
    return (index.astype(mx.int32)[..., :, None] == mx.arange(n)).any(axis=-2)


def chosen_first_inverse(chosen: Bool[Array, "*batch n"]) -> UInt[Array, "*batch n"]:
    """The gather that puts ``n`` rows stored chosen-first (the chosen ones, then the rest,
    each in position order) back in position order, from the mask ``chosen [*batch, n]``."""
    n = chosen.shape[-1]
    i = mx.arange(n, dtype=mx.int32)
    return mx.argsort(mx.argsort(mx.where(chosen, i, n + i), axis=-1), axis=-1)


def _unorder(state: ZipCacheState, parts: list[mx.array]) -> mx.array:
    """Salient-first rows ``[b, h, G, g, d]`` back to position order."""
    x = mx.concatenate(parts, axis=3) if len(parts) > 1 else parts[0]
    inv = chosen_first_inverse(chosen_mask(state.salient, state.group_size))
    b, h, n_g, g = x.shape[:4]
    return mx.take_along_axis(x, inv[..., None], axis=3).reshape(b, h, n_g * g, -1)


def _rows(codes, bits, n_g):
    """Packed token rows -> float32 codes ``[b, h, G, m, d]``."""
    q = quant.unpack(codes, bits).astype(mx.float32)
    b, h = q.shape[:2]
    return q.reshape(b, h, n_g, -1, q.shape[-1])


def _dequantize_keys(state: ZipCacheState) -> Float[Array, "b h n d"]:
    n_g, dtype = _groups(state), state.buffer_keys.dtype
    if n_g == 0:
        return mx.zeros((state.buffer_keys.shape[0], state.buffer_keys.shape[1], 0,
                         state.buffer_keys.shape[3]), dtype)
    parts = []
    for name, bits in (("hi", state.hi_bits), ("lo", state.lo_bits)):
        codes = getattr(state, f"key_{name}_codes")
        if codes.shape[2]:
            sc = getattr(state, f"key_{name}_scales").astype(mx.float32)[:, :, :, None]
            zr = getattr(state, f"key_{name}_zeros").astype(mx.float32)[:, :, :, None]
            parts.append(_rows(codes, bits, n_g) * sc + zr)
    return _unorder(state, parts).astype(dtype)


def _dequantize_values(state: ZipCacheState) -> Float[Array, "b h n d"]:
    if not state.quantize_values:
        return state.values
    n_g, dtype = _groups(state), state.buffer_values.dtype
    if n_g == 0:
        return state.values
    b, h = state.salient.shape[:2]
    c = state.value_channels.astype(mx.float32)[:, :, :, None]
    parts = []
    for name, bits in (("hi", state.hi_bits), ("lo", state.lo_bits)):
        codes = getattr(state, f"value_{name}_codes")
        if codes.shape[2]:
            sc = getattr(state, f"value_{name}_scales").astype(mx.float32).reshape(b, h, n_g, -1, 1)
            zr = getattr(state, f"value_{name}_zeros").astype(mx.float32).reshape(b, h, n_g, -1, 1)
            parts.append((_rows(codes, bits, n_g) * sc + zr) * c)
    return _unorder(state, parts).astype(dtype)


def get_kv(state: ZipCacheState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Dequantized groups followed by the exact buffer."""
    return (_cat(_dequantize_keys(state), state.buffer_keys),
            _cat(_dequantize_values(state), state.buffer_values))


positions = quant.every_position(lambda state: _groups(state) * state.group_size
                           + state.buffer_keys.shape[2])


def error_bound(state: ZipCacheState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Per-element bound on ``|get_kv - input|``: each token's group bound at its bit-width."""
    b, h, r, d = state.buffer_keys.shape
    n_g = _groups(state)
    zero = mx.zeros((b, h, r, d), mx.float32)
    if n_g == 0:
        return zero, zero
    kparts, vparts = [], []
    u = quant.unit_roundoff(state.buffer_keys.dtype)
    for name, bits in (("hi", state.hi_bits), ("lo", state.lo_bits)):
        m = getattr(state, f"key_{name}_codes").shape[2] // n_g
        if not m:
            continue
        kb = quant.error_bound(getattr(state, f"key_{name}_scales"), getattr(state, f"key_{name}_zeros"),
                               bits, 1)
        kparts.append(mx.broadcast_to(kb[:, :, :, None], (b, h, n_g, m, d)))
        if state.quantize_values:
            sc, zr = getattr(state, f"value_{name}_scales"), getattr(state, f"value_{name}_zeros")
            eb = quant.error_bound(sc, zr, bits, 1).reshape(b, h, n_g, m, 1)
            top = mx.abs(zr.astype(mx.float32)) + ((1 << bits) - 1) * sc.astype(mx.float32)
            top = top.reshape(b, h, n_g, m, 1)
            c = state.value_channels.astype(mx.float32)[:, :, :, None]
            # y = v / c is quantized; v_hat = (y_hat * c) in float32, then cast to the cache dtype
            vparts.append(c * eb + (u + 4 * _U32) * c * (top + eb))
    kb = _unorder(state, kparts)
    vb = _unorder(state, vparts) if state.quantize_values else mx.zeros(kb.shape, mx.float32)
    return _cat(kb, zero), _cat(vb, zero)


State = ZipCacheState
method = register("zipcache", ZipCacheState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, error_bound=error_bound,
                  dims=dims_of("buffer_keys"))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
