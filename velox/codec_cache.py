"""Caches whose keys are held by a codec and whose values by a value codec.

One builder for every method of this shape (TurboQuant, PolarQuant, QJL, SpectralQuant): the
method module names its codec (``velox.codecs``), its parameters (its ``init`` signature) and
how its values are held; this module writes the state record, the update of both backends,
``get_kv``, ``positions``, ``dims`` and the attention on the codes.

State (:func:`state_type`): ``key_codes`` (the codec's codes record, nested, every array with
leading ``[b, h, n]`` axes), ``value_codes`` (:class:`Int8Rows`: per-token 8-bit affine codes,
one group a row, scales and zeros in ``velox.quant.side_dtype``, float16 for float16 and float32
caches; or :class:`ExactRows`: the rows in float16, bfloat16 for a bfloat16 cache), ``tables`` (the codec's static
tables record, nested; its bytes count in the state's), ``key_channels`` (methods with outlier
channels only, below), ``next_pos``, then every parameter of ``init`` as a static field,
``cache_dtype`` and ``backend``. Every token is kept, in order.

Outlier channels (``state_type(..., split=True)``: an ``init`` with ``n_outlier`` and
``outlier_bits``): with ``n_outlier > 0`` the key codec is the split codec of the method's codec
(:func:`velox.codecs.split.of`: the first ``n_outlier`` channels at ``outlier_bits``, the rest at
``bits``, two instances), and ``key_channels [b, h, d]`` (int32) is the channel order of each
(batch row, kv head): its outlier channels, then the rest. The outlier channels are the
``n_outlier`` channels of largest mean squared magnitude over the keys of the first update that
holds tokens (ties: the lower channel index), chosen then (:func:`velox.codecs.split.channel_order`
or its NumPy twin on the reference backend) and kept for the state's life; before it the order
is the identity. Keys are put in that order before they are encoded, queries before they are
scored, and decoded keys back in place. With ``n_outlier = 0`` the codec is the method's own and
``key_channels`` is ``[b, h, 0]`` (no bytes): the same codes as a method without the split.

Backends: ``mlx`` encodes with the codec's MLX functions and quantizes values with
``velox.quant.quantize``; ``reference`` runs the codec's NumPy twins and
``velox.reference.quantize`` on the same inputs, giving the same codes.

Attention (:func:`attend`): logits over the stored tokens are the codec's ``scores`` of the
scaled queries against the key codes (:func:`key_scores`, never decoding the keys); the ``s`` new tokens' logits
are exact; one softmax; the weights multiply the dequantized stored values and the new values.
Queries are processed in blocks of :data:`QUERY_BLOCK` rows per kv head, so a prefill chunk
never holds more than one block's scores. A decode step (one query token) on a CUDA device
runs the fused kernels of ``velox.kernels.codec`` where they take the state (TurboQuant mse,
rvq and prod, QJL: ``supports``), with the same result within float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from . import quant
from . import reference as ref
from ._typing import Array, Float, Int, UInt
from .attention import softmax
from .codecs import Codec, append, get_codec, numpy_tables, split
from .kernels import codec as codec_kernel
from .registry import Method, register
from .spec import param_fields

__all__ = ["Int8Rows", "ExactRows", "VALUE_BITS", "QUERY_BLOCK", "state_type", "empty",
           "register_method", "codec_of", "codec_params", "get_kv", "positions", "dims",
           "attend", "stored_tokens", "key_scores"]

#: Bits of the per-token affine value codes.
VALUE_BITS = 8
#: Query rows (per kv head) scored at once by :func:`attend`.
QUERY_BLOCK = 256


class Int8Rows(NamedTuple):
    """Values as per-token 8-bit affine codes: one group per row (``velox.quant`` layout)."""

    codes: UInt[Array, "b h n w"]
    scales: Float[Array, "b h n 1"]
    zeros: Float[Array, "b h n 1"]


class ExactRows(NamedTuple):
    """Values held exact, in float16 (bfloat16 for a bfloat16 cache: ``velox.quant.side_dtype``),
    as the seed holds them and as the other quantizers hold their exact rows by default."""

    rows: Float[Array, "b h n d"]


class _Layout(NamedTuple):
    codec: str
    values: type
    rename: dict
    split: bool = False   # n_outlier / outlier_bits parameters: the channel split


_LAYOUT: dict[type, _Layout] = {}


def state_type(name: str, init: Callable, doc: str, *, codec: str, codes: type, tables: type,
               values: type = Int8Rows, rename: dict[str, str] | None = None,
               split: bool = False) -> type:
    """The state record of a codec cache, from its ``init``: ``key_codes`` (a ``codes``
    record), ``value_codes`` (``values``: :class:`Int8Rows` or :class:`ExactRows`), ``tables``
    (a ``tables`` record), ``key_channels`` (``split`` only), ``next_pos``, every parameter of
    ``init``'s signature as a static field (its annotation), ``cache_dtype``, ``backend``.

    ``codec`` names the key codec; ``rename`` maps a codec parameter name to the method's
    parameter of another name (default: the same names). ``split``: ``init`` has ``n_outlier``
    and ``outlier_bits`` and the keys' channels split in two (module doc); ``codes`` and
    ``tables`` are then those of ``n_outlier = 0``.
    """
    if values not in (Int8Rows, ExactRows):
        raise ValueError("values are Int8Rows or ExactRows")
    if split and not {"n_outlier", "outlier_bits"} <= {n for n, _ in param_fields(init)}:
        raise ValueError("a split codec cache's init has the parameters n_outlier and outlier_bits")
    fields = [("key_codes", codes), ("value_codes", values), ("tables", tables),
              *([("key_channels", Int[Array, "b h c"])] if split else []),
              ("next_pos", Int[Array, "b h"])]
    record = NamedTuple(name, [*fields, *param_fields(init), ("cache_dtype", str), ("backend", str)])
    record.__doc__ = doc
    record.__module__ = init.__module__
    _LAYOUT[record] = _Layout(codec, values, dict(rename or {}), split)
    return record


def _codec(lay: _Layout, params: dict[str, Any]) -> Codec:
    """The key codec of a layout for these parameters (the split codec when ``n_outlier > 0``)."""
    base = get_codec(lay.codec)
    return split.of(base) if lay.split and params.get("n_outlier", 0) else base


def codec_of(state) -> Codec:
    """The key codec of a codec-cache state."""
    lay = _LAYOUT[type(state)]
    return _codec(lay, {"n_outlier": state.n_outlier} if lay.split else {})


def codec_params(state_or_type, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The codec's parameters (its ``params`` names) read from a state, or from ``params``
    (the method's parameters by name) for a state type. A codec parameter the method does not
    have is left out (the codec's default: e.g. SpectralQuant's calibrated rotation)."""
    lay = _LAYOUT[state_or_type if isinstance(state_or_type, type) else type(state_or_type)]
    src = params if params is not None else state_or_type._asdict()
    names = _codec(lay, src).params
    return {n: src[lay.rename.get(n, n)] for n in names if lay.rename.get(n, n) in src}


def empty(state_type: type, args: dict) -> tuple:
    """A fresh state from ``init``'s arguments (``locals()`` of an ``init``): the codec's
    tables, no tokens, ``next_pos`` zero, the static fields from ``args`` by name."""
    lay = _LAYOUT[state_type]
    codec = _codec(lay, args)
    b, h, d, dtype = args["batch"], args["kv_heads"], args["head_dim"], args["dtype"]
    tables = codec.tables(d, codec_params(state_type, args))
    # the codes record of no token: one encoded zero row, cut to length 0
    one = codec.encode(tables, mx.zeros((b, h, 1, d), mx.float32))
    key_codes = type(one)(*(x[:, :, :0] for x in one))
    if lay.values is Int8Rows:
        vc, vs, vz = quant.quantize(mx.zeros((b, h, 1, d), dtype), VALUE_BITS, d, dtype)
        value_codes = Int8Rows(vc[:, :, :0], vs[:, :, :0], vz[:, :, :0])
    else:
        value_codes = ExactRows(mx.zeros((b, h, 0, d), quant.side_dtype(dtype)))
    given = dict(key_codes=key_codes, value_codes=value_codes, tables=tables,
                 next_pos=mx.zeros((b, h), mx.int32), cache_dtype=quant.dtype_name(dtype))
    if lay.split:  # the identity until the first tokens choose the outlier channels
        c = d if args["n_outlier"] else 0
        given["key_channels"] = mx.zeros((b, h, c), mx.int32) + mx.arange(c, dtype=mx.int32)
    return state_type(**{f: given[f] if f in given else args[f] for f in state_type._fields})


def stored_tokens(state) -> int:
    """Tokens the state holds."""
    return state.value_codes[0].shape[2]


def dims(state) -> tuple[int, int, int, mx.Dtype]:
    """``(batch, kv_heads, head_dim, dtype)``: from the value codes and ``cache_dtype``."""
    b, h = state.next_pos.shape
    v = state.value_codes
    d = v.rows.shape[3] if isinstance(v, ExactRows) else v.codes.shape[3] * 32 // VALUE_BITS
    return b, h, d, quant.dtype_of(state.cache_dtype)


positions = quant.every_position(stored_tokens)


def _values_f32(state) -> Float[Array, "b h n d"]:
    v = state.value_codes
    if isinstance(v, ExactRows):
        return v.rows.astype(mx.float32)
    d = dims(state)[2]
    return quant.dequantize_f32(v.codes, v.scales, v.zeros, VALUE_BITS, d)


def _split(state) -> bool:
    """Whether the state's keys are split into outlier channels and the rest."""
    return _LAYOUT[type(state)].split and bool(state.n_outlier)


def _chosen(state, keys, reference: bool):
    """The state with its outlier channels chosen from ``keys`` if it is split and holds no
    token yet (the first update that holds tokens); else the state."""
    if not _split(state) or stored_tokens(state):
        return state
    if reference:
        order = mx.array(split.channel_order_np(ref.to_np(keys, np.float32), state.n_outlier))
    else:
        order = split.channel_order(keys, state.n_outlier)
    return state._replace(key_channels=order)


def _in_codec_order(state, x: Float[Array, "b h n d"]) -> Float[Array, "b h n d"]:
    """Rows or queries with their channels in the key codec's order (outlier channels first)."""
    return split.gather(x, state.key_channels) if _split(state) else x


def key_scores(state, q: Float[Array, "b h m d"]) -> Float[Array, "b h m n"]:
    """The key codec's ``scores`` of float32 queries ``q`` (scaled) against the stored keys."""
    return codec_of(state).scores(state.tables, _in_codec_order(state, q), state.key_codes)


def get_kv(state) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Decoded keys (the codec's float32 decode) and dequantized values, in the model's dtype."""
    cd = quant.dtype_of(state.cache_dtype)
    keys = codec_of(state).decode(state.tables, state.key_codes)
    if _split(state):
        keys = split.scatter(keys, state.key_channels)
    return keys.astype(cd), _values_f32(state).astype(cd)


def _update_mlx(state, keys, values, queries):
    cd, d = quant.dtype_of(state.cache_dtype), keys.shape[3]
    state = _chosen(state, keys, reference=False)
    kc = codec_of(state).encode(state.tables, _in_codec_order(state, keys))
    if isinstance(state.value_codes, ExactRows):
        vc = ExactRows(values.astype(quant.side_dtype(cd)))
    else:
        vc = Int8Rows(*quant.quantize(values, VALUE_BITS, d, cd))
    return state._replace(key_codes=append(state.key_codes, kc),
                          value_codes=append(state.value_codes, vc),
                          next_pos=state.next_pos + keys.shape[2])


def _update_reference(state, keys, values, queries):
    cd, d = quant.dtype_of(state.cache_dtype), keys.shape[3]
    state = _chosen(state, keys, reference=True)
    codec = codec_of(state)
    rows = ref.to_np(keys, np.float32)
    if _split(state):
        rows = split.gather_np(rows, np.array(state.key_channels))
    codes = codec.encode_np(numpy_tables(state.tables), rows)
    # each field in the dtype of the MLX codes (the state's empty record says it)
    kc = type(codes)(*(mx.array(np.ascontiguousarray(x)).astype(e.dtype)
                       for x, e in zip(codes, state.key_codes)))
    if isinstance(state.value_codes, ExactRows):
        vc = ExactRows(values.astype(quant.side_dtype(cd)))
    else:
        sd = quant.side_dtype(cd)
        c, s, z = ref.quantize(ref.to_np(values, np.float32), VALUE_BITS, d, sd)
        vc = Int8Rows(mx.array(c), ref.to_mx(s, sd), ref.to_mx(z, sd))
    return state._replace(key_codes=append(state.key_codes, kc),
                          value_codes=append(state.value_codes, vc),
                          next_pos=state.next_pos + keys.shape[2])


def attend(state, queries: Float[Array, "b q s d"], keys: Float[Array, "b h s d"],
           values: Float[Array, "b h s d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention of ``queries`` over the stored tokens (logits from the key codes, the codec's
    ``scores``) followed by ``s`` new tokens (exact logits; ``mask="causal"``: query ``i`` sees
    the new tokens up to ``i``)."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise ValueError("attend takes mask=None or 'causal'")
    b, hq, s, d = queries.shape
    if s == 1 and codec_kernel.supports(state, queries):  # a decode step on a CUDA device
        return codec_kernel.decode_attend(state, queries, keys, values, scale=scale)
    h = keys.shape[1]
    g = hq // h
    q = (queries.astype(mx.float32) * scale).reshape(b, h, g * s, d)
    kn, vn = keys.astype(mx.float32), values.astype(mx.float32)
    vs = _values_f32(state)
    n = vs.shape[2]
    outs = []
    for lo in range(0, g * s, QUERY_BLOCK):
        qb = q[:, :, lo:lo + QUERY_BLOCK]
        new = qb @ kn.swapaxes(-1, -2)
        if mask is not None and s > 1:
            row = (mx.arange(lo, lo + qb.shape[2]) % s)[:, None]
            new = mx.where(mx.arange(s)[None, :] <= row, new, mx.array(-mx.inf, mx.float32))
        if n:
            logits = mx.concatenate([key_scores(state, qb), new], axis=-1)
            p = softmax(logits, axis=-1)
            outs.append(p[..., :n] @ vs + p[..., n:] @ vn)
        else:
            outs.append(softmax(new, axis=-1) @ vn)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.reshape(b, hq, s, d).astype(queries.dtype)


def register_method(key: str, state: type, init: Callable, **hooks: Any) -> Method:
    """Register a codec-cache method: both backends, ``get_kv``, ``positions``, ``dims`` and
    ``attend`` of this module (``hooks`` add or replace any of them)."""
    kw = dict(get_kv=get_kv, positions=positions, dims=dims, attend=attend)
    kw.update(hooks)
    return register(key, state, init, {"reference": _update_reference, "mlx": _update_mlx}, **kw)
