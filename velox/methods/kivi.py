"""KIVI: asymmetric 2/4-bit cache, keys per channel and values per token, newest tokens exact.

Storage: after ``T`` tokens, the oldest ``Q = group_size * floor(max(T - residual_length, 0) /
group_size)`` are quantized and the rest (``residual_length`` to ``residual_length +
group_size - 1`` tokens) stay exact. Keys are quantized per channel in groups of
``group_size`` tokens (stored transposed, ``[b, h, d, Q]``, groups along the last axis);
values per token in groups of ``group_size`` channels. Codes are packed into uint32 words in
MLX's affine layout (``velox.quant``). The quantized count depends on ``T`` only, so a prompt
absorbed in one chunk or token by token yields bit-identical states.

Scales and zeros are float16 (``velox.quant.side_dtype``) and the residual window is held
in ``residual_dtype`` (default float16, what an fp16 cache holds), whatever the model's
dtype; ``get_kv`` returns the model's dtype.

What the state holds (``contract.storage = "chunked"`` in the spec), as mlx-lm's ``KVCache``
holds its rows:

* the quantized tokens' arrays (``key_codes``, ``key_scales``, ``key_zeros`` along their last
  axis, ``value_codes``, ``value_scales``, ``value_zeros`` along their third) hold room for
  ``quantized_rows`` tokens, a multiple of :data:`CHUNK`; the first ``Q`` are the quantized
  tokens, in order, the rest empty (zeros). A flush that does not fit grows them to fit,
  rounded up to a chunk; one that fits writes its group in place.
* the residual window ``residual_keys`` / ``residual_values [b, h, rows, d]`` is a buffer of at
  most :func:`residual_capacity` rows (``residual_length + group_size - 1``, the most the
  window holds), allocated by the first update that holds tokens (``min(capacity, rows
  rounded up to a chunk)``, grown the same way when a huge ``residual_length`` needs more);
  its first ``T - Q`` rows are the window's tokens, in order. A single token that joins the
  window is written in place (``mx.slice_update`` at an array index); a flush (the window
  full: its oldest group quantized) shifts the window into a fresh buffer of the same rows.
* ``next_pos`` (every head: ``T``) and ``empty``, a static field: the empty rows of the two
  together (``quantized_rows + rows - T``), so the host knows ``T``, ``Q`` and the window's
  count without reading the device. ``empty = UNCOUNTED`` leaves the count to ``next_pos``
  (the record the whole model's compiled decode step is traced with: :func:`uncounted`).

The empty rows are never read: attention cuts them off (or masks them where the count is
data), ``get_kv``, ``positions`` and ``error_bound`` give the tokens only; ``nbytes`` counts
every row held. A fresh state holds no row. A state of the appending layout (arrays of the
tokens' rows only, ``empty = 0``: prompt-cache files written before) is a full state of this
one.
"""

from __future__ import annotations

import typing
from typing import Any, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from .. import codec_cache, quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..codec_cache import CHUNK, UNCOUNTED
from ..kernels import kivi as kivi_kernel
from ..qattention import Affine, Dense, attend_blocks, attend_segments
from ..registry import register

__all__ = ["KiviState", "State", "init", "update", "get_kv", "nbytes", "positions", "error_bound",
           "attend", "attend_update", "dims", "extended_state", "quantized_tokens", "flush_count",
           "CHUNK", "UNCOUNTED", "stored_tokens", "held_counts", "held_state", "residual_capacity",
           "quantized_rows", "residual_rows", "capacity", "steady_room", "uncounted"]


class KiviState(NamedTuple):
    """Packed key/value codes with their scales and zeros (room for ``quantized_rows``
    tokens), the exact residual window's buffer, the tokens seen and the arrays' empty rows."""

    key_codes: UInt[Array, "b h d kw"]
    key_scales: Float[Array, "b h d kg"]
    key_zeros: Float[Array, "b h d kg"]
    value_codes: UInt[Array, "b h nq vw"]
    value_scales: Float[Array, "b h nq vg"]
    value_zeros: Float[Array, "b h nq vg"]
    residual_keys: Float[Array, "b h r d"]
    residual_values: Float[Array, "b h r d"]
    next_pos: Int[Array, "b h"]
    empty: int
    bits: int
    group_size: int
    residual_length: int
    residual_dtype: str
    cache_dtype: str
    backend: str


def extended_state(name: str, doc: str, arrays: Sequence[tuple[str, Any]],
                   params: Sequence[tuple[str, Any]], module: str) -> type:
    """The state record of a method that holds a KIVI cache and more: KIVI's fields, written
    once here, with the method's own ``(name, annotation)`` pairs in place.

    Layout: KIVI's arrays (codes, scales, zeros, residual window), then ``arrays``, then
    ``next_pos``, ``empty`` and KIVI's settings, then ``params``, ``backend`` last. The KIVI
    state within is ``KiviState(*(getattr(state, f) for f in KiviState._fields))``.
    """
    hints = typing.get_type_hints(KiviState)
    own = [(f, hints[f]) for f in KiviState._fields]
    i, j = KiviState._fields.index("next_pos"), KiviState._fields.index("backend")
    record = NamedTuple(name, own[:i] + list(arrays) + own[i:j] + list(params) + own[j:])
    record.__doc__, record.__module__ = doc, module
    return record


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, group_size: int = 32, residual_length: int = 128,
         residual_dtype: str = "float16", backend: str = "auto") -> KiviState:
    """Empty KIVI state (no row held).

    Args:
        bits: bits per quantized element.
        group_size: tokens per key group (per channel) and channels per value group (per
            token).
        residual_length: newest tokens kept exact (between this and this + group_size - 1).
        residual_dtype: dtype of the rows held exact ("model": the cache dtype); scales and
            zeros are float16 (bfloat16 for a bfloat16 cache).
    """
    b, h, d = batch, kv_heads, head_dim
    vw, vg = d * bits // 32, d // group_size
    sd, rd = quant.side_dtype(dtype), quant.exact_dtype(residual_dtype, dtype)
    return KiviState(
        key_codes=mx.zeros((b, h, d, 0), mx.uint32), key_scales=mx.zeros((b, h, d, 0), sd),
        key_zeros=mx.zeros((b, h, d, 0), sd), value_codes=mx.zeros((b, h, 0, vw), mx.uint32),
        value_scales=mx.zeros((b, h, 0, vg), sd), value_zeros=mx.zeros((b, h, 0, vg), sd),
        residual_keys=mx.zeros((b, h, 0, d), rd), residual_values=mx.zeros((b, h, 0, d), rd),
        next_pos=mx.zeros((b, h), mx.int32), empty=0, bits=bits, group_size=group_size,
        residual_length=residual_length, residual_dtype=residual_dtype,
        cache_dtype=quant.dtype_name(dtype), backend=backend)


# --- the rows a state holds ------------------------------------------------------------

def residual_capacity(state) -> int:
    """Most tokens the residual window holds after an update (``residual_length + group_size
    - 1``): the rows its buffer grows to at most."""
    return state.residual_length + state.group_size - 1


def quantized_rows(state) -> int:
    """Tokens the quantized arrays have room for (held and empty)."""
    return state.value_codes.shape[2]


def residual_rows(state) -> int:
    """Rows of the residual window's buffer (held and empty)."""
    return state.residual_keys.shape[2]


def capacity(state) -> int:
    """Rows the state's arrays hold, tokens and empty ones: the quantized arrays' and the
    residual buffer's."""
    return quantized_rows(state) + residual_rows(state)


def _split(state, t: int) -> tuple[int, int]:
    """``(quantized, window)`` tokens of a state of ``t`` tokens."""
    g = state.group_size
    q = g * (max(t - state.residual_length, 0) // g)
    return q, t - q


def stored_tokens(state) -> int:
    """Tokens the state holds: its rows less its empty ones (read on the host from the
    arrays' shapes and ``empty``); ``next_pos``, read from the device, for a state whose count
    is left to it (``empty = UNCOUNTED``: out of the compiled decode step)."""
    n, e = capacity(state), state.empty
    if e == UNCOUNTED:
        known = codec_cache._COUNTS.get(id(state.next_pos))  # (made by the host: _fill)
        if known is not None and known[0]() is state.next_pos:
            return known[1]
        return int(state.next_pos.reshape(-1)[0].item()) if state.next_pos.size else 0
    if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e <= n:
        raise ValueError(f"empty={e!r} must count the state's empty rows: 0 to its {n} rows "
                         f"(or {UNCOUNTED}: left to next_pos)")
    return n - e


def held_counts(state) -> tuple[int, int]:
    """``(quantized tokens, window tokens)`` the state holds: the first rows of its quantized
    arrays and of its residual buffer."""
    q, r = _split(state, stored_tokens(state))
    if q > quantized_rows(state) or r > residual_rows(state):
        raise ValueError(f"a state of {q + r} tokens holds {q} quantized and {r} in its window, "
                         f"but its arrays have room for {quantized_rows(state)} and "
                         f"{residual_rows(state)}")
    return q, r


def quantized_tokens(state) -> int:
    """Number of tokens held in quantized form."""
    return held_counts(state)[0]


def _cut_quantized(state, q: int) -> dict:
    """The quantized arrays of ``state`` cut to their first ``q`` tokens (views)."""
    if q == quantized_rows(state):
        return {}
    w, g = q * state.bits // 32, q // state.group_size
    return dict(key_codes=state.key_codes[..., :w], key_scales=state.key_scales[..., :g],
                key_zeros=state.key_zeros[..., :g], value_codes=state.value_codes[:, :, :q],
                value_scales=state.value_scales[:, :, :q], value_zeros=state.value_zeros[:, :, :q])


def _cut_residual(state, r: int) -> dict:
    if r == residual_rows(state):
        return {}
    return dict(residual_keys=state.residual_keys[:, :, :r],
                residual_values=state.residual_values[:, :, :r])


def held_state(state):
    """``state`` with its arrays cut to the tokens it holds (views) and no empty row: the
    appending layout, what the kernels and a method built on KIVI's arrays read."""
    q, r = held_counts(state)
    return state._replace(**_cut_quantized(state, q), **_cut_residual(state, r), empty=0)


def uncounted(state):
    """``state`` with its count of empty rows left to ``next_pos`` (``empty = UNCOUNTED``):
    the same arrays, a record that stays the same from token to token, what the whole
    model's compiled decode step is traced with (its single-token step, :func:`_steady_step`,
    trusts its caller that the token joins the window without a flush)."""
    return state._replace(empty=UNCOUNTED)


def steady_room(state, held: int) -> int:
    """Single-token steps a state of ``held`` tokens (the caller's count: nothing is read from
    the device) takes before one that flushes a group or grows the residual buffer: each of
    them writes its token into the window's next empty row, every shape kept."""
    return residual_rows(state) - _split(state, held)[1]


def flush_count(state: KiviState, s: int) -> int:
    """Tokens that leave the residual window when ``s`` more arrive (a multiple of the group)."""
    t = stored_tokens(state)
    return _split(state, t + s)[0] - _split(state, t)[0]


# --- updates -------------------------------------------------------------------------

def _rounded(n: int) -> int:
    return -(-n // CHUNK) * CHUNK


def _put(x, new, at: int, axis: int, rows: int):
    """``x`` with ``new`` written from index ``at`` along ``axis``: in place
    (``mx.slice_update``) when ``x`` has ``rows`` along it, else a copy of its first ``at``,
    ``new``, and zeros up to ``rows``."""
    if x.shape[axis] == rows:
        return mx.slice_update(x, new, mx.array([at], mx.int32), (axis,))
    parts = [x[(slice(None),) * axis + (slice(0, at),)]] if at else []
    parts.append(new)
    pad = rows - at - new.shape[axis]
    if pad:
        shape = list(new.shape)
        shape[axis] = pad
        parts.append(mx.zeros(shape, new.dtype))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def _padded(x, rows: int):
    """``x [b, h, n, d]`` followed by zero rows up to ``rows``."""
    n = x.shape[2]
    if n == rows:
        return x
    pad = mx.zeros((*x.shape[:2], rows - n, x.shape[3]), x.dtype)
    return mx.concatenate([x, pad], axis=2) if n else pad


def _window_rows(state, r: int) -> int:
    """Rows of the residual buffer of a state whose window holds ``r`` tokens: its rows, or
    more when they do not hold them (rounded up to a chunk, at most the window's capacity)."""
    rows = residual_rows(state)
    return rows if r <= rows else max(r, min(residual_capacity(state), _rounded(r)))


def _store(state, t: int, rk_new, rv_new, quantize):
    """``state`` of ``t`` tokens holding ``s`` more, their rows ``rk_new`` / ``rv_new [b, h, s,
    d]`` in the residual dtype: appended to the window (written in place where they fit),
    and the oldest whole groups beyond ``residual_length`` quantized by ``quantize(keys,
    values) -> (kc, ks, kz, vc, vs, vz)`` (keys ``[b, h, d, f]``, values ``[b, h, f, d]``) into
    the quantized arrays at their count (in place where they fit, else grown)."""
    s = rk_new.shape[2]
    q0, r0 = _split(state, t)
    q1, r1 = _split(state, t + s)
    f = q1 - q0
    rows = _window_rows(state, r1)
    fields = dict(next_pos=state.next_pos + s)
    if not f:
        fields.update(residual_keys=_put(state.residual_keys, rk_new, r0, 2, rows),
                      residual_values=_put(state.residual_values, rv_new, r0, 2, rows))
    else:
        rk = mx.concatenate([state.residual_keys[:, :, :r0], rk_new], axis=2) if r0 else rk_new
        rv = mx.concatenate([state.residual_values[:, :, :r0], rv_new], axis=2) if r0 else rv_new
        kc, ks, kz, vc, vs, vz = quantize(rk[:, :, :f].swapaxes(2, 3), rv[:, :, :f])
        qrows = quantized_rows(state)
        qrows = qrows if q1 <= qrows else _rounded(q1)
        bits, g = state.bits, state.group_size
        fields.update(
            key_codes=_put(state.key_codes, kc, q0 * bits // 32, 3, qrows * bits // 32),
            key_scales=_put(state.key_scales, ks, q0 // g, 3, qrows // g),
            key_zeros=_put(state.key_zeros, kz, q0 // g, 3, qrows // g),
            value_codes=_put(state.value_codes, vc, q0, 2, qrows),
            value_scales=_put(state.value_scales, vs, q0, 2, qrows),
            value_zeros=_put(state.value_zeros, vz, q0, 2, qrows),
            residual_keys=_padded(rk[:, :, f:], rows), residual_values=_padded(rv[:, :, f:], rows))
    new = state._replace(**fields)
    return new._replace(empty=capacity(new) - t - s)


def _quantize_mlx(state):
    cd = quant.dtype_of(state.cache_dtype)

    def run(k, v):
        return (*quant.quantize(k, state.bits, state.group_size, cd),
                *quant.quantize(v, state.bits, state.group_size, cd))
    return run


def _update_mlx(state: KiviState, keys, values, queries) -> KiviState:
    rd = state.residual_keys.dtype
    return _store(state, stored_tokens(state), keys.astype(rd), values.astype(rd), _quantize_mlx(state))


# --- reference: NumPy group quantization (velox.reference) ------------------------------

def _update_reference(state: KiviState, keys, values, queries) -> KiviState:
    dtype = state.residual_keys.dtype
    sd = quant.side_dtype(quant.dtype_of(state.cache_dtype))
    new = lambda x: ref.to_mx(ref.round_to(ref.to_np(x, np.float32), dtype), dtype)  # noqa: E731

    def run(k, v):
        kc, ks, kz = ref.quantize(ref.to_np(k, np.float32), state.bits, state.group_size, sd)
        vc, vs, vz = ref.quantize(ref.to_np(v, np.float32), state.bits, state.group_size, sd)
        return (mx.array(kc), ref.to_mx(ks, sd), ref.to_mx(kz, sd),
                mx.array(vc), ref.to_mx(vs, sd), ref.to_mx(vz, sd))
    return _store(state, stored_tokens(state), new(keys), new(values), run)


def dims(state) -> tuple[int, int, int, mx.Dtype]:
    """``(batch, kv_heads, head_dim, dtype)`` of a state holding exact keys ``residual_keys [b,
    h, r, d]`` and the model's dtype in ``cache_dtype``: the model's dtype, not the residual's."""
    b, h, _, d = state.residual_keys.shape
    return b, h, d, quant.dtype_of(state.cache_dtype)


def get_kv(state: KiviState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Dequantized keys and values followed by the exact residual window (model dtype)."""
    st = held_state(state)
    cd = quant.dtype_of(st.cache_dtype)
    k = quant.dequantize(st.key_codes, st.key_scales, st.key_zeros, st.bits,
                         st.group_size, cd).swapaxes(2, 3)
    v = quant.dequantize(st.value_codes, st.value_scales, st.value_zeros, st.bits,
                         st.group_size, cd)
    return (mx.concatenate([k, st.residual_keys.astype(cd)], axis=2),
            mx.concatenate([v, st.residual_values.astype(cd)], axis=2))


# --- attention -----------------------------------------------------------------------

def _segments(state) -> list:
    return [Affine(state.key_codes, state.key_scales, state.key_zeros, state.value_codes,
                   state.value_scales, state.value_zeros, state.bits, state.group_size),
            Dense(state.residual_keys, state.residual_values)]


def _attend_held(state, q: int, r: int, queries, keys, values, scale: float, mask):
    """Attention over the first ``q`` quantized tokens and ``r`` window rows of ``state``'s
    arrays (cut to them) and the ``s`` new tokens: the kernels for a decode step on a CUDA
    device where they take it, else MLX (``attend_segments``)."""
    cut = state._replace(**_cut_quantized(state, q), **_cut_residual(state, r), empty=0)
    if queries.shape[2] == 1 and (mask is None or (isinstance(mask, str) and mask == "causal")) \
            and kivi_kernel.supports(cut, queries):
        return kivi_kernel.decode_attend(cut, queries, keys, values, scale=scale)
    return attend_segments(queries, _segments(cut), keys, values, scale=scale, mask=mask)


def attend(state: KiviState, queries: Float[Array, "b q s d"], keys: Float[Array, "b h s d"],
           values: Float[Array, "b h s d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention over the packed codes (``mx.quantized_matmul``), the residual window and ``s``
    new tokens, without dequantizing the cache (the arrays' empty rows cut off). A decode step
    (``s == 1``) on a CUDA device runs the kernels of ``velox.kernels.kivi`` where they take the
    state (``supports``): the same result evaluated in float32 (within
    ``velox.kernels.kivi.TOLERANCE`` of this path for float32 queries)."""
    q, r = held_counts(state)
    return _attend_held(state, q, r, queries, keys, values, scale, mask)


def _attend_update(state: KiviState, queries, keys, values, *, scale: float, mask=None):
    """A decode step's attention and update: the token written first (into the window's next
    row in place, or the flush of ``update``: the state is ``update``'s to the bit), then the
    attention over the written arrays' rows that held the tokens before it (the quantized
    arrays keep their first rows through a flush; the window's are the old buffer's then), so
    that nothing reads the arrays before the write and MLX writes in place. The output is
    ``attend``'s (the kernels' on a CUDA device). None for a chunk or the ``reference``
    backend (the registry then runs ``attend`` and ``update``)."""
    if keys.shape[2] != 1 or state.backend == "reference" or not (mask is None or mask == "causal"):
        return None
    t = stored_tokens(state)
    q, r = _split(state, t)
    held_counts(state)  # (the arrays agree with the count)
    rd = state.residual_keys.dtype
    new = _store(state, t, keys.astype(rd), values.astype(rd), _quantize_mlx(state))
    window = state if _split(state, t + 1)[0] != q else new
    seen = new._replace(residual_keys=window.residual_keys, residual_values=window.residual_values)
    return _attend_held(seen, q, r, queries, keys, values, scale, mask), new


def _steady_step(state, queries, keys, values, scale: float):
    """A single-token decode step that joins the window (``velox.decode.split_step``):
    ``(out, state)``. A state whose count is left to ``next_pos`` (the compiled decode step's
    record: :func:`uncounted`) is trusted to have a window row for the token and no flush due
    (the adapter checks it on the host from its offset: :func:`steady_room`; the write index
    is clamped to the buffer): the token is written at the window's count, an index computed
    from ``next_pos`` on the device, and the attention reads every row of the arrays, those
    past the counts masked out; the state stays so. Any other takes :func:`_attend_update`."""
    if state.empty != UNCOUNTED:
        return _attend_update(state, queries, keys, values, scale=scale)
    pos = state.next_pos
    g = state.group_size
    q = mx.maximum(pos - state.residual_length, 0) // g * g
    r = pos - q
    rd = state.residual_keys.dtype
    at = mx.minimum(r.reshape(-1)[:1], residual_rows(state) - 1)
    new = state._replace(residual_keys=mx.slice_update(state.residual_keys, keys.astype(rd), at, (2,)),
                         residual_values=mx.slice_update(state.residual_values, values.astype(rd), at, (2,)),
                         next_pos=pos + 1)
    out = attend_blocks(queries, _segments(new), keys, values, scale=scale, held=[q, r])
    return out, new


positions = quant.every_position(stored_tokens)


def error_bound(state: KiviState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Per-element reconstruction error bound of ``get_kv`` (in the residual window: its
    rounding to ``residual_dtype``)."""
    st = held_state(state)
    cd = quant.dtype_of(st.cache_dtype)
    kb = quant.error_bound(st.key_scales, st.key_zeros, st.bits, st.group_size)
    vb = quant.error_bound(st.value_scales, st.value_zeros, st.bits, st.group_size)
    rk = quant.rounding_bound(st.residual_keys, cd)
    rv = quant.rounding_bound(st.residual_values, cd)
    return (mx.concatenate([kb.swapaxes(2, 3), rk], axis=2), mx.concatenate([vb, rv], axis=2))


def _fill(state, keys, values):
    """The adapter's layer-by-layer single-token step (``velox.evict``'s ``fill`` protocol: a
    step the compiled one does not take, e.g. a flush after compiled steps): ``update``, its
    count left to ``next_pos`` as the compiled step leaves it (so that a cache holds the same
    record whichever way its steps ran) and remembered on the host (no device read at the
    next)."""
    new = _update_mlx(state, keys, values, None)
    return codec_cache._uncounted_with(new, stored_tokens(new))


def _fill_attention(state, new, queries, keys, values, scale: float):
    """The attention of a :func:`_fill` step from ``state`` to ``new``: over ``new``'s
    quantized arrays (their first rows are ``state``'s) and the window of ``new`` (``state``'s
    after a flush), cut to the tokens ``state`` held."""
    t = stored_tokens(state)
    q, r = _split(state, t)
    window = state if _split(state, t + 1)[0] != q else new
    seen = new._replace(residual_keys=window.residual_keys, residual_values=window.residual_values)
    return _attend_held(seen, q, r, queries, keys, values, scale, None)


def _update_mlx_backend(state, keys, values, queries):
    return _update_mlx(state, keys, values, queries)


_update_mlx_backend.steady_step = _steady_step
_update_mlx_backend.fill = _fill
_update_mlx_backend.fill_attention = _fill_attention

State = KiviState
method = register("kivi", KiviState, init, {"reference": _update_reference, "mlx": _update_mlx_backend},
                  get_kv=get_kv, positions=positions, error_bound=error_bound, dims=dims,
                  attend=attend, attend_update=_attend_update, capacity=capacity,
                  uncounted=uncounted, steady_room=steady_room)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
attend_update = method.attend_update
