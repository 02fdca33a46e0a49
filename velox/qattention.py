"""Attention over stored segments without materialising a dense cache.

A state's stored tokens are a list of segments in position order: ``Dense`` rows, ``Affine``
rows held as MLX affine codes with keys transposed ``[b, h, d, n]`` (groups along the tokens,
KIVI's per-channel keys) and values ``[b, h, n, d]`` (groups along the channels), or
``AffineRows`` with keys and values both per token (the layout of ``velox.quant`` and of
``mx.quantize``). Scores and outputs of affine segments go through
``mx.quantized_matmul`` on the packed codes; one softmax spans every segment and the new
tokens, so the result equals dense attention over ``get_kv`` plus the new tokens. A chunk's
queries go in blocks of rows (:func:`query_block`) so that no more than :data:`TILE_BYTES` of
logits exist at once (a single row's ``b x h x n`` float32 logits, when larger, are the least
a block holds): a prefill never materialises the whole chunk x cache score matrix.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ._typing import Array, Float, UInt

__all__ = ["Dense", "Affine", "AffineRows", "attend_segments", "query_block", "TILE_BYTES"]

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
