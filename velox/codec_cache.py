"""Caches whose keys are held by a codec and whose values by a value codec.

One builder for every method of this shape (TurboQuant, PolarQuant, QJL, SpectralQuant): the
method module names its codec (``velox.codecs``), its parameters (its ``init`` signature) and
how its values are held; this module writes the state record, the update of both backends,
``get_kv``, ``positions``, ``dims`` and the attention on the codes.

State (:func:`state_type`): ``key_codes`` (the codec's codes record, nested, every array with
leading ``[b, h, n]`` axes), ``value_codes`` (the value codec's record, below), ``tables`` (the
codec's static tables record, nested; its bytes count in the state's), ``value_tables`` (the
value codec's), ``key_channels`` (methods with outlier channels only, below), ``next_pos``,
``empty``, then every parameter of ``init`` as a static field, ``cache_dtype`` and
``backend``. Every token is kept, in order.

Values (``init``'s ``value_codec`` and ``value_bits``; keys and values take separate budgets):

* ``"affine"`` (the default of every method but ``turboquant_rvq``, at ``value_bits = 8``):
  :class:`Int8Rows`, per-token affine codes at ``value_bits``, one group a row, scales and
  zeros in ``velox.quant.side_dtype`` (float16 for float16 and float32 caches), each row's
  codes zero-padded to the pack unit (``velox.codecs.turboquant.padded_dim``: none at 8 bits
  with ``head_dim % 4 == 0``); ``value_tables`` is :class:`NoTables`.
* ``"mse"``: TurboQuant_mse's codec (``velox.codecs.turboquant``) on the values, ``MseCodes``
  (the Lloyd-Max index of each rotated coordinate at ``value_bits``, packed, and the float16
  norm); ``value_tables`` is its ``TurboQuantTables``, the rotation drawn from ``seed +``
  :data:`VALUE_SEED_OFFSET` (no key-side draw shares it). Attention takes the weighted sum of
  the stored values in the rotated domain, ``sum_j w_j * norm_j / sqrt(d) * c[idx_j]``, and
  rotates it back once (``velox.codecs.turboquant.mse_weighted``); the rows are decoded only
  by ``get_kv`` and a chunk's attention (as the keys are).
* ``"exact"`` (``turboquant_rvq``'s default): :class:`ExactRows`, the rows in float16
  (bfloat16 for a bfloat16 cache); ``value_bits`` is not read.

The defaults are the layouts from before the parameters: the CUDA kernels (below) read 8-bit
affine or exact values and decline the others. A composition (below) has neither parameter:
8-bit affine values.

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

Backends: ``mlx`` encodes with the codec's MLX functions and codes values with
``velox.quant`` (affine) or the mse codec's MLX functions; ``reference`` runs the codecs'
NumPy twins and ``velox.reference``'s affine codes on the same inputs, giving the same codes,
stored the same way (mse codes, keys' or values', up to a coordinate within float32 rounding
of a cell boundary).

Attention (:func:`attend`): a decode step's logits over the stored tokens are the codec's
``scores`` of the scaled queries against the key codes (:func:`key_scores`, never decoding the
keys); the ``s`` new tokens' logits are exact; one softmax; the weights multiply the stored
values read from their codes (affine: dequantized; mse: summed in the rotated domain) and the
new values. A chunk of several tokens (a prefill) decodes
the stored keys once instead (every codec's ``scores`` is the query's inner product with its
decoded key, so the logits are the same to float32 rounding:
``tests/test_codec_prefill.py``) and runs MLX's fused attention over them and the chunk's
rows: scoring the codes per block of queries decoded the stored codes again for every block
of :data:`QUERY_BLOCK` query rows and held a block's logits, which made a TurboQuant prefill
slower than the full cache's and several times its peak memory (on this project's CPU, 8,192
stored tokens and a 1,024-token chunk: TurboQuant prod 148 s and 3,150 MiB against 15 s and
1,298 MiB decoded, the full cache's attention 18 s and 1,177 MiB). A decode step (one query token) on a CUDA device
runs the fused kernels of ``velox.kernels.codec`` where they take the state (TurboQuant mse,
rvq and prod, QJL, with 8-bit affine or exact values: ``supports``), reading the held rows of the arrays in place, with the same
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
from typing import Any, NamedTuple, Union

import mlx.core as mx
import numpy as np

from . import quant
from . import reference as ref
from ._typing import Array, Float, Int, UInt
from .attention import softmax
from .backend import Backend
from .codecs import Codec, append, get_codec, numpy_tables, split
from .codecs import turboquant as tq
from .kernels import codec as codec_kernel
from .registry import Method, register
from .spec import param_fields

__all__ = ["Int8Rows", "ExactRows", "NoTables", "ValueCodes", "ValueTables",
           "VALUE_BITS", "VALUE_CODECS", "VALUE_SEED_OFFSET", "QUERY_BLOCK", "CHUNK", "UNCOUNTED",
           "state_type", "empty", "register_method", "codec_of", "codec_params", "get_kv",
           "positions", "dims", "attend", "stored_tokens", "capacity", "held_codes", "held_rows",
           "key_scores", "uncounted", "is_chunked", "value_codec", "value_bits", "value_tables"]

#: Bits of the per-token affine value codes by default (``value_bits``'s default; a
#: composition's values, which take no ``value_bits``).
VALUE_BITS = 8
#: The value codecs (``value_codec``): per-token affine codes, TurboQuant_mse codes, exact rows.
VALUE_CODECS = ("affine", "mse", "exact")
#: The values' rotation (``value_codec="mse"``) is drawn from the method's ``seed`` plus this:
#: the key side draws from ``seed`` to ``seed + 3`` (rotation, TurboQuant_prod's sketch, the
#: outlier part's rotation and sketch: ``velox.codecs.split``), so no draw is shared.
VALUE_SEED_OFFSET = 4
#: Query rows (per kv head) scored at once by :func:`attend`.
QUERY_BLOCK = 256
#: Rows the code arrays grow by (mlx-lm's ``KVCache`` grows by 256 too).
CHUNK = 256
#: ``empty`` of a state whose count of empty rows is left to its arrays: ``next_pos`` holds
#: its tokens (:func:`uncounted`).
UNCOUNTED = -1


class Int8Rows(NamedTuple):
    """Values as per-token affine codes: one group per row (``velox.quant`` layout), at the
    state's ``value_bits`` (8 by default, whence the name), packed to a ``uint32`` stream whose
    row is zero-padded to the pack unit (``velox.codecs.turboquant.padded_dim``)."""

    codes: UInt[Array, "b h n w"]
    scales: Float[Array, "b h n 1"]
    zeros: Float[Array, "b h n 1"]


class ExactRows(NamedTuple):
    """Values held exact, in float16 (bfloat16 for a bfloat16 cache: ``velox.quant.side_dtype``),
    as the seed holds them and as the other quantizers hold their exact rows by default."""

    rows: Float[Array, "b h n d"]


class NoTables(NamedTuple):
    """The tables of a value codec that needs none (affine codes, exact rows): no field, no
    array, no byte."""


#: What a state's ``value_codes`` holds: affine codes, TurboQuant_mse codes (``MseCodes``: the
#: packed Lloyd-Max indices of the rotated row and its float16 norm) or exact rows.
ValueCodes = Union[Int8Rows, tq.MseCodes, ExactRows]
#: What a state's ``value_tables`` holds: nothing, or the mse codec's rotation and codebook.
ValueTables = Union[NoTables, tq.TurboQuantTables]


class _Layout(NamedTuple):
    codec: str
    values: str             # the value codec of a state without value_codec (a composition's)
    rename: dict
    split: bool = False     # n_outlier / outlier_bits parameters: the channel split
    chunked: bool = False   # rows in chunks, the last `empty` of them empty (state_type's)
    value_rename: dict = {}  # values held by a registered codec: its parameter -> init's
    prepare: Callable | None = None  # prepare(state, keys, values) -> state before rows are encoded


_LAYOUT: dict[type, _Layout] = {}


def state_type(name: str, init: Callable, doc: str, *, codec: str, codes: type, tables: type,
               values: str = "affine", rename: dict[str, str] | None = None,
               split: bool = False, value_types: tuple[type, type] | None = None,
               value_rename: dict[str, str] | None = None,
               prepare: Callable | None = None) -> type:
    """The state record of a codec cache, from its ``init``: ``key_codes`` (a ``codes``
    record), ``value_codes`` (:data:`ValueCodes`), ``tables`` (a ``tables`` record),
    ``value_tables`` (:data:`ValueTables`; an ``init`` with ``value_codec`` only),
    ``key_channels`` (``split`` only), ``next_pos``, ``empty`` (the arrays' empty rows, the
    last ones), every parameter of ``init``'s signature as a static field (its annotation),
    ``cache_dtype``, ``backend``.

    ``codec`` names the key codec; ``rename`` maps a codec parameter name to the method's
    parameter of another name (default: the same names). ``split``: ``init`` has ``n_outlier``
    and ``outlier_bits`` and the keys' channels split in two (module doc); ``codes`` and
    ``tables`` are then those of ``n_outlier = 0``. The value codec is ``init``'s
    ``value_codec`` parameter (with ``value_bits``), or ``values`` (``"affine"``: 8-bit, or
    ``"exact"``) for an ``init`` without them, or the name of a registered codec (``values``
    then names the codec, ``value_types`` its ``(codes, tables)`` records and ``value_rename``
    maps each of its parameters to ``init``'s: the values are that codec's codes, its tables
    in ``value_tables``, decoded for attention). ``prepare(state, keys, values) -> state``, given,
    runs before any rows are encoded, on both backends and every path (update, fill, the steady
    and compiled step): it may raise to refuse a state (VecInfer without calibrated tables)
    or return it with tables fitted to the first rows (KVTC's prefill basis, VecInfer's prefill
    codebooks).
    """
    own = values not in ("affine", "exact")
    if own and value_types is None:
        raise ValueError("values (the value codec of an init without value_codec) is 'affine', "
                         "'exact', or a registered codec with value_types=(codes, tables)")
    names = {n for n, _ in param_fields(init)}
    if split and not {"n_outlier", "outlier_bits"} <= names:
        raise ValueError("a split codec cache's init has the parameters n_outlier and outlier_bits")
    chosen = {"value_codec", "value_bits"} & names
    if chosen and len(chosen) != 2:
        raise ValueError("a codec cache's init has both value_codec and value_bits, or neither")
    fields = [("key_codes", codes), ("value_codes", value_types[0] if own else ValueCodes),
              ("tables", tables),
              *([("value_tables", value_types[1] if own else ValueTables)] if chosen or own else []),
              *([("key_channels", Int[Array, "b h c"])] if split else []),
              ("next_pos", Int[Array, "b h"]), ("empty", int)]
    record = NamedTuple(name, [*fields, *param_fields(init), ("cache_dtype", str), ("backend", str)])
    record.__doc__ = doc
    record.__module__ = init.__module__
    _LAYOUT[record] = _Layout(codec, values, dict(rename or {}), split, chunked=True,
                              value_rename=dict(value_rename or {}), prepare=prepare)
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
    kind = args.get("value_codec", lay.values)
    bits = args.get("value_bits", VALUE_BITS)
    if kind in VALUE_CODECS:
        _check_values(kind, bits)
        vt = _value_tables(kind, bits, d, args.get("seed", tq.DEFAULT_SEED))
    else:  # a registered codec holds the values
        vt = get_codec(kind).tables(d, {n: args[m] for n, m in lay.value_rename.items()})
    # the value record of no token: one encoded zero row, cut to length 0
    zero = _encode_values_mlx(kind, bits, vt, mx.zeros((b, h, 1, d), dtype), dtype)
    value_codes = type(zero)(*(x[:, :, :0] for x in zero))
    given = dict(key_codes=key_codes, value_codes=value_codes, tables=tables, value_tables=vt,
                 next_pos=mx.zeros((b, h), mx.int32), empty=0, cache_dtype=quant.dtype_name(dtype))
    if lay.split:  # the identity until the first tokens choose the outlier channels
        c = d if args["n_outlier"] else 0
        given["key_channels"] = mx.zeros((b, h, c), mx.int32) + mx.arange(c, dtype=mx.int32)
    return state_type(**{f: given[f] if f in given else args[f] for f in state_type._fields})


def _prepared(state, keys, values):
    """The layout's ``prepare`` of a state about to encode ``keys`` and ``values`` (none: the
    state)."""
    prepare = _LAYOUT[type(state)].prepare
    return state if prepare is None else prepare(state, keys, values)


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
    """``(batch, kv_heads, head_dim, dtype)``: from the value record (affine codes: their
    width, less the padding, read from the key tables' ``head_dim``) and ``cache_dtype``."""
    b, h = state.next_pos.shape
    return b, h, _head_dim(state), quant.dtype_of(state.cache_dtype)


def _head_dim(state) -> int:
    v = state.value_codes
    if isinstance(v, ExactRows):
        return v.rows.shape[3]
    if isinstance(v, tq.MseCodes) or value_codec(state) not in VALUE_CODECS:
        return state.value_tables.head_dim
    # affine codes, whose rows may be padded to the pack unit: the key tables' head_dim (every
    # key codec's tables record has one, but QJL's, whose sketch is [m, d])
    t = state.tables
    if hasattr(t, "head_dim"):
        return int(t.head_dim)
    if hasattr(t, "sketch"):
        return int(t.sketch.shape[-1])
    return v.codes.shape[3] * 32 // value_bits(state)


positions = quant.every_position(stored_tokens)


# --- the value codec ------------------------------------------------------------------

def value_codec(state) -> str:
    """The state's value codec (``value_codec``; a composition's: its layout's, ``"affine"``)."""
    return getattr(state, "value_codec", _LAYOUT[type(state)].values)


def value_bits(state) -> int:
    """The bits of the state's value codes (``value_bits``; a composition's: :data:`VALUE_BITS`);
    not read by exact values."""
    return getattr(state, "value_bits", VALUE_BITS)


def value_tables(state) -> tuple:
    """The value codec's tables (``value_tables``; :class:`NoTables` where it needs none)."""
    return getattr(state, "value_tables", NoTables())


def _check_values(kind: str, bits: int) -> None:
    if kind not in VALUE_CODECS:
        raise ValueError(f"value_codec={kind!r} is not one of {', '.join(map(repr, VALUE_CODECS))}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"value_bits={bits!r} must be an integer in 1..8")


def _value_tables(kind: str, bits: int, d: int, seed: int) -> tuple:
    """The value codec's tables: the mse codec's at ``value_bits``, its rotation drawn from
    ``seed + VALUE_SEED_OFFSET``; else none."""
    if kind == "mse":
        return tq.mse_tables(d, bits, int(seed) + VALUE_SEED_OFFSET)
    return NoTables()


def _encode_values_mlx(kind: str, bits: int, vt, values, cd: mx.Dtype):
    """The value record of ``values [b, h, s, d]`` (MLX)."""
    if kind not in VALUE_CODECS:
        return get_codec(kind).encode(vt, values)
    if kind == "exact":
        return ExactRows(values.astype(quant.side_dtype(cd)))
    if kind == "mse":
        return tq.mse_encode(vt, values)
    d = values.shape[3]
    padded = tq.padded_dim(d, bits)
    if padded == d:
        return Int8Rows(*quant.quantize(values, bits, d, cd))
    q, sc, z = quant.affine_codes(values.astype(mx.float32), bits, quant.side_dtype(cd))
    q = mx.concatenate([q, mx.zeros((*q.shape[:-1], padded - d), mx.uint32)], axis=-1)
    return Int8Rows(quant.pack(q, bits), sc[..., None], z[..., None])


def _encode_values_np(kind: str, bits: int, vt, values, cd: mx.Dtype):
    """:func:`_encode_values_mlx` by the NumPy twins (``velox.reference``, the mse codec's
    ``mse_encode_np``), the same codes stored the same way."""
    if kind == "exact":
        return ExactRows(values.astype(quant.side_dtype(cd)))
    x = ref.to_np(values, np.float32)
    if kind not in VALUE_CODECS:
        c = get_codec(kind).encode_np(numpy_tables(vt), x)
        return type(c)(*(mx.array(np.ascontiguousarray(a)) for a in c))
    if kind == "mse":
        c = tq.mse_encode_np(numpy_tables(vt), x)
        return tq.MseCodes(mx.array(np.ascontiguousarray(c.idx)).astype(mx.uint32),
                           mx.array(np.ascontiguousarray(c.norm)).astype(mx.float16))
    sd = quant.side_dtype(cd)
    d = x.shape[3]
    padded = tq.padded_dim(d, bits)
    if padded == d:
        c, sc, z = ref.quantize(x, bits, d, sd)
        return Int8Rows(mx.array(c), ref.to_mx(sc, sd), ref.to_mx(z, sd))
    rows = x.reshape(-1, d)
    q = np.zeros((rows.shape[0], padded), np.uint32)
    sc = np.zeros((rows.shape[0], 1), np.float32)
    z = np.zeros((rows.shape[0], 1), np.float32)
    for r in range(rows.shape[0]):
        q[r, :d], sc[r, 0], z[r, 0] = ref.quantize_group(rows[r], bits, sd)
    lead = x.shape[:-1]
    c = ref.pack_codes(q, bits).reshape(*lead, -1) if q.size else np.zeros((*lead, padded * bits // 32), np.uint32)
    return Int8Rows(mx.array(c), ref.to_mx(sc.reshape(*lead, 1), sd), ref.to_mx(z.reshape(*lead, 1), sd))


def _values_f32(state, values) -> Float[Array, "b h n d"]:
    """A value record's rows, decoded to float32 (every row: a dense decode)."""
    if value_codec(state) not in VALUE_CODECS:
        return get_codec(value_codec(state)).decode(value_tables(state), values)
    if isinstance(values, ExactRows):
        return values.rows.astype(mx.float32)
    if isinstance(values, tq.MseCodes):
        return tq.mse_decode(value_tables(state), values)
    d = _head_dim(state)  # (count: the padding of a row's codes dropped, where it has any)
    return quant.dequantize_f32(values.codes, values.scales, values.zeros, value_bits(state), d,
                                count=d)


def _value_reader(state, values) -> Callable[[mx.array], mx.array]:
    """``w -> w @ rows`` for weights ``w [b, h, m, n]`` (float32) over a value record's ``n``
    rows: mse codes summed in the rotated domain and rotated back once
    (``velox.codecs.turboquant.mse_weighted``), never decoded row by row; affine codes and
    exact rows dequantized once (one float32 copy, as the weights' product needs)."""
    if isinstance(values, tq.MseCodes):
        t = value_tables(state)
        return lambda w: tq.mse_weighted(t, w, values)
    rows = _values_f32(state, values)
    return lambda w: w @ rows


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
    return keys.astype(cd), _values_f32(state, vc).astype(cd)


# --- updates ------------------------------------------------------------------------

def _encode_mlx(state, keys, values):
    """``(state, key codes, value codes)`` of new rows on the ``mlx`` backend (the state with
    its outlier channels chosen, if this is its first update holding tokens)."""
    cd = quant.dtype_of(state.cache_dtype)
    state = _prepared(state, keys, values)
    state = _chosen(state, keys, reference=False)
    kc = codec_of(state).encode(state.tables, _in_codec_order(state, keys))
    vc = _encode_values_mlx(value_codec(state), value_bits(state), value_tables(state), values, cd)
    return state, kc, vc


def _encode_reference(state, keys, values):
    """:func:`_encode_mlx` by the codec's NumPy twins and ``velox.reference.quantize``."""
    cd = quant.dtype_of(state.cache_dtype)
    state = _prepared(state, keys, values)
    state = _chosen(state, keys, reference=True)
    codec = codec_of(state)
    rows = ref.to_np(keys, np.float32)
    if _split(state):
        rows = split.gather_np(rows, np.array(state.key_channels))
    codes = codec.encode_np(numpy_tables(state.tables), rows)
    # each field in the dtype of the MLX codes (the state's empty record says it)
    kc = type(codes)(*(mx.array(np.ascontiguousarray(x)).astype(e.dtype)
                       for x, e in zip(codes, state.key_codes)))
    vc = _encode_values_np(value_codec(state), value_bits(state), value_tables(state), values, cd)
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

def attend(state, queries: Float[Array, "b q s d"], keys: Float[Array, "b h t d"],
           values: Float[Array, "b h t d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention of ``queries`` over the stored tokens (logits from the key codes, the codec's
    ``scores``) followed by ``t`` new tokens (exact logits; ``mask="causal"``: ``t = s`` and
    query ``i`` sees the new tokens up to ``i``; ``mask=None``: every query sees every new
    token, e.g. one query after a decode tail's rows)."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise ValueError("attend takes mask=None or 'causal'")
    if mask is not None and keys.shape[2] != queries.shape[2]:
        raise ValueError(f"a causal attend takes one new row per query, got {keys.shape[2]} "
                         f"rows for {queries.shape[2]} queries")
    return _attend(state, held_rows(state), queries, keys, values, scale, mask)


def _attend(state, held, queries, keys, values, scale: float, mask):
    """:func:`attend` over the first ``held`` rows of the state's arrays: an int (the rows
    are cut to them, views), or int32 ``[b, h]`` counts (every row is scored and those past
    the count masked out: the count is data)."""
    b, hq, s, d = queries.shape
    if s == 1 == keys.shape[2] and codec_kernel.supports(state, queries):  # a CUDA decode step
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
    weigh = _value_reader(state, vc)  # w -> w @ stored values, read from their codes
    n = vc[0].shape[2]
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
            outs.append(weigh(p[..., :n]) + p[..., n:] @ vn)
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
    dt = queries.dtype if queries.dtype in (mx.float16, mx.bfloat16) else mx.float32
    stored = codec_of(state).decode(state.tables, kc)
    if _split(state):
        stored = split.scatter(stored, state.key_channels)
    k = mx.concatenate([stored.astype(dt), keys.astype(dt)], axis=2)
    v = mx.concatenate([_values_f32(state, vc).astype(dt), values.astype(dt)], axis=2)
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
