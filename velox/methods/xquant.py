"""XQuant: low-bit codes shared by adjacent layers, each layer dequantizing them with its own scales.

Layers come in groups of ``group_size`` (``model_init`` / ``layer_update``; ``make_cache``
gives each layer its ``role`` through ``layer_params``). The first layer of a group, its
anchor, quantizes as KIVI does at ``base_bits``: keys per channel in groups of
``group_quant_size`` tokens, values per token in groups of ``group_quant_size`` channels,
min/max, packed. Every other layer of the group reuses the anchor's codes of the same tokens:
it stores, per group, only its own scale and zero (the min/max of its own group, what coding
in place would store) and, with ``residual_bits > 0``, its residual ``x - (scale * code +
zero)`` quantized the same way at ``residual_bits`` bits. A reusing layer holds no codes:
its ``shared_key_codes`` / ``shared_value_codes`` are its anchor's arrays themselves (the same
``mx.array``), which its ``nbytes`` does not count.

The newest tokens wait exact (float16; bfloat16 for a bfloat16 cache): ``window`` to ``window +
group_quant_size - 1`` of them, as in KIVI's residual window; the oldest whole groups beyond
it are coded at once, so the layers of a group code the same tokens at the same step. A
reusing layer codes only the tokens its anchor has coded: updated alone (``update``, no
record) it keeps every token exact. An anchor alone is XQuant's degenerate single-cache build:
a KIVI cache at ``base_bits`` with ``window``.

The model-level record (:class:`XQuantRecord`) says which layer anchors which and carries the
latest anchor's codes (its own arrays) from the anchor to the layers after it. The codes grow
with the tokens (appended at each flush), as KIVI's; nothing is preallocated or capped.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..accounting import state_nbytes
from ..crosslayer import checked_update, layer_params
from ..registry import get_method, register

__all__ = ["XQuantState", "XQuantRecord", "State", "init", "update", "get_kv", "nbytes",
           "positions", "error_bound", "dims", "quantized_tokens", "roles", "effective_bits"]

KEY = "xquant"
ROLES = ("anchor", "reuse")


class XQuantState(NamedTuple):
    """One layer: its codes (an anchor's) or its anchor's (a reusing layer's), its own scales
    and zeros, a reusing layer's residual codes, and the newest tokens exact."""

    key_codes: UInt[Array, "b h d kw"]            # an anchor's packed key codes (per channel)
    key_scales: Float[Array, "b h d kg"]          # own, every role
    key_zeros: Float[Array, "b h d kg"]
    value_codes: UInt[Array, "b h nq vw"]         # an anchor's packed value codes (per token)
    value_scales: Float[Array, "b h nq vg"]
    value_zeros: Float[Array, "b h nq vg"]
    shared_key_codes: UInt[Array, "b h d sw"]     # a reusing layer: its anchor's array (not counted)
    shared_value_codes: UInt[Array, "b h ns vw"]
    residual_key_codes: UInt[Array, "b h d rw"]   # a reusing layer: x - dequant(codes), coded
    residual_key_scales: Float[Array, "b h d rg"]
    residual_key_zeros: Float[Array, "b h d rg"]
    residual_value_codes: UInt[Array, "b h nr rvw"]
    residual_value_scales: Float[Array, "b h nr rvg"]
    residual_value_zeros: Float[Array, "b h nr rvg"]
    exact_keys: Float[Array, "b h r d"]           # the newest tokens, not yet coded
    exact_values: Float[Array, "b h r d"]
    next_pos: Int[Array, "b h"]
    group_size: int
    base_bits: int
    residual_bits: int
    group_quant_size: int
    window: int
    role: str
    cache_dtype: str
    backend: str


class XQuantRecord(NamedTuple):
    """Model-level record: each layer's anchor, and the latest anchor's codes (its own arrays)."""

    anchors: tuple[int, ...]              # anchors[i]: the layer whose codes layer i reads (i: itself)
    key_codes: UInt[Array, "b h d kw"]    # empty until the first anchor runs
    value_codes: UInt[Array, "b h nq vw"]
    source: int                           # the layer these codes are of (-1: none yet)


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         group_size: int = 2, base_bits: int = 2, residual_bits: int = 4,
         group_quant_size: int = 32, window: int = 128, role: str = "anchor",
         backend: str = "auto") -> XQuantState:
    """Empty XQuant state of one layer.

    Args:
        group_size: layers per group: the first codes, the others reuse its codes (1: every
            layer codes its own, no sharing).
        base_bits: bits of the anchor's codes.
        residual_bits: bits of a reusing layer's residual codes (0: none, the paper's).
        group_quant_size: tokens per key group (per channel) and channels per value group
            (per token), for codes and residuals alike.
        window: newest tokens kept exact (between this and this + group_quant_size - 1; not
            in the seed, which codes every whole group).
        role: ``"anchor"`` (codes) or ``"reuse"`` (reads its anchor's codes through the
            model-level record; alone it keeps every token exact). ``make_cache`` gives
            layer ``i`` ``"anchor"`` iff ``i % group_size == 0``.
    """
    b, h, d, g = batch, kv_heads, head_dim, group_quant_size
    sd, words = quant.side_dtype(dtype), lambda bits: d * bits // 32
    u32 = lambda *s: mx.zeros(s, mx.uint32)  # noqa: E731
    side = lambda *s: mx.zeros(s, sd)  # noqa: E731
    rg = d // g if residual_bits else 0
    return XQuantState(
        key_codes=u32(b, h, d, 0), key_scales=side(b, h, d, 0), key_zeros=side(b, h, d, 0),
        value_codes=u32(b, h, 0, words(base_bits)), value_scales=side(b, h, 0, d // g),
        value_zeros=side(b, h, 0, d // g),
        shared_key_codes=u32(b, h, d, 0), shared_value_codes=u32(b, h, 0, words(base_bits)),
        residual_key_codes=u32(b, h, d, 0), residual_key_scales=side(b, h, d, 0),
        residual_key_zeros=side(b, h, d, 0),
        residual_value_codes=u32(b, h, 0, words(residual_bits)), residual_value_scales=side(b, h, 0, rg),
        residual_value_zeros=side(b, h, 0, rg),
        exact_keys=mx.zeros((b, h, 0, d), sd), exact_values=mx.zeros((b, h, 0, d), sd),
        next_pos=mx.zeros((b, h), mx.int32), group_size=group_size, base_bits=base_bits,
        residual_bits=residual_bits, group_quant_size=g, window=window, role=role,
        cache_dtype=quant.dtype_name(dtype), backend=backend)


State = XQuantState


def quantized_tokens(state: XQuantState) -> int:
    """Tokens held coded (the oldest ones)."""
    return state.key_scales.shape[-1] * state.group_quant_size


def _coded_count(state: XQuantState, s: int, anchor: tuple | None) -> int:
    """Tokens that leave the exact window when ``s`` more arrive: the oldest whole groups
    beyond ``window``; for a reusing layer no more than its anchor has coded (``anchor``: its
    codes; ``None``: none)."""
    g, q = state.group_quant_size, quantized_tokens(state)
    total = q + state.exact_keys.shape[2] + s
    f = g * (max(total - state.window, 0) // g) - q
    if state.role == "reuse":
        f = min(f, 0 if anchor is None else anchor[1].shape[2] - q)
    return max(f, 0)


def _check_anchor(state: XQuantState, anchor: tuple) -> None:
    """The anchor's codes fit this layer: same batch, kv heads and head dim, same bits."""
    b, h, d, _ = state.key_scales.shape
    kc, vc = anchor
    w = d * state.base_bits // 32
    if kc.shape[:3] != (b, h, d) or vc.shape[:2] != (b, h) or vc.shape[3] != w:
        raise ValueError(
            f"xquant: a reusing layer of batch {b}, kv_heads {h}, head_dim {d} at "
            f"base_bits={state.base_bits} cannot read its anchor's codes (keys {tuple(kc.shape)}, "
            f"values {tuple(vc.shape)}): the layers of a group must have the same shapes "
            "(group_size=1 codes every layer on its own)")


# --- mlx --------------------------------------------------------------------------------


def _fit_mlx(x: mx.array, codes: mx.array, state: XQuantState, cd: mx.Dtype):
    """A reusing layer's side data for rows ``x [..., m]`` (float32) given the anchor's
    unpacked ``codes [..., m]``: its own scales and zeros (min/max of its groups) and its
    residual codes ``(codes, scales, zeros)`` (``None`` without residual bits)."""
    lead, m, g = x.shape[:-1], x.shape[-1], state.group_quant_size
    grouped = x.reshape(*lead, m // g, g)
    _, scales, zeros = quant.affine_codes(grouped, state.base_bits, quant.side_dtype(cd))
    approx = (codes.reshape(grouped.shape).astype(mx.float32) * scales.astype(mx.float32)[..., None]
              + zeros.astype(mx.float32)[..., None])
    residual = None
    if state.residual_bits:
        residual = quant.quantize((grouped - approx).reshape(*lead, m), state.residual_bits, g, cd)
    return scales, zeros, residual


def _absorb_mlx(state: XQuantState, keys, values, anchor: tuple | None) -> XQuantState:
    ed, cd = state.exact_keys.dtype, quant.dtype_of(state.cache_dtype)
    ek = mx.concatenate([state.exact_keys, keys.astype(ed)], axis=2)
    ev = mx.concatenate([state.exact_values, values.astype(ed)], axis=2)
    f = _coded_count(state, keys.shape[2], anchor)
    fields: dict[str, Any] = dict(next_pos=state.next_pos + keys.shape[2])
    if state.role == "reuse" and anchor is not None:  # the anchor's arrays, as they are now
        fields.update(shared_key_codes=anchor[0], shared_value_codes=anchor[1])
    if f:
        xk, xv = ek[:, :, :f].swapaxes(2, 3), ev[:, :, :f]  # [b, h, d, f], [b, h, f, d]
        bits, q = state.base_bits, quantized_tokens(state)
        if state.role == "anchor":
            kc, ks, kz = quant.quantize(xk, bits, state.group_quant_size, cd)
            vc, vs, vz = quant.quantize(xv, bits, state.group_quant_size, cd)
            fields.update(key_codes=_cat(state.key_codes, kc, 3), value_codes=_cat(state.value_codes, vc, 2))
        else:
            ck = quant.unpack(anchor[0][..., q * bits // 32:(q + f) * bits // 32], bits)
            cv = quant.unpack(anchor[1][:, :, q:q + f], bits)
            ks, kz, rk = _fit_mlx(xk.astype(mx.float32), ck, state, cd)
            vs, vz, rv = _fit_mlx(xv.astype(mx.float32), cv, state, cd)
            if rk is not None:
                fields.update(_residual_fields(state, rk, rv))
        fields.update(key_scales=_cat(state.key_scales, ks, 3), key_zeros=_cat(state.key_zeros, kz, 3),
                      value_scales=_cat(state.value_scales, vs, 2),
                      value_zeros=_cat(state.value_zeros, vz, 2))
    fields.update(exact_keys=ek[:, :, f:] if f else ek, exact_values=ev[:, :, f:] if f else ev)
    return state._replace(**fields)


def _cat(old: mx.array, new: mx.array, axis: int) -> mx.array:
    return mx.concatenate([old, new], axis=axis)


def _residual_fields(state: XQuantState, rk: tuple, rv: tuple) -> dict[str, mx.array]:
    (kc, ks, kz), (vc, vs, vz) = rk, rv
    return dict(residual_key_codes=_cat(state.residual_key_codes, kc, 3),
                residual_key_scales=_cat(state.residual_key_scales, ks, 3),
                residual_key_zeros=_cat(state.residual_key_zeros, kz, 3),
                residual_value_codes=_cat(state.residual_value_codes, vc, 2),
                residual_value_scales=_cat(state.residual_value_scales, vs, 2),
                residual_value_zeros=_cat(state.residual_value_zeros, vz, 2))


def _update_mlx(state: XQuantState, keys, values, queries) -> XQuantState:
    return _absorb_mlx(state, keys, values, None)


# --- reference: NumPy, one group at a time (velox.reference) -----------------------------


def _fit_reference(x: np.ndarray, codes: np.ndarray, state: XQuantState, side: mx.Dtype):
    """:func:`_fit_mlx` in NumPy: rows ``x [..., m]`` (float32), unpacked ``codes``."""
    lead, m, g = x.shape[:-1], x.shape[-1], state.group_quant_size
    groups = x.reshape(-1, m // g, g)
    scales = np.zeros(groups.shape[:2], np.float32)
    zeros = np.zeros(groups.shape[:2], np.float32)
    for r in range(groups.shape[0]):
        for j in range(groups.shape[1]):  # own min/max, as coding in place would store them
            _, scales[r, j], zeros[r, j] = ref.quantize_group(groups[r, j], state.base_bits, side)
    approx = codes.reshape(groups.shape).astype(np.float32) * scales[..., None] + zeros[..., None]
    residual = None
    if state.residual_bits:
        residual = ref.quantize((groups - approx).reshape(*lead, m), state.residual_bits, g, side)
    return scales.reshape(*lead, -1), zeros.reshape(*lead, -1), residual


def _absorb_reference(state: XQuantState, keys, values, anchor: tuple | None) -> XQuantState:
    ed, cd = state.exact_keys.dtype, quant.dtype_of(state.cache_dtype)
    sd = quant.side_dtype(cd)
    new = lambda x: ref.round_to(ref.to_np(x, np.float32), ed)  # noqa: E731  (held in ed)
    ek = np.concatenate([ref.to_np(state.exact_keys, np.float32), new(keys)], 2)
    ev = np.concatenate([ref.to_np(state.exact_values, np.float32), new(values)], 2)
    f = _coded_count(state, keys.shape[2], anchor)
    fields: dict[str, Any] = dict(next_pos=state.next_pos + keys.shape[2],
                                  exact_keys=ref.to_mx(ek[:, :, f:], ed),
                                  exact_values=ref.to_mx(ev[:, :, f:], ed))
    if state.role == "reuse" and anchor is not None:
        fields.update(shared_key_codes=anchor[0], shared_value_codes=anchor[1])
    if f:
        xk, xv = np.swapaxes(ek[:, :, :f], 2, 3), ev[:, :, :f]
        bits, q = state.base_bits, quantized_tokens(state)
        if state.role == "anchor":
            kc, ks, kz = ref.quantize(xk, bits, state.group_quant_size, sd)
            vc, vs, vz = ref.quantize(xv, bits, state.group_quant_size, sd)
            fields.update(key_codes=_cat(state.key_codes, mx.array(kc), 3),
                          value_codes=_cat(state.value_codes, mx.array(vc), 2))
        else:
            ck = ref.unpack_codes(np.array(anchor[0])[..., q * bits // 32:(q + f) * bits // 32], bits)
            cv = ref.unpack_codes(np.array(anchor[1])[:, :, q:q + f], bits)
            ks, kz, rk = _fit_reference(xk, ck, state, sd)
            vs, vz, rv = _fit_reference(xv, cv, state, sd)
            if rk is not None:
                fields.update(_residual_fields(state, *[
                    (mx.array(c), ref.to_mx(s, sd), ref.to_mx(z, sd)) for c, s, z in (rk, rv)]))
        fields.update(key_scales=_cat(state.key_scales, ref.to_mx(ks, sd), 3),
                      key_zeros=_cat(state.key_zeros, ref.to_mx(kz, sd), 3),
                      value_scales=_cat(state.value_scales, ref.to_mx(vs, sd), 2),
                      value_zeros=_cat(state.value_zeros, ref.to_mx(vz, sd), 2))
    return state._replace(**fields)


def _update_reference(state: XQuantState, keys, values, queries) -> XQuantState:
    return _absorb_reference(state, keys, values, None)


_ABSORB = {"reference": _absorb_reference, "mlx": _absorb_mlx}


# --- reading --------------------------------------------------------------------------------


def _coded(state: XQuantState) -> tuple[mx.array, mx.array]:
    """The packed codes the layer dequantizes: its own (anchor) or the first
    ``quantized_tokens`` of its anchor's (a view of the anchor's arrays)."""
    if state.role == "anchor":
        return state.key_codes, state.value_codes
    q = quantized_tokens(state)
    return (state.shared_key_codes[..., :q * state.base_bits // 32],
            state.shared_value_codes[:, :, :q])


def _decoded(state: XQuantState) -> tuple[mx.array, mx.array]:
    """Coded keys ``[b, h, d, q]`` and values ``[b, h, q, d]`` in float32 (residuals added)."""
    kc, vc = _coded(state)
    g, bits = state.group_quant_size, state.base_bits
    k = quant.dequantize_f32(kc, state.key_scales, state.key_zeros, bits, g)
    v = quant.dequantize_f32(vc, state.value_scales, state.value_zeros, bits, g)
    if state.role == "reuse" and state.residual_bits and quantized_tokens(state):
        rb = state.residual_bits
        k = k + quant.dequantize_f32(state.residual_key_codes, state.residual_key_scales,
                                     state.residual_key_zeros, rb, g)
        v = v + quant.dequantize_f32(state.residual_value_codes, state.residual_value_scales,
                                     state.residual_value_zeros, rb, g)
    return k, v


def get_kv(state: XQuantState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Dequantized keys and values (a reusing layer's: its anchor's codes with its own scales,
    plus its residual), then the exact window, in the model's dtype."""
    cd = quant.dtype_of(state.cache_dtype)
    k, v = _decoded(state)
    return (mx.concatenate([k.swapaxes(2, 3).astype(cd), state.exact_keys.astype(cd)], axis=2),
            mx.concatenate([v.astype(cd), state.exact_values.astype(cd)], axis=2))


def nbytes(state: XQuantState) -> int:
    """Bytes the layer owns: every array but its anchor's codes (a reusing layer's
    ``shared_*`` fields, counted by the anchor)."""
    return state_nbytes(state) - state.shared_key_codes.nbytes - state.shared_value_codes.nbytes


def error_bound(state: XQuantState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Per-element bound on ``|get_kv - input|``: an anchor's codes as KIVI's; a reusing
    layer's residual codes' bound plus the rounding of the sum (``inf`` without residual
    bits: its codes are another layer's); the exact window's rounding to its dtype."""
    cd = quant.dtype_of(state.cache_dtype)
    g = state.group_quant_size
    if state.role == "anchor":
        kb = quant.error_bound(state.key_scales, state.key_zeros, state.base_bits, g)
        vb = quant.error_bound(state.value_scales, state.value_zeros, state.base_bits, g)
    elif state.residual_bits:
        rb = state.residual_bits
        k, v = _decoded(state)
        u = quant.unit_roundoff(cd) + 2.0 ** -22
        kb = quant.error_bound(state.residual_key_scales, state.residual_key_zeros, rb, g) + u * mx.abs(k)
        vb = quant.error_bound(state.residual_value_scales, state.residual_value_zeros, rb, g) + u * mx.abs(v)
    else:
        kb = mx.full(state.key_scales.shape[:3] + (quantized_tokens(state),), mx.inf)
        vb = mx.full(state.value_scales.shape[:3] + (state.value_zeros.shape[-1] * g,), mx.inf)
    rk = quant.rounding_bound(state.exact_keys, cd)
    rv = quant.rounding_bound(state.exact_values, cd)
    return mx.concatenate([kb.swapaxes(2, 3), rk], axis=2), mx.concatenate([vb, rv], axis=2)


def dims(state: XQuantState) -> tuple[int, int, int, mx.Dtype]:
    """``(batch, kv_heads, head_dim, dtype)``: the exact window's shape, the model's dtype."""
    b, h, _, d = state.exact_keys.shape
    return b, h, d, quant.dtype_of(state.cache_dtype)


positions = quant.every_position(lambda state: quantized_tokens(state) + state.exact_keys.shape[2])


# --- across layers ----------------------------------------------------------------------------


def roles(n_layers: int, group_size: int) -> list[str]:
    """Each layer's role: ``"anchor"`` iff ``i % group_size == 0``."""
    return ["anchor" if i % group_size == 0 else "reuse" for i in range(n_layers)]


def effective_bits(base_bits: int, residual_bits: int, group_size: int, group_quant_size: int = 32,
                   layers: int | None = None) -> float:
    """Bits per coded element averaged over the layers of a group (``layers``, default
    ``group_size``; a trailing group may be shorter), side data included (a float16 scale and
    zero per group of ``group_quant_size``): ``(anchor + (layers - 1) * reuse) / layers``,
    anchor ``base_bits + 32 / g``, reuse ``32 / g`` plus ``residual_bits + 32 / g`` with a
    residual."""
    n = group_size if layers is None else layers
    side = 32 / group_quant_size
    anchor = base_bits + side
    reuse = side + (residual_bits + side if residual_bits else 0)
    return (anchor + (n - 1) * reuse) / n


def _layer_params(n_layers: int, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Layer ``i`` takes the role ``roles(n_layers, group_size)[i]``."""
    g = params.get("group_size", get_method(KEY).spec.params["group_size"].default)
    return [dict(params, role=r) for r in roles(n_layers, g)]


def _model_init(per_layer_params: list[dict[str, Any]]) -> XQuantRecord:
    """The ``model_init`` hook: each layer's anchor (the first layer of its group), no codes."""
    params, g = layer_params(KEY, per_layer_params, "group_size")
    for name in ("base_bits", "group_quant_size", "window"):  # what a group's codes depend on
        layer_params(KEY, params, name)
    for i, (p, want) in enumerate(zip(params, roles(len(params), g))):
        if p["role"] != want:
            raise ValueError(f"layer {i} has role={p['role']!r}; with group_size={g} it is "
                             f"{want!r} (make_cache gives each layer its role)")
    empty = mx.zeros((0, 0, 0, 0), mx.uint32)
    return XQuantRecord(anchors=tuple(i - i % g for i in range(len(params))),
                        key_codes=empty, value_codes=empty, source=-1)


def _layer_update(record: XQuantRecord, layer: int, state: XQuantState,
                  keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"], *,
                  queries: Float[Array, "b q s d"] | None = None) -> tuple[XQuantRecord, XQuantState]:
    """The ``layer_update`` hook: an anchor codes and publishes its codes; a reusing layer
    codes the same tokens with its anchor's codes, read from the record."""
    checked_update(state, keys, values, queries)
    if not 0 <= layer < len(record.anchors):
        raise ValueError(f"layer={layer} is outside the record's {len(record.anchors)} layers")
    anchor = record.anchors[layer]
    want = "anchor" if anchor == layer else "reuse"
    if state.role != want:
        raise ValueError(f"layer {layer} is {want!r} in the record (its anchor: layer {anchor}), "
                         f"but its state has role={state.role!r}")
    absorb = _ABSORB[state.backend]
    if want == "anchor":
        state = absorb(state, keys, values, None)
        return record._replace(key_codes=state.key_codes, value_codes=state.value_codes,
                               source=layer), state
    if record.source != anchor:
        raise ValueError(f"layer {layer} reads the codes of layer {anchor}, but the record holds "
                         f"layer {record.source}'s: layers update in order, each anchor first")
    codes = (record.key_codes, record.value_codes)
    _check_anchor(state, codes)
    return record, absorb(state, keys, values, codes)


method = register(KEY, XQuantState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, nbytes=nbytes, positions=positions, error_bound=error_bound,
                  dims=dims, layer_params=_layer_params, model_init=_model_init,
                  layer_update=_layer_update)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
