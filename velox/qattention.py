"""Attention over stored segments without materialising a dense cache.

A state's stored tokens are a list of segments in position order: ``Dense`` rows, ``Affine``
rows held as MLX affine codes with keys transposed ``[b, h, d, n]`` (groups along the tokens,
KIVI's per-channel keys) and values ``[b, h, n, d]`` (groups along the channels), or
``AffineRows`` with keys and values both per token (the layout of ``velox.quant`` and of
``mx.quantize``). Scores and outputs of affine segments go through
``mx.quantized_matmul`` on the packed codes; one softmax spans every segment and the new
tokens, so the result equals dense attention over ``get_kv`` plus the new tokens.

A chunk of several queries (a prefill) is attention over the same rows too, but a chunk's
logits against a long cache are large and ``mx.quantized_matmul`` over blocks of them is slow
(KIVI at 32k: 74 s for a prompt whose dense prefill takes seconds): a chunk dequantizes the
stored segments once (``velox.quant.dequantize``, float32 arithmetic rounded to the queries'
dtype, as ``get_kv`` rounds them) and runs ``mx.fast.scaled_dot_product_attention`` over them and the new
tokens, whose fused kernel never materialises the chunk x cache score matrix. What a chunk
holds beyond the codes is one layer's dequantized rows, as much as a dense cache of that layer.
:func:`query_block` bounds the logits of the blockwise path (:data:`TILE_BYTES`), which the
quantized decode step (one query per row) and callers of :func:`attend_blocks` use.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ._typing import Array, Float, UInt

__all__ = ["Dense", "Affine", "AffineRows", "attend_segments", "attend_blocks", "dequantized",
           "query_block", "TILE_BYTES"]

#: Bytes of one block's float32 logits (heads x query rows x keys) that
#: :func:`attend_segments` holds at once; a prefill chunk goes in blocks of query rows.
TILE_BYTES = 64 << 20


class Dense(NamedTuple):
    """Stored rows kept in the cache dtype."""

    keys: Float[Array, "b h n d"]
    values: Float[Array, "b h n d"]


class Affine(NamedTuple):
    """Stored rows as affine codes: keys per channel along tokens, values per token."""

    key_codes: UInt[Array, "b h d kw"]
    key_scales: Float[Array, "b h d kg"]
    key_zeros: Float[Array, "b h d kg"]
    value_codes: UInt[Array, "b h n vw"]
    value_scales: Float[Array, "b h n vg"]
    value_zeros: Float[Array, "b h n vg"]
    bits: int
    group_size: int


class AffineRows(NamedTuple):
    """Stored rows as affine codes, keys and values both per token (groups along channels)."""

    key_codes: UInt[Array, "b h n kw"]
    key_scales: Float[Array, "b h n kg"]
    key_zeros: Float[Array, "b h n kg"]
    value_codes: UInt[Array, "b h n vw"]
    value_scales: Float[Array, "b h n vg"]
    value_zeros: Float[Array, "b h n vg"]
    bits: int
    group_size: int


def _length(seg) -> int:
    return seg.keys.shape[2] if isinstance(seg, Dense) else seg.value_codes.shape[2]


def attend_segments(queries: Float[Array, "b q s d"], segments: list,
                    keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"], *,
                    scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention of ``queries`` over the stored ``segments`` followed by ``s`` new tokens.

    ``mask`` is ``None`` (every key visible) or ``"causal"`` (query ``i`` sees the new tokens
    up to ``i``; stored tokens precede the chunk and are always visible).
    """
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise ValueError("attend_segments takes mask=None or 'causal'")
    if queries.shape[2] > 1:  # a chunk: dense rows and the fused kernel (see the module)
        segs = [dequantized(x, queries.dtype) for x in segments if _length(x) > 0]
        k = mx.concatenate([x.keys for x in segs] + [keys.astype(queries.dtype)], axis=2)
        v = mx.concatenate([x.values for x in segs] + [values.astype(queries.dtype)], axis=2)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    return attend_blocks(queries, segments, keys, values, scale=scale, mask=mask)


def dequantized(seg, dtype) -> Dense:
    """A segment's rows as ``Dense`` keys and values ``[b, h, n, d]`` in ``dtype``."""
    from .quant import dequantize  # float32 arithmetic, as get_kv rounds it

    if isinstance(seg, Dense):
        return Dense(seg.keys.astype(dtype), seg.values.astype(dtype))
    k = dequantize(seg.key_codes, seg.key_scales, seg.key_zeros, seg.bits, seg.group_size, dtype)
    if isinstance(seg, Affine):  # keys stored transposed, groups along the tokens
        k = k.swapaxes(-1, -2)
    v = dequantize(seg.value_codes, seg.value_scales, seg.value_zeros, seg.bits, seg.group_size, dtype)
    return Dense(k, v)


def attend_blocks(queries: Float[Array, "b q s d"], segments: list,
                  keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"], *,
                  scale: float, mask=None) -> Float[Array, "b q s d"]:
    """:func:`attend_segments` on the codes themselves: scores and outputs of affine segments
    through ``mx.quantized_matmul``, one float32 softmax over every segment and the new
    tokens, the queries in blocks of rows (:func:`query_block`)."""
    b, hq, s, d = queries.shape
    h = keys.shape[1]
    g = hq // h
    q = (queries * scale).reshape(b, h, g * s, d)
    segs = [x for x in segments if _length(x) > 0]
    n = sum(_length(x) for x in segs) + s
    rows = query_block(b * h, n, g * s)
    outs = [_attend_block(q[:, :, lo:lo + rows], lo, s, segs, keys, values, mask, queries.dtype)
            for lo in range(0, g * s, rows)]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.reshape(b, hq, s, d).astype(queries.dtype)


def query_block(heads: int, n: int, rows: int, tile_bytes: int | None = None) -> int:
    """Query rows per kv head scored at once: as many as keep one block's float32 logits
    (``heads x rows x n``) within ``tile_bytes`` (default :data:`TILE_BYTES`), at least one, at most ``rows``."""
    tile = TILE_BYTES if tile_bytes is None else tile_bytes
    return max(1, min(rows, tile // max(1, 4 * heads * n)))


def _attend_block(q, lo: int, s: int, segs: list, keys, values, mask, dtype):
    """Output of the query rows ``lo .. lo + q.shape[2] - 1`` (row ``i`` is the chunk's token
    ``i % s``) over the segments and the new tokens."""
    logits = []
    for seg in segs:
        if isinstance(seg, Dense):
            logits.append(q @ seg.keys.swapaxes(-1, -2))
        elif isinstance(seg, AffineRows):
            logits.append(mx.quantized_matmul(q, seg.key_codes, seg.key_scales, seg.key_zeros,
                                              transpose=True, group_size=seg.group_size,
                                              bits=seg.bits))
        else:
            logits.append(mx.quantized_matmul(q, seg.key_codes, seg.key_scales, seg.key_zeros,
                                              transpose=False, group_size=seg.group_size,
                                              bits=seg.bits))
    new = q @ keys.swapaxes(-1, -2)
    if mask is not None and s > 1:
        i = mx.arange(lo, lo + q.shape[2])[:, None] % s
        new = mx.where(mx.arange(s)[None, :] <= i, new, mx.array(-mx.inf, new.dtype))
    logits.append(new)
    p = mx.softmax(mx.concatenate(logits, axis=-1).astype(mx.float32), axis=-1, precise=True)
    p = p.astype(dtype)
    out = None
    start = 0
    for seg in segs + [Dense(keys, values)]:
        n = _length(seg)
        part = p[..., start:start + n]
        start += n
        if isinstance(seg, Dense):
            o = part @ seg.values
        else:
            o = mx.quantized_matmul(part, seg.value_codes, seg.value_scales, seg.value_zeros,
                                    transpose=False, group_size=seg.group_size, bits=seg.bits)
        out = o if out is None else out + o
    return out
