"""CacheGen-adapted: group quantization, token-delta codes, range-coded with adaptive models.

Keys are quantized per channel in groups of ``group_size`` (``G``) tokens, values per token
in groups of ``G`` channels (the seed's KIVI-style quantizer; a head_dim that ``G`` does not
divide is one group per token); the ``T mod G`` newest wait exact. Each completed group of
``G`` tokens is range coded, losslessly: per channel the first code is an anchor (uniform,
``bits`` bits) and the rest are token deltas ``q[t] - q[t-1]`` (or the codes,
``use_delta=False``) under a quantized Laplace model per channel (per head with
``per_channel=False``). Models adapt backwards: a group is coded with
the model fitted to the previous group's symbols (a fixed prior first), so a decoder rebuilds
them and nothing is stored per group. One segment per group spans every row and head; a
segment no shorter than fixed-width packing is stored packed. The reconstruction is plain
group quantization (error bound ``scale/2`` plus rounding); ``get_kv`` reads fixed-width
segments as they are and decodes range-coded ones on the host.
Scales and zeros are float16 (``velox.quant.side_dtype``); the ``< G`` exact tokens keep the
model's dtype.
The ``layer_params`` hook gives ``layer_groups`` contiguous layer groups ``bits``,
``bits - 1``, ... (at least ``min(2, bits)``): shallow layers get more.

Shapes: ``keys_scales``/``_zeros [b, h, d, Q/G]``, ``values_scales``/``_zeros [b, h, Q, d/G]``,
``_stream [w]`` (flat uint32
words of every segment), ``_lengths [Q/G]`` (words per segment), ``_packed [Q/G]``,
``_model [b, h, c, 2]`` (uint8 mean and scale byte for the next group; ``c = d`` or 1),
``residual_* [b, h, r, d]``.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import entropy, nuq, quant
from .. import reference as ref
from .._typing import Array, Bool, Float, Int, UInt
from ..registry import dims_of, register
from ..spec import load_spec, validate_params

__all__ = ["CacheGenState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "error_bound", "layer_bits", "decode_codes", "packed_codes", "coded_nbytes",
           "packed_nbytes"]

KINDS = ("keys", "values")


class CacheGenState(NamedTuple):
    """Range-coded key/value codes with their scales, zeros and adaptive models; exact tail."""

    keys_stream: UInt[Array, "wk"]
    keys_lengths: UInt[Array, "g"]
    keys_packed: Bool[Array, "g"]
    keys_model: UInt[Array, "b h c 2"]
    keys_scales: Float[Array, "b h d g"]
    keys_zeros: Float[Array, "b h d g"]
    values_stream: UInt[Array, "wv"]
    values_lengths: UInt[Array, "g"]
    values_packed: Bool[Array, "g"]
    values_model: UInt[Array, "b h c 2"]
    values_scales: Float[Array, "b h q gv"]
    values_zeros: Float[Array, "b h q gv"]
    residual_keys: Float[Array, "b h r d"]
    residual_values: Float[Array, "b h r d"]
    next_pos: Int[Array, "b h"]
    bits: int
    group_size: int
    use_delta: bool
    per_channel: bool
    layer_groups: int
    backend: str


def _prior(bits: int, use_delta: bool) -> tuple[int, int]:
    """Model of the first group: mean (0 for deltas, mid-range for codes) and scale byte."""
    levels = (1 << bits) - 1
    return (0 if use_delta else (levels + 1) // 2), int(entropy.index_of((levels + 1) / 4.0))


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 4, group_size: int = 32, use_delta: bool = True, per_channel: bool = True,
         layer_groups: int = 3, backend: str = "auto") -> CacheGenState:
    """Empty CacheGen state (one layer; ``layer_bits`` gives the per-layer schedule).

    Args:
        bits: bits per code (of the shallowest layers under the per-layer schedule).
        group_size: tokens per group (keys: one scale and zero per channel and group; values:
            per token and group_size channels; one coded segment per group).
        use_delta: code token deltas of the codes (the first token of a group is the anchor).
        per_channel: one probability model per channel (else one per head).
        layer_groups: contiguous layer groups of the per-layer schedule (bits, bits - 1, ...).
    """
    b, h, d = batch, kv_heads, head_dim
    c = d if per_channel else 1
    side_shape = {"keys": (b, h, d, 0), "values": (b, h, 0, d // value_group(d, group_size))}
    model = mx.broadcast_to(mx.array(_prior(bits, use_delta), mx.uint8), (b, h, c, 2))
    fields = {}
    for kind in KINDS:
        fields.update({f"{kind}_stream": mx.zeros((0,), mx.uint32),
                       f"{kind}_lengths": mx.zeros((0,), mx.uint32),
                       f"{kind}_packed": mx.zeros((0,), mx.bool_),
                       f"{kind}_model": mx.array(model),
                       f"{kind}_scales": mx.zeros(side_shape[kind], quant.side_dtype(dtype)),
                       f"{kind}_zeros": mx.zeros(side_shape[kind], quant.side_dtype(dtype))})
    return CacheGenState(**fields, residual_keys=mx.zeros((b, h, 0, d), dtype),
                         residual_values=mx.zeros((b, h, 0, d), dtype),
                         next_pos=mx.zeros((b, h), mx.int32), bits=bits, group_size=group_size,
                         use_delta=use_delta, per_channel=per_channel, layer_groups=layer_groups,
                         backend=backend)


def value_group(head_dim: int, group_size: int) -> int:
    """Channels per value group: ``group_size``, or the whole row when it does not divide."""
    return group_size if head_dim % group_size == 0 else head_dim


def quantized_groups(state: CacheGenState) -> int:
    return state.keys_scales.shape[-1]


# --- the code of one group (host side, shared by both backends) ----------------------------

def _symbols(state: CacheGenState, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A group's codes ``[b, h, d, G]`` -> (anchors ``[b, h, d]`` or none, modelled symbols)."""
    codes = codes.astype(np.int64)
    if state.use_delta:
        return codes[..., 0], np.diff(codes, axis=-1)
    return codes[..., :0], codes


def _fit(state: CacheGenState, symbols: np.ndarray) -> np.ndarray:
    """The model ``[b, h, c, 2]`` (uint8 mean, scale byte) fitted to one group's symbols."""
    axis = -1 if state.per_channel else (-2, -1)
    mean, index = entropy.fit_laplace(symbols, axis, centre=not state.use_delta)
    if not state.per_channel:
        mean, index = mean[..., None], index[..., None]
    return np.stack([mean.astype(np.uint8), index], axis=-1)


def _model_params(state: CacheGenState, model: np.ndarray, shape) -> tuple[np.ndarray, np.ndarray]:
    """Per-symbol Laplace means and scales for symbols of ``shape`` ``[b, h, d, n]``."""
    mean = model[..., 0].astype(np.float64)[..., None]
    scale = entropy.scale_of(model[..., 1])[..., None]
    return np.broadcast_to(mean, shape), np.broadcast_to(scale, shape)


def _encode_group(state: CacheGenState, codes: np.ndarray, model: np.ndarray):
    """Words of one group ``[b, h, d, G]``, whether they are fixed-width, and the next model."""
    levels = (1 << state.bits) - 1
    anchors, symbols = _symbols(state, codes)
    lo = -levels if state.use_delta else 0
    means, scales = _model_params(state, model, symbols.shape)
    words = entropy.encode(anchors, levels + 1, symbols, lo, levels, means, scales)
    packed = ref.pack_codes(codes.astype(np.uint32), state.bits).ravel()
    if len(words) >= len(packed):
        words, is_packed = packed, True
    else:
        is_packed = False
    return words, is_packed, _fit(state, symbols)


def _decode_group(state: CacheGenState, words: np.ndarray, is_packed: bool, model: np.ndarray,
                  shape: tuple[int, ...]):
    """Codes ``[b, h, d, G]`` of one segment and the model for the next group."""
    b, h, d, g = shape
    levels = (1 << state.bits) - 1
    if is_packed:
        codes = ref.unpack_codes(words.reshape(b, h, d, g * state.bits // 32), state.bits)
        codes = codes.astype(np.int64)
    else:
        n_sym = (b, h, d, g - 1) if state.use_delta else shape
        means, scales = _model_params(state, model, n_sym)
        lo = -levels if state.use_delta else 0
        anchors, symbols = entropy.decode(words, b * h * d if state.use_delta else 0, levels + 1,
                                          lo, levels, means, scales)
        symbols = symbols.reshape(n_sym)
        if state.use_delta:
            codes = np.concatenate([anchors.reshape(b, h, d, 1), symbols], -1).cumsum(-1)
        else:
            codes = symbols
    return codes, _fit(state, _symbols(state, codes)[1])


def _append(state: CacheGenState, kind: str, codes: np.ndarray, scales: mx.array,
            zeros: mx.array) -> dict:
    """Fields after coding ``m`` new groups of ``kind`` (codes ``[b, h, d, m*G]``; scales and
    zeros in the stored layout of ``kind``)."""
    g, axis = state.group_size, (-1 if kind == "keys" else 2)
    model = np.array(getattr(state, f"{kind}_model"))
    words, lengths, packed = [], [], []
    for j in range(codes.shape[-1] // g):  # models chain group to group
        w, is_packed, model = _encode_group(state, codes[..., j * g:(j + 1) * g], model)
        words.append(w)
        lengths.append(len(w))
        packed.append(is_packed)
    return {f"{kind}_stream": mx.concatenate([getattr(state, f"{kind}_stream"),
                                              mx.array(np.concatenate(words).astype(np.uint32))]),
            f"{kind}_lengths": mx.concatenate([getattr(state, f"{kind}_lengths"),
                                               mx.array(np.array(lengths, np.uint32))]),
            f"{kind}_packed": mx.concatenate([getattr(state, f"{kind}_packed"),
                                              mx.array(np.array(packed, np.bool_))]),
            f"{kind}_model": mx.array(model),
            f"{kind}_scales": mx.concatenate([getattr(state, f"{kind}_scales"), scales], axis),
            f"{kind}_zeros": mx.concatenate([getattr(state, f"{kind}_zeros"), zeros], axis)}


def packed_codes(state: CacheGenState, kind: str) -> UInt[Array, "b h d w"]:
    """Every quantized code of ``kind``, packed at fixed width along the tokens
    (``[b, h, d, Q*bits/32]``, ``velox.quant``'s layout).

    Runs of fixed-width segments are sliced from the stream as they are (no decoding); only
    range-coded segments are decoded on the host, each with the model fitted to the group
    before it.
    """
    b, h, d, n = state.keys_scales.shape
    g, bits = state.group_size, state.bits
    w = g * bits // 32
    c = d if state.per_channel else 1
    model = np.broadcast_to(np.array(_prior(bits, state.use_delta), np.uint8), (b, h, c, 2))
    stream = getattr(state, f"{kind}_stream")
    lengths = np.array(getattr(state, f"{kind}_lengths")).astype(np.int64)
    packed = np.array(getattr(state, f"{kind}_packed"))
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    host = None  # the stream on the host, read only when a segment is range coded
    parts, j = [], 0
    while j < n:
        if not packed[j]:
            host = np.array(stream) if host is None else host
            codes, model = _decode_group(state, host[starts[j]:starts[j + 1]], False, model,
                                         (b, h, d, g))
            parts.append(quant.pack(mx.array(codes.astype(np.uint32)), bits))
            j += 1
            continue
        e = j
        while e < n and packed[e]:
            e += 1
        run = stream[starts[j]:starts[e]].reshape(e - j, b, h, d, w)
        parts.append(run.transpose(1, 2, 3, 0, 4).reshape(b, h, d, (e - j) * w))
        if e < n:  # the coded segment after the run needs the model of the run's last group
            last = np.array(quant.unpack(run[-1], bits))
            model = _fit(state, _symbols(state, last)[1])
        j = e
    if not parts:
        return mx.zeros((b, h, d, 0), mx.uint32)
    return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def decode_codes(state: CacheGenState, kind: str) -> np.ndarray:
    """Every quantized code of ``kind`` (``"keys"`` or ``"values"``), ``[b, h, d, Q]``, decoded."""
    return np.array(quant.unpack(packed_codes(state, kind), state.bits))


# --- backends: the quantization differs (device vs NumPy), the coder is shared ------------------

def _update_mlx(state: CacheGenState, keys, values, queries) -> CacheGenState:
    g, s = state.group_size, keys.shape[2]
    fields = {"next_pos": state.next_pos + s}
    for kind, x in zip(KINDS, (keys, values)):
        rows = mx.concatenate([getattr(state, f"residual_{kind}"), x], axis=2)
        m = rows.shape[2] // g
        fields[f"residual_{kind}"] = rows[:, :, m * g:]
        if m:
            if kind == "keys":  # per channel along the tokens
                q, sc, z = quant.quantize(rows[:, :, :m * g].swapaxes(2, 3), state.bits, g)
                codes = quant.unpack(q, state.bits)
            else:               # per token along the channels; coded per channel
                b, h, _, d = rows.shape
                gv = value_group(d, g)
                codes, sc, z = nuq.affine(rows[:, :, :m * g].reshape(b, h, m * g, d // gv, gv),
                                          state.bits, rows.dtype)
                codes = codes.reshape(b, h, m * g, d).swapaxes(2, 3)
            fields.update(_append(state, kind, np.array(codes), sc, z))
    return state._replace(**fields)


def _update_reference(state: CacheGenState, keys, values, queries) -> CacheGenState:
    dtype, g, s = state.residual_keys.dtype, state.group_size, keys.shape[2]
    sd = quant.side_dtype(dtype)
    b, h = state.next_pos.shape
    fields = {"next_pos": state.next_pos + s}
    for kind, x in zip(KINDS, (keys, values)):
        rows = np.concatenate([ref.to_np(getattr(state, f"residual_{kind}"), np.float32),
                               ref.to_np(x, np.float32)], axis=2)
        m = rows.shape[2] // g
        fields[f"residual_{kind}"] = ref.to_mx(rows[:, :, m * g:], dtype)
        if not m:
            continue
        codes, scales, zeros = [], [], []
        for i in range(b):
            for j in range(h):  # min/max affine codes: keys per channel, values per token
                if kind == "keys":
                    words, sc, z = ref.quantize(rows[i, j, :m * g].T, state.bits, g, sd)
                    codes.append(ref.unpack_codes(words, state.bits))
                else:
                    d = rows.shape[3]
                    gv = value_group(d, g)
                    q, sc, z = nuq.np_affine(rows[i, j, :m * g].reshape(m * g, d // gv, gv),
                                             state.bits, dtype)
                    codes.append(q.reshape(m * g, d).T)
                scales.append(sc)
                zeros.append(z)
        shape = lambda xs: np.stack(xs).reshape(b, h, *xs[0].shape)  # noqa: E731
        fields.update(_append(state, kind, shape(codes), ref.to_mx(shape(scales), sd),
                              ref.to_mx(shape(zeros), sd)))
    return state._replace(**fields)


# --- public functions ----------------------------------------------------------------------------

def get_kv(state: CacheGenState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Decoded, dequantized groups followed by the exact newest tokens."""
    out = []
    for kind in KINDS:
        codes, dtype = packed_codes(state, kind), state.residual_keys.dtype
        if kind == "keys":
            x = quant.dequantize(codes, state.keys_scales, state.keys_zeros, state.bits,
                                 state.group_size, dtype)
        else:  # coded per channel along the tokens; groups per token
            b, h, n, n_g = state.values_scales.shape
            d = state.residual_values.shape[3]
            q = quant.unpack(codes, state.bits).swapaxes(2, 3).astype(mx.float32)
            q = q.reshape(b, h, n, n_g, d // n_g)
            x = (q * state.values_scales.astype(mx.float32)[..., None]
                 + state.values_zeros.astype(mx.float32)[..., None]).reshape(b, h, n, d).astype(dtype)
        out.append(mx.concatenate([x.swapaxes(2, 3) if kind == "keys" else x,
                                   getattr(state, f"residual_{kind}")], axis=2))
    return out[0], out[1]


def coded_nbytes(state: CacheGenState) -> int:
    """Bytes of the coded segments (keys and values)."""
    return int(state.keys_stream.nbytes + state.values_stream.nbytes)


def packed_nbytes(state: CacheGenState) -> int:
    """Bytes the same codes take packed at fixed width (keys and values)."""
    b, h, d, n = state.keys_scales.shape
    return 2 * b * h * d * n * state.group_size * state.bits // 8


positions = quant.every_position(lambda state: quantized_groups(state) * state.group_size
                           + state.residual_keys.shape[2])


def error_bound(
        state: CacheGenState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """``scale/2`` plus rounding per element (lossless coding adds nothing); zero in the tail."""
    out = []
    for kind in KINDS:
        scales = getattr(state, f"{kind}_scales")
        width = state.group_size if kind == "keys" else value_group(state.residual_keys.shape[3],
                                                                       state.group_size)
        bound = quant.error_bound(scales, getattr(state, f"{kind}_zeros"), state.bits, width)
        tail = mx.zeros(getattr(state, f"residual_{kind}").shape, mx.float32)
        out.append(mx.concatenate([bound.swapaxes(2, 3) if kind == "keys" else bound, tail], axis=2))
    return out[0], out[1]


def layer_bits(n_layers: int, bits: int, layer_groups: int) -> list[int]:
    """The seed's schedule: ``layer_groups`` contiguous groups get ``bits``, ``bits - 1``, ...

    Group boundaries are ``round(n_layers * i / groups)``; widths never go below 2 (or below
    ``bits`` when ``bits`` is lower).
    """
    groups = min(layer_groups, n_layers)
    bounds = [round(n_layers * i / groups) for i in range(groups + 1)]
    bounds[-1] = n_layers
    floor = min(2, bits)
    out = []
    for layer in range(n_layers):
        group = next(i for i in range(groups) if bounds[i] <= layer < bounds[i + 1])
        out.append(max(floor, bits - group))
    return out


def _layer_params(n_layers: int, params: dict) -> list[dict]:
    """Per-layer parameters: ``bits`` from :func:`layer_bits`, the rest unchanged."""
    full = validate_params(load_spec("cachegen"), params)
    return [dict(params, bits=b) for b in layer_bits(n_layers, full["bits"], full["layer_groups"])]


State = CacheGenState
method = register("cachegen", CacheGenState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, error_bound=error_bound,
                  dims=dims_of("residual_keys"), layer_params=_layer_params)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
