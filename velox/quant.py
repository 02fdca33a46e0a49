"""Group quantization with real bit packing (MLX), in MLX's affine layout.

Groups run along the last axis: each group of ``group_size`` values gets a ``scale`` and a
``zero`` (the group minimum); codes ``q = round((x - zero) / scale)`` in ``[0, 2**bits - 1]``
are packed as a little-endian bit stream into ``uint32`` words: code ``i`` occupies bits
``[i*bits, (i+1)*bits)``. This is the layout of ``mx.quantize``, so packed keys and values
can feed ``mx.quantized_matmul`` directly. Scales and zeros are stored in the cache dtype and
the codes are computed against the stored (rounded) scale and zero.
"""

from __future__ import annotations

import mlx.core as mx

from ._typing import Array, Float, UInt

__all__ = ["SUPPORTED_BITS", "pack", "unpack", "quantize", "dequantize", "error_bound",
           "unit_roundoff"]

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def unit_roundoff(dtype: mx.Dtype) -> float:
    """Half the spacing of ``dtype`` at 1: the relative error of one rounding."""
    return {mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8, mx.float32: 2.0 ** -24}[dtype]


def _word_layout(bits: int):
    """For the 32 codes of one packing unit (``bits`` words): word, shift, spill per code."""
    out = []
    for i in range(32):
        start = i * bits
        word, shift = divmod(start, 32)
        out.append((word, shift, shift + bits > 32))
    return out


def pack(codes: UInt[Array, "*batch m"], bits: int) -> UInt[Array, "*batch w"]:
    """Pack ``m`` codes of ``bits`` bits each (``m * bits`` divisible by 32) into uint32 words."""
    m = codes.shape[-1]
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not one of {SUPPORTED_BITS}")
    if (m * bits) % 32 or (32 % bits and m % 32):
        unit = 32 // bits if 32 % bits == 0 else 32
        raise ValueError(f"cannot pack {m} codes of {bits} bits: need a multiple of {unit}")
    lead = codes.shape[:-1]
    codes = codes.astype(mx.uint32)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (mx.arange(per, dtype=mx.uint32) * bits)
        return (codes.reshape(*lead, m // per, per) << shifts).sum(axis=-1).astype(mx.uint32)
    units = codes.reshape(*lead, m // 32, 32)
    words = [None] * bits
    for i, (word, shift, spill) in enumerate(_word_layout(bits)):
        c = units[..., i]
        words[word] = (c << shift) if words[word] is None else words[word] | (c << shift)
        if spill:
            hi = c >> (32 - shift)
            words[word + 1] = hi if words[word + 1] is None else words[word + 1] | hi
    return mx.stack(words, axis=-1).reshape(*lead, m * bits // 32)


def unpack(words: UInt[Array, "*batch w"], bits: int) -> UInt[Array, "*batch m"]:
    """Inverse of :func:`pack`."""
    w = words.shape[-1]
    lead = words.shape[:-1]
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per = 32 // bits
        shifts = mx.arange(per, dtype=mx.uint32) * bits
        return ((words[..., None] >> shifts) & mask).reshape(*lead, w * per)
    units = words.reshape(*lead, w // bits, bits)
    codes = []
    for word, shift, spill in _word_layout(bits):
        c = units[..., word] >> shift
        if spill:
            c = c | (units[..., word + 1] << (32 - shift))
        codes.append(c & mask)
    return mx.stack(codes, axis=-1).reshape(*lead, w // bits * 32)


def quantize(x: Float[Array, "*batch m"], bits: int, group_size: int):
    """Affine min/max quantization in groups along the last axis.

    Returns ``(codes, scales, zeros)``: packed ``uint32 [..., m*bits/32]`` and
    ``[..., m/group_size]`` scales and zeros in ``x.dtype``.
    """
    m = x.shape[-1]
    if m % group_size:
        raise ValueError(f"last axis {m} is not a multiple of group_size={group_size}")
    lead = x.shape[:-1]
    levels = (1 << bits) - 1
    g = x.astype(mx.float32).reshape(*lead, m // group_size, group_size)
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    scales = ((hi - lo) / levels).astype(x.dtype)
    zeros = lo.astype(x.dtype)
    s32 = scales.astype(mx.float32)[..., None]
    z32 = zeros.astype(mx.float32)[..., None]
    safe = mx.where(s32 > 0, s32, 1.0)
    q = mx.clip(mx.round((g - z32) / safe), 0, levels)
    q = mx.where(s32 > 0, q, 0).astype(mx.uint32).reshape(*lead, m)
    return pack(q, bits), scales, zeros


def dequantize(codes: UInt[Array, "*batch w"], scales: Float[Array, "*batch g"],
               zeros: Float[Array, "*batch g"], bits: int, group_size: int) -> Float[Array, "*batch m"]:
    """Reconstruct ``q * scale + zero`` in the scales' dtype."""
    q = unpack(codes, bits).astype(mx.float32)
    lead = q.shape[:-1]
    m = q.shape[-1]
    q = q.reshape(*lead, m // group_size, group_size)
    x = q * scales.astype(mx.float32)[..., None] + zeros.astype(mx.float32)[..., None]
    return x.reshape(*lead, m).astype(scales.dtype)


def error_bound(scales: Float[Array, "*batch g"], zeros: Float[Array, "*batch g"], bits: int,
                group_size: int) -> Float[Array, "*batch m"]:
    """Per-element bound on ``|x - dequantize(quantize(x))|``: ``scale/2`` plus dtype rounding.

    Rounding terms: the stored zero and scale (relative error ``u`` each, the scale's error
    multiplied by up to ``2**bits - 1`` steps, which also bounds clipping at the top), and the
    final rounding of the reconstruction to the cache dtype.
    """
    u = unit_roundoff(scales.dtype)
    levels = (1 << bits) - 1
    s = scales.astype(mx.float32)
    z = mx.abs(zeros.astype(mx.float32))
    top = z + levels * s
    bound = 0.5 * s + u * (2 * z + (levels + 1) * s) + u * top + 8 * 2.0 ** -24 * top
    return mx.repeat(bound, group_size, axis=-1)
