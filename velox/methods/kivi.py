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
"""

from __future__ import annotations

import typing
from typing import Any, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..kernels import kivi as kivi_kernel
from ..qattention import Affine, Dense, attend_segments
from ..registry import register

__all__ = ["KiviState", "State", "init", "update", "get_kv", "nbytes", "positions", "error_bound",
           "attend", "attend_update", "dims", "extended_state", "quantized_tokens", "flush_count"]


class KiviState(NamedTuple):
    """Packed key/value codes with their scales and zeros, plus the exact residual window."""

    key_codes: UInt[Array, "b h d kw"]
    key_scales: Float[Array, "b h d kg"]
    key_zeros: Float[Array, "b h d kg"]
    value_codes: UInt[Array, "b h nq vw"]
    value_scales: Float[Array, "b h nq vg"]
    value_zeros: Float[Array, "b h nq vg"]
    residual_keys: Float[Array, "b h r d"]
    residual_values: Float[Array, "b h r d"]
    next_pos: Int[Array, "b h"]
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
    ``next_pos`` and KIVI's settings, then ``params``, ``backend`` last. The KIVI state within
    is ``KiviState(*(getattr(state, f) for f in KiviState._fields))``.
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
    """Empty KIVI state.

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
        next_pos=mx.zeros((b, h), mx.int32), bits=bits, group_size=group_size,
        residual_length=residual_length, residual_dtype=residual_dtype,
        cache_dtype=quant.dtype_name(dtype), backend=backend)


def quantized_tokens(state: KiviState) -> int:
    """Number of tokens held in quantized form."""
    return state.key_scales.shape[-1] * state.group_size


def flush_count(state: KiviState, s: int) -> int:
    """Tokens that leave the residual window when ``s`` more arrive (a multiple of the group)."""
    g = state.group_size
    total = quantized_tokens(state) + state.residual_keys.shape[2] + s
    target = g * (max(total - state.residual_length, 0) // g)
    return target - quantized_tokens(state)


def _update_mlx(state: KiviState, keys, values, queries) -> KiviState:
    rd = state.residual_keys.dtype
    rk = mx.concatenate([state.residual_keys, keys.astype(rd)], axis=2)
    rv = mx.concatenate([state.residual_values, values.astype(rd)], axis=2)
    return _flushed(state, rk, rv, keys.shape[2])


def _flushed(state: KiviState, rk, rv, s: int, next_pos=None) -> KiviState:
    """The state once ``s`` new tokens joined the residual window (``rk``, ``rv``: the window
    with them appended; ``next_pos``: the advanced positions, when already computed): the
    oldest whole groups beyond ``residual_length`` quantized."""
    f = flush_count(state, s)
    fields = dict(residual_keys=rk[:, :, f:] if f else rk, residual_values=rv[:, :, f:] if f else rv,
                  next_pos=state.next_pos + s if next_pos is None else next_pos)
    if f:
        cd = quant.dtype_of(state.cache_dtype)
        kc, ks, kz = quant.quantize(rk[:, :, :f].swapaxes(2, 3), state.bits, state.group_size, cd)
        vc, vs, vz = quant.quantize(rv[:, :, :f], state.bits, state.group_size, cd)
        fields.update(
            key_codes=mx.concatenate([state.key_codes, kc], axis=3),
            key_scales=mx.concatenate([state.key_scales, ks], axis=3),
            key_zeros=mx.concatenate([state.key_zeros, kz], axis=3),
            value_codes=mx.concatenate([state.value_codes, vc], axis=2),
            value_scales=mx.concatenate([state.value_scales, vs], axis=2),
            value_zeros=mx.concatenate([state.value_zeros, vz], axis=2))
    return state._replace(**fields)


def _attend_update(state: KiviState, queries, keys, values, *, scale: float, mask=None):
    """A decode step's attention and update from the two launches of
    ``velox.kernels.kivi.decode_step`` (which also appends the token to the residual window),
    then the flush of ``update``'s ``mlx`` backend every ``group_size`` steps: the state is
    ``update``'s to the bit, the output ``attend``'s. None where the kernels do not take the
    step (the registry then runs ``attend`` and ``update``)."""
    if keys.shape[2] != 1 or state.backend != "mlx" or not (mask is None or mask == "causal"):
        return None
    plan = kivi_kernel.step_plan(state, queries)
    if plan is None:
        return None
    out, rk, rv, next_pos = kivi_kernel.decode_step(state, queries, keys, values, scale=scale, plan=plan)
    return out, _flushed(state, rk, rv, 1, next_pos)


# --- reference: NumPy group quantization (velox.reference) ------------------------------


def _update_reference(state: KiviState, keys, values, queries) -> KiviState:
    dtype = state.residual_keys.dtype
    sd = quant.side_dtype(quant.dtype_of(state.cache_dtype))
    s = keys.shape[2]
    new = lambda x: ref.round_to(ref.to_np(x, np.float32), dtype)  # noqa: E731  (held in dtype)
    rk = np.concatenate([ref.to_np(state.residual_keys, np.float32), new(keys)], 2)
    rv = np.concatenate([ref.to_np(state.residual_values, np.float32), new(values)], 2)
    f = flush_count(state, s)
    fields = dict(residual_keys=ref.to_mx(rk[:, :, f:], dtype),
                  residual_values=ref.to_mx(rv[:, :, f:], dtype), next_pos=state.next_pos + s)
    if f:
        kc, ks, kz = ref.quantize(np.swapaxes(rk[:, :, :f], 2, 3), state.bits, state.group_size, sd)
        vc, vs, vz = ref.quantize(rv[:, :, :f], state.bits, state.group_size, sd)
        fields.update(
            key_codes=mx.concatenate([state.key_codes, mx.array(kc)], axis=3),
            key_scales=mx.concatenate([state.key_scales, ref.to_mx(ks, sd)], axis=3),
            key_zeros=mx.concatenate([state.key_zeros, ref.to_mx(kz, sd)], axis=3),
            value_codes=mx.concatenate([state.value_codes, mx.array(vc)], axis=2),
            value_scales=mx.concatenate([state.value_scales, ref.to_mx(vs, sd)], axis=2),
            value_zeros=mx.concatenate([state.value_zeros, ref.to_mx(vz, sd)], axis=2))
    return state._replace(**fields)


def dims(state) -> tuple[int, int, int, mx.Dtype]:
    """``(batch, kv_heads, head_dim, dtype)`` of a state holding exact keys ``residual_keys [b,
    h, r, d]`` and the model's dtype in ``cache_dtype``: the model's dtype, not the residual's."""
    b, h, _, d = state.residual_keys.shape
    return b, h, d, quant.dtype_of(state.cache_dtype)


def get_kv(state: KiviState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Dequantized keys and values followed by the exact residual window (model dtype)."""
    cd = quant.dtype_of(state.cache_dtype)
    k = quant.dequantize(state.key_codes, state.key_scales, state.key_zeros, state.bits,
                         state.group_size, cd).swapaxes(2, 3)
    v = quant.dequantize(state.value_codes, state.value_scales, state.value_zeros, state.bits,
                         state.group_size, cd)
    return (mx.concatenate([k, state.residual_keys.astype(cd)], axis=2),
            mx.concatenate([v, state.residual_values.astype(cd)], axis=2))


def attend(state: KiviState, queries: Float[Array, "b q s d"], keys: Float[Array, "b h s d"],
                values: Float[Array, "b h s d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention over the packed codes (``mx.quantized_matmul``), the residual window and ``s``
    new tokens, without dequantizing the cache. A decode step (``s == 1``) on a CUDA device runs
    the kernels of ``velox.kernels.kivi`` where they take the state (``supports``): the same
    result evaluated in float32 (within ``velox.kernels.kivi.TOLERANCE`` of this path for float32
    queries)."""
    if queries.shape[2] == 1 and (mask is None or (isinstance(mask, str) and mask == "causal")) \
            and kivi_kernel.supports(state, queries):
        return kivi_kernel.decode_attend(state, queries, keys, values, scale=scale)
    packed = Affine(state.key_codes, state.key_scales, state.key_zeros, state.value_codes,
                    state.value_scales, state.value_zeros, state.bits, state.group_size)
    return attend_segments(queries, [packed, Dense(state.residual_keys, state.residual_values)],
                           keys, values, scale=scale, mask=mask)


positions = quant.every_position(lambda state: quantized_tokens(state) + state.residual_keys.shape[2])


def error_bound(state: KiviState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Per-element reconstruction error bound of ``get_kv`` (in the residual window: its
    rounding to ``residual_dtype``)."""
    cd = quant.dtype_of(state.cache_dtype)
    kb = quant.error_bound(state.key_scales, state.key_zeros, state.bits, state.group_size)
    vb = quant.error_bound(state.value_scales, state.value_zeros, state.bits, state.group_size)
    rk = quant.rounding_bound(state.residual_keys, cd)
    rv = quant.rounding_bound(state.residual_values, cd)
    return (mx.concatenate([kb.swapaxes(2, 3), rk], axis=2), mx.concatenate([vb, rv], axis=2))


State = KiviState
method = register("kivi", KiviState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, error_bound=error_bound, dims=dims,
                  attend=attend, attend_update=_attend_update)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
attend_update = method.attend_update
