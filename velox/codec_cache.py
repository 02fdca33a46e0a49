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
channels only, below), ``next_pos``, ``empty``, then every parameter of ``init`` as a static
field, ``cache_dtype`` and ``backend``. Every token is kept, in order.

Storage in chunks (``contract.storage = "chunked"`` in the methods' specs), as mlx-lm's
``KVCache`` holds its rows: the code arrays (every array of ``key_codes`` and ``value_codes``)
hold :func:`capacity` rows, a multiple of :data:`CHUNK` (or the tokens' rows alone, a state of
a file written before); the first ``next_pos`` are the tokens, in order, and the last ``empty``
(a static field) are empty rows, zeros, never read: attention cuts them off (or masks them,
where the count is data), and ``get_kv``, ``positions`` and :func:`stored_tokens` give the
tokens only. An update whose tokens fit writes them in place, at an index that is an array
(``mx.slice_update`` at ``next_pos``: the position is data, so a compiled step is not traced
again per token); one that does not fit copies the tokens once into arrays grown to fit,
rounded up to a chunk (a prefill chunk grows them at once). A fresh state holds no row.
``nbytes`` counts every row.

A state's count of empty rows may be left to its arrays (``empty = UNCOUNTED``,
:func:`uncounted`): the record the whole model's compiled decode step is traced with
(``velox.adapters.model_step``, which checks on the host, from the cache's offset, that the
token fits), so that the record, and the trace, stay the same from token to token; the
adapter's single-token steps outside it (the backend's ``fill``) leave the same record, so that
a cache holds the same state whichever way its steps ran. Its tokens are then ``next_pos``:
the count the host remembers where it made the state, else read from the device by the
functions that need it on the host (a state out of the compiled step), never inside the step.
Compiling an update of such a state (``mx.compile``) needs it counted; an update of a counted
state is traced again at every count (``empty`` is static).

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
``velox.reference.quantize`` on the same inputs, giving the same codes, stored the same way.

Attention (:func:`attend`): a decode step's logits over the stored tokens are the codec's
``scores`` of the scaled queries against the key codes (:func:`key_scores`, never decoding the
keys); the ``s`` new tokens' logits are exact; one softmax; the weights multiply the
dequantized stored values and the new values. A chunk of several tokens (a prefill) decodes
the stored keys once instead (every codec's ``scores`` is the query's inner product with its
decoded key, so the logits are the same to float32 rounding:
``tests/test_codec_prefill.py``) and runs MLX's fused attention over them and the chunk's
rows: scoring the codes per block of queries decoded the stored codes again for every block
of :data:`QUERY_BLOCK` query rows and held a block's logits, which made a TurboQuant prefill
slower than the full cache's and several times its peak memory (on this project's CPU, 8,192
stored tokens and a 1,024-token chunk: TurboQuant prod 148 s and 3,150 MiB against 15 s and
1,298 MiB decoded, the full cache's attention 18 s and 1,177 MiB). A decode step (one query token) on a CUDA device
runs the fused kernels of ``velox.kernels.codec`` where they take the state (TurboQuant mse,
rvq and prod, QJL: ``supports``), reading the held rows of the arrays in place, with the same
result within float32 rounding. A step's attention and update together (``attend_update``,
the adapter's decode step; the backend's ``steady_step``, ``velox.decode.split_step``; the
backend's ``fill`` and ``fill_attention``, the adapter's single-token step into an empty row)
write the new rows first and attend over the written arrays, the new rows masked out of the
stored ones: nothing reads the arrays before the write, so MLX writes in place.

Compositions (``velox.compose``: codes in an evictor's slots) use this module's encoding,
``get_kv`` and attention over a layout of their own (no ``empty`` field): every row of their
arrays is a token, and their updates append by concatenation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from . import quant
from . import reference as ref
from ._typing import Array, Float, Int, UInt
from .attention import softmax
from .backend import Backend
from .codecs import Codec, append, get_codec, numpy_tables, split
from .kernels import codec as codec_kernel
from .registry import Method, register
from .spec import param_fields

__all__ = ["Int8Rows", "ExactRows", "VALUE_BITS", "QUERY_BLOCK", "CHUNK", "UNCOUNTED", "state_type",
           "empty", "register_method", "codec_of", "codec_params", "get_kv", "positions", "dims",
           "attend", "stored_tokens", "capacity", "held_codes", "held_rows", "key_scores",
           "uncounted", "is_chunked"]

#: Bits of the per-token affine value codes.
VALUE_BITS = 8
#: Query rows (per kv head) scored at once by :func:`attend`.
QUERY_BLOCK = 256
#: Rows the code arrays grow by (mlx-lm's ``KVCache`` grows by 256 too).
CHUNK = 256
#: ``empty`` of a state whose count of empty rows is left to its arrays: ``next_pos`` holds
#: its tokens (:func:`uncounted`).
UNCOUNTED = -1


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
    split: bool = False     # n_outlier / outlier_bits parameters: the channel split
    chunked: bool = False   # rows in chunks, the last `empty` of them empty (state_type's)


_LAYOUT: dict[type, _Layout] = {}


def state_type(name: str, init: Callable, doc: str, *, codec: str, codes: type, tables: type,
               values: type = Int8Rows, rename: dict[str, str] | None = None,
               split: bool = False) -> type:
    """The state record of a codec cache, from its ``init``: ``key_codes`` (a ``codes``
    record), ``value_codes`` (``values``: :class:`Int8Rows` or :class:`ExactRows`), ``tables``
    (a ``tables`` record), ``key_channels`` (``split`` only), ``next_pos``, ``empty`` (the
    arrays' empty rows, the last ones), every parameter of ``init``'s signature as a static
    field (its annotation), ``cache_dtype``, ``backend``.

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
              ("next_pos", Int[Array, "b h"]), ("empty", int)]
    record = NamedTuple(name, [*fields, *param_fields(init), ("cache_dtype", str), ("backend", str)])
    record.__doc__ = doc
    record.__module__ = init.__module__
    _LAYOUT[record] = _Layout(codec, values, dict(rename or {}), split, chunked=True)
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
    tables, no tokens (and no rows), ``next_pos`` zero, the static fields from ``args`` by name."""
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
                 next_pos=mx.zeros((b, h), mx.int32), empty=0, cache_dtype=quant.dtype_name(dtype))
    if lay.split:  # the identity until the first tokens choose the outlier channels
        c = d if args["n_outlier"] else 0
        given["key_channels"] = mx.zeros((b, h, c), mx.int32) + mx.arange(c, dtype=mx.int32)
    return state_type(**{f: given[f] if f in given else args[f] for f in state_type._fields})


# --- the rows a state holds -----------------------------------------------------------

def is_chunked(state) -> bool:
    """Whether ``state`` holds its rows in chunks (a codec cache's own state, not a
    composition's codes in slots)."""
    lay = _LAYOUT.get(type(state))
    return lay is not None and lay.chunked


def capacity(state) -> int:
    """Rows the state's code arrays hold: its tokens and its empty rows (a composition's:
    its tokens)."""
    return state.value_codes[0].shape[2]


# The counts of the states the host made with their count left to their arrays (the adapter's
# single-token steps, :func:`_fill`), by the id of their ``next_pos`` array (an immutable value)
# and dropped with it: such a state is counted without reading the device.
_COUNTS: dict[int, tuple[weakref.ref, int]] = {}


def _uncounted_with(state, n: int) -> tuple:
    """:func:`uncounted` of a state of ``n`` tokens, its count remembered on the host."""
    pos, key = state.next_pos, id(state.next_pos)

    def forget(ref, key=key):
        if _COUNTS.get(key, (None,))[0] is ref:
            del _COUNTS[key]

    _COUNTS[key] = (weakref.ref(pos, forget), n)
    return uncounted(state)


def stored_tokens(state) -> int:
    """Tokens the state holds: its rows less its empty ones (read on the host from the
    arrays' shapes and ``empty``). A state whose count is left to its arrays (``empty =
    UNCOUNTED``) holds ``next_pos`` tokens: the count the host remembers for it where it made
    it (:func:`_fill`), else read from the device (a state out of the compiled decode step)."""
    n = capacity(state)
    if not is_chunked(state):
        return n
    e = state.empty
    if e == UNCOUNTED:
        known = _COUNTS.get(id(state.next_pos))
        if known is not None and known[0]() is state.next_pos:
            return known[1]
        return int(state.next_pos[0, 0].item()) if n else 0
    if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e <= n:
        raise ValueError(f"empty={e!r} must count the state's empty rows: 0 to its {n} rows "
                         f"(or {UNCOUNTED}: left to next_pos)")
    return n - e


def held_rows(state) -> int | mx.array:
    """The stored rows attention reads, the first ones of the arrays: their count where the
    host knows it (an int), else the per-row counts ``next_pos`` (int32 ``[b, h]``, a state
    whose count is left to its arrays: attention then masks the rows past them)."""
    if is_chunked(state) and state.empty == UNCOUNTED:
        return state.next_pos
    return stored_tokens(state)


def _cut(record, n: int):
    """``record`` (codes or values) with its first ``n`` rows (views)."""
    return type(record)(*(x[:, :, :n] for x in record))


def held_codes(state) -> tuple[Any, Any]:
    """``(key_codes, value_codes)`` of the tokens the state holds (the first rows of its
    arrays: views, no copy)."""
    n = stored_tokens(state)
    if n == capacity(state):
        return state.key_codes, state.value_codes
    return _cut(state.key_codes, n), _cut(state.value_codes, n)


def uncounted(state) -> tuple:
    """``state`` with its count of empty rows left to its arrays (``empty = UNCOUNTED``):
    the same arrays, a record that stays the same from token to token (what the whole
    model's compiled decode step is traced with; its single-token step,
    ``steady_step``, writes at ``next_pos`` and trusts its caller that the token fits)."""
    return state._replace(empty=UNCOUNTED)


def dims(state) -> tuple[int, int, int, mx.Dtype]:
    """``(batch, kv_heads, head_dim, dtype)``: from the value codes and ``cache_dtype``."""
    b, h = state.next_pos.shape
    v = state.value_codes
    d = v.rows.shape[3] if isinstance(v, ExactRows) else v.codes.shape[3] * 32 // VALUE_BITS
    return b, h, d, quant.dtype_of(state.cache_dtype)


positions = quant.every_position(stored_tokens)


def _values_f32(values, d: int) -> Float[Array, "b h n d"]:
    """A value record's rows, dequantized to float32."""
    if isinstance(values, ExactRows):
        return values.rows.astype(mx.float32)
    return quant.dequantize_f32(values.codes, values.scales, values.zeros, VALUE_BITS, d)


def _split(state) -> bool:
    """Whether the state's keys are split into outlier channels and the rest."""
    return _LAYOUT[type(state)].split and bool(state.n_outlier)


def _chosen(state, keys, reference: bool):
    """The state with its outlier channels chosen from ``keys`` if it is split and holds no
    token yet (the first update that holds tokens); else the state. A state whose count is
    left to its arrays holds tokens (it went through a compiled decode step)."""
    if not _split(state) or state.empty == UNCOUNTED or stored_tokens(state):
        return state
    if reference:
        order = mx.array(split.channel_order_np(ref.to_np(keys, np.float32), state.n_outlier))
    else:
        order = split.channel_order(keys, state.n_outlier)
    return state._replace(key_channels=order)


def _in_codec_order(state, x: Float[Array, "b h n d"]) -> Float[Array, "b h n d"]:
    """Rows or queries with their channels in the key codec's order (outlier channels first)."""
    return split.gather(x, state.key_channels) if _split(state) else x


def _scores(state, q, codes):
    """The key codec's ``scores`` of float32 queries ``q [b, h, m, d]`` against ``codes``."""
    return codec_of(state).scores(state.tables, _in_codec_order(state, q), codes)


def key_scores(state, q: Float[Array, "b h m d"]) -> Float[Array, "b h m n"]:
    """The key codec's ``scores`` of float32 queries ``q`` (scaled) against the stored keys."""
    return _scores(state, q, held_codes(state)[0])


def get_kv(state) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Decoded keys (the codec's float32 decode) and dequantized values, in the model's dtype."""
    cd = quant.dtype_of(state.cache_dtype)
    kc, vc = held_codes(state)
    keys = codec_of(state).decode(state.tables, kc)
    if _split(state):
        keys = split.scatter(keys, state.key_channels)
    return keys.astype(cd), _values_f32(vc, dims(state)[2]).astype(cd)


# --- updates ------------------------------------------------------------------------

def _encode_mlx(state, keys, values):
    """``(state, key codes, value codes)`` of new rows on the ``mlx`` backend (the state with
    its outlier channels chosen, if this is its first update holding tokens)."""
    cd, d = quant.dtype_of(state.cache_dtype), keys.shape[3]
    state = _chosen(state, keys, reference=False)
    kc = codec_of(state).encode(state.tables, _in_codec_order(state, keys))
    if isinstance(state.value_codes, ExactRows):
        vc = ExactRows(values.astype(quant.side_dtype(cd)))
    else:
        vc = Int8Rows(*quant.quantize(values, VALUE_BITS, d, cd))
    return state, kc, vc


def _encode_reference(state, keys, values):
    """:func:`_encode_mlx` by the codec's NumPy twins and ``velox.reference.quantize``."""
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
    return state, kc, vc


def _write(record, new, at: mx.array):
    """``record``'s arrays with ``new``'s rows written from row ``at`` (int32 ``[1]``): one
    ``slice_update`` an array, in place when nothing else holds the array."""
    return type(record)(*(mx.slice_update(x, y, at, (2,)) for x, y in zip(record, new)))


def _grown(record, new, n: int, rows: int):
    """``record``'s first ``n`` rows, then ``new``'s, then empty rows (zeros) up to ``rows``:
    one copy an array."""
    out = []
    for x, y in zip(record, new):
        parts = ([x[:, :, :n]] if n else []) + [y]
        pad = rows - n - y.shape[2]
        if pad:
            parts.append(mx.zeros((*y.shape[:2], pad, *y.shape[3:]), y.dtype))
        out.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
    return type(record)(*out)


def _store(state, kc, vc):
    """``state`` holding the ``s`` new tokens' codes after its own: written in place while
    they fit its empty rows, else with the arrays grown to fit, rounded up to :data:`CHUNK`
    (a composition's layout: appended)."""
    s = vc[0].shape[2]
    next_pos = state.next_pos + s
    if not is_chunked(state):
        return state._replace(key_codes=append(state.key_codes, kc),
                              value_codes=append(state.value_codes, vc), next_pos=next_pos)
    n, rows = stored_tokens(state), capacity(state)
    if n + s <= rows:
        at = state.next_pos.reshape(-1)[:1]
        return state._replace(key_codes=_write(state.key_codes, kc, at),
                              value_codes=_write(state.value_codes, vc, at),
                              next_pos=next_pos, empty=rows - n - s)
    grown = -(-(n + s) // CHUNK) * CHUNK
    return state._replace(key_codes=_grown(state.key_codes, kc, n, grown),
                          value_codes=_grown(state.value_codes, vc, n, grown),
                          next_pos=next_pos, empty=grown - n - s)


def _update_mlx(state, keys, values, queries):
    return _store(*_encode_mlx(state, keys, values))


def _update_reference(state, keys, values, queries):
    return _store(*_encode_reference(state, keys, values))


# --- attention ------------------------------------------------------------------------

def attend(state, queries: Float[Array, "b q s d"], keys: Float[Array, "b h s d"],
           values: Float[Array, "b h s d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention of ``queries`` over the stored tokens (logits from the key codes, the codec's
    ``scores``) followed by ``s`` new tokens (exact logits; ``mask="causal"``: query ``i`` sees
    the new tokens up to ``i``)."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise ValueError("attend takes mask=None or 'causal'")
    return _attend(state, held_rows(state), queries, keys, values, scale, mask)


def _attend(state, held, queries, keys, values, scale: float, mask):
    """:func:`attend` over the first ``held`` rows of the state's arrays: an int (the rows
    are cut to them, views), or int32 ``[b, h]`` counts (every row is scored and those past
    the count masked out: the count is data)."""
    b, hq, s, d = queries.shape
    if s == 1 and codec_kernel.supports(state, queries):  # a decode step on a CUDA device
        return codec_kernel.decode_attend(state, queries, keys, values, scale=scale, held=held)
    kc, vc = state.key_codes, state.value_codes
    if isinstance(held, int) and held != capacity(state):
        kc, vc = _cut(kc, held), _cut(vc, held)
    if s > 1 and isinstance(held, int) and held:
        return _chunk_attend(state, kc, vc, queries, keys, values, scale, mask)
    h = keys.shape[1]
    g = hq // h
    q = (queries.astype(mx.float32) * scale).reshape(b, h, g * s, d)
    kn, vn = keys.astype(mx.float32), values.astype(mx.float32)
    vs = _values_f32(vc, d)
    n = vs.shape[2]
    past = None if isinstance(held, int) else mx.arange(n)[None, None, None, :] >= held[:, :, None, None]
    outs = []
    for lo in range(0, g * s, QUERY_BLOCK):
        qb = q[:, :, lo:lo + QUERY_BLOCK]
        new = qb @ kn.swapaxes(-1, -2)
        if mask is not None and s > 1:
            row = (mx.arange(lo, lo + qb.shape[2]) % s)[:, None]
            new = mx.where(mx.arange(s)[None, :] <= row, new, mx.array(-mx.inf, mx.float32))
        if n:
            stored = _scores(state, qb, kc)
            if past is not None:  # rows past the held ones: empty, or this step's own
                stored = mx.where(past, mx.array(-mx.inf, mx.float32), stored)
            p = softmax(mx.concatenate([stored, new], axis=-1), axis=-1)
            outs.append(p[..., :n] @ vs + p[..., n:] @ vn)
        else:
            outs.append(softmax(new, axis=-1) @ vn)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.reshape(b, hq, s, d).astype(queries.dtype)


def _chunk_attend(state, kc, vc, queries, keys, values, scale: float, mask):
    """A chunk's attention (a prefill): the stored keys decoded once (the codec's ``decode``;
    every codec's ``scores`` is the inner product of the query with its decoded key, so the
    logits are the same to float32 rounding) and the values dequantized once, then MLX's fused
    attention over them and the chunk's rows (bottom-right causal: each query sees every
    stored token and the new ones up to its own). The decoded rows are in the model's dtype
    where it is a half-precision one (as a full cache holds its rows; MLX's fused prefill
    attention on a GPU takes half precision only, and in float32 falls back to materialising
    the ``[queries, stored]`` logits), else in float32. What it holds beyond the chunk's: one
    copy of the stored rows, as a full cache holds them."""
    d = queries.shape[-1]
    dt = queries.dtype if queries.dtype in (mx.float16, mx.bfloat16) else mx.float32
    stored = codec_of(state).decode(state.tables, kc)
    if _split(state):
        stored = split.scatter(stored, state.key_channels)
    k = mx.concatenate([stored.astype(dt), keys.astype(dt)], axis=2)
    v = mx.concatenate([_values_f32(vc, d).astype(dt), values.astype(dt)], axis=2)
    out = mx.fast.scaled_dot_product_attention(queries.astype(dt), k, v, scale=scale,
                                               mask=None if mask is None else "causal")
    return out.astype(queries.dtype)


def _attend_update(state, queries, keys, values, *, scale: float, mask=None):
    """``(attend(state, ...), update(state, ...))`` of one step: the new rows written first,
    then the attention over the written arrays' rows before them (the arrays are read after
    the write only: MLX writes in place). The same output and state, to the bit."""
    held = stored_tokens(state)
    encode = _encode_reference if state.backend == "reference" else _encode_mlx
    new = _store(*encode(state, keys, values))
    return _attend(new, held, queries, keys, values, scale, mask), new


def _steady_step(state, queries, keys, values, scale: float):
    """A single-token decode step, ``(out, state)`` (``velox.decode.split_step``): the row
    written at ``next_pos`` in place, then the attention over the written arrays. A state
    whose count is left to its arrays (the compiled decode step's record: :func:`uncounted`)
    is trusted to have room for the token (the adapter checks it on the host from its offset;
    the write index is clamped to the arrays), and stays so; any other takes
    :func:`_attend_update` (grown when full)."""
    if state.empty != UNCOUNTED:
        return _attend_update(state, queries, keys, values, scale=scale)
    held = state.next_pos
    state, kc, vc = _encode_mlx(state, keys, values)
    at = mx.minimum(held.reshape(-1)[:1], capacity(state) - 1)
    new = state._replace(key_codes=_write(state.key_codes, kc, at),
                         value_codes=_write(state.value_codes, vc, at), next_pos=held + 1)
    return _attend(new, held, queries, keys, values, scale, None), new


def _fill(state, keys, values):
    """The adapter's single-token step into an empty row (``velox.evict``'s ``fill``
    protocol): the update, in place while the token fits (grown otherwise), its count left to
    its arrays as the compiled decode step leaves it (so that a cache holds the same record
    whichever way its steps ran), and remembered on the host (no device read at the next)."""
    new = _update_mlx(state, keys, values, None)
    return _uncounted_with(new, stored_tokens(new))


def _fill_attention(state, new, queries, keys, values, scale: float):
    """The attention of a :func:`_fill` step: over ``new``'s arrays (written), the token's
    row cut off from the stored ones."""
    return _attend(new, stored_tokens(new) - keys.shape[2], queries, keys, values, scale, None)


# the mlx backend: its single-token steps written in place (fill, steady_step)
_MLX = Backend(_update_mlx, steady_step=_steady_step, fill=_fill, fill_attention=_fill_attention)


def register_method(key: str, state: type, init: Callable, **hooks: Any) -> Method:
    """Register a codec-cache method: both backends, ``get_kv``, ``positions``, ``dims``,
    ``attend`` and ``attend_update`` of this module (``hooks`` add or replace any of them),
    and the ``capacity`` and ``uncounted`` of its chunked storage (``velox.decode``)."""
    kw = dict(get_kv=get_kv, positions=positions, dims=dims, attend=attend,
              attend_update=_attend_update, capacity=capacity, uncounted=uncounted)
    kw.update(hooks)
    return register(key, state, init, {"reference": _update_reference, "mlx": _MLX},
                    **kw)
