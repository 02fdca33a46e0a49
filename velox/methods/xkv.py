"""xKV: the keys of a group of adjacent layers held as latent codes in one shared principal basis.

Layers come in groups of ``group_size`` consecutive layers (the last group may be shorter). A
key ``k`` of a layer is held as the ``latent_bits``-bit affine codes (``velox.quant``: a scale
and a zero, float16 (bfloat16 for a bfloat16 cache), for each group of ``group_quant_size``
latent channels of a token) of its latent channels ``(k - mean) @ basis``: ``mean [d]`` the
layer's own key mean, ``basis [d, w]`` orthonormal columns, the leading eigenvectors of the
covariance of the group's keys stacked over its layers, each layer's centred on its own mean
(the right singular vectors of the stacked rows). There is one basis per batch row and kv
head, shared by the layers of the group. A head keeps the fewest components that hold
``energy_threshold`` of the stacked keys' energy (``rank=0``) or ``rank`` of them, rounded up to
whole groups of ``group_quant_size`` channels (at most ``head_dim``): a latent group's bytes
are paid whether its last channels are zeros or components, so they carry the next
components. The heads of a batch hold the widest head's channels; a narrower head's extra
basis columns are zero, so its extra latent groups code exact zeros and it reconstructs as it
would alone. Values are held exact in the model's dtype (float16 for a float32 cache). Every
token is kept, in order.

Across layers (``model_init`` / ``layer_update``, :class:`XKVRecord`): in the first forward each
layer of a group but its last takes its key mean, adds the scatter matrix of its centred keys
(the keys with a non-finite entry, or one beyond float16's range, left out) to the record's
fan-in and holds its keys exact (``pending``); the group's last layer adds its own scatter,
fits the basis, codes its keys and publishes the basis in the record. At their next update the
earlier layers adopt it (the record's array itself, held as ``shared_basis``: one copy in
memory, counted once, by the layer that fitted it) and code their pending keys: the settle
round. The basis is fitted once; later forwards (decode steps, later prefill chunks) only
project onto it. Updated alone (``update``, no record) a layer is a group of one: the first
update that holds tokens fits the basis from its own keys and codes them.

Attention (``attend``): a single query token never rebuilds a key: the query is projected once,
``q . k = (q @ basis) . latent + q . mean``, the latents dequantized at their ``w`` channels; a
chunk of several queries (a prefill) decodes the stored keys once and runs MLX's fused
attention. Backends: ``mlx``, and ``reference`` (NumPy projection and codes; the fit is the one
MLX function for both, so their bases are identical and a latent channel within float32
rounding of a code boundary may code to either side).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..accounting import state_nbytes
from ..attention import softmax
from ..crosslayer import layer_params
from ..distributed import LOCAL, Heads, host_max
from ..registry import register
from ..validate import check_update

__all__ = ["XKVState", "XKVRecord", "State", "init", "update", "get_kv", "nbytes", "positions",
           "attend", "dims", "fitted", "basis_of", "widths", "coded_width", "groups", "fit",
           "key_stats"]

KEY = "xkv"
#: Rows with an entry beyond this magnitude (float16's largest finite value) are left out of
#: the fit, as non-finite rows are: one such row would swamp the covariance of the others.
FIT_LIMIT = 65504.0
#: Eigenvalues at most this share of the largest count as empty directions (a chunk of fewer
#: rows than head_dim leaves some): their basis is made canonical (:func:`fit`).
NULL_SHARE = 1e-5


class XKVState(NamedTuple):
    """One layer: latent codes of its coded keys, the keys waiting for the group's basis, every
    token's value, its basis (own or the group's), its key mean."""

    codes: UInt[Array, "b h n cw"]           # packed latent codes, one row a token
    scales: Float[Array, "b h n cg"]         # one a group of group_quant_size latent channels
    zeros: Float[Array, "b h n cg"]
    pending: Float[Array, "b h p d"]         # keys held exact until the group's basis exists
    values: Float[Array, "b h t d"]          # every token's value (t = n + p)
    basis: Float[Array, "b h d w"]           # fitted by this layer (counted); [b, h, d, 0] if not
    shared_basis: Float[Array, "b h d w"]    # the group's, fitted by its last layer (not counted)
    mean: Float[Array, "b h d"]              # this layer's key mean (float32)
    next_pos: Int[Array, "b h"]
    group_size: int
    rank: int
    energy_threshold: float
    latent_bits: int
    group_quant_size: int
    heads: Heads                             # where its kv heads sit (velox.distributed)
    backend: str


class XKVRecord(NamedTuple):
    """Model-level record: each group's basis once its last layer has fitted it (the same
    array that layer holds), and the fan-in of the group being fitted: the summed scatter
    matrices of its earlier layers' centred keys and their row counts."""

    bases: dict[str, mx.array]   # str(group) -> basis [b, h, d, w] ([0, 0, 0, 0] until fitted)
    fan_in: mx.array             # [b, h, d, d] float32 ([0, 0, 0, 0]: none)
    fan_count: mx.array          # [b, h] float32 rows behind fan_in ([0, 0]: none)
    group_size: int
    n_layers: int


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         group_size: int = 2, rank: int = 0, energy_threshold: float = 0.95,
         latent_bits: int = 4, group_quant_size: int = 32, heads: Heads = LOCAL,
         backend: str = "auto") -> XKVState:
    """Empty xKV state of one layer.

    Args:
        group_size: consecutive layers sharing one basis (1: every layer fits its own).
        rank: principal components a key keeps (at most head_dim), rounded up to whole groups
            of group_quant_size channels; 0: each head's energy rank.
        energy_threshold: the share of the stacked keys' energy the energy rank keeps (rank=0).
        latent_bits: bits of a latent channel's code.
        group_quant_size: latent channels of a token sharing one scale and zero.
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): the
            codes are as wide as the layer's widest head needs, every shard's heads counted.
    """
    b, h, d = batch, kv_heads, head_dim
    sd = quant.side_dtype(dtype)
    return XKVState(
        codes=mx.zeros((b, h, 0, 0), mx.uint32), scales=mx.zeros((b, h, 0, 0), sd),
        zeros=mx.zeros((b, h, 0, 0), sd), pending=mx.zeros((b, h, 0, d), dtype),
        values=mx.zeros((b, h, 0, d), sd), basis=mx.zeros((b, h, d, 0), mx.float32),
        shared_basis=mx.zeros((b, h, d, 0), mx.float32), mean=mx.zeros((b, h, d), mx.float32),
        next_pos=mx.zeros((b, h), mx.int32), group_size=group_size, rank=rank,
        energy_threshold=energy_threshold, latent_bits=latent_bits,
        group_quant_size=group_quant_size, heads=heads, backend=backend)


State = XKVState


# --- the fit (one MLX function for both backends) ------------------------------------------

def key_stats(keys: Float[Array, "b h s d"]) -> tuple[mx.array, mx.array, mx.array]:
    """``(mean [b, h, d], scatter [b, h, d, d], count [b, h])`` of the rows of ``keys`` that
    are finite and within ``FIT_LIMIT`` (float32): their mean, the sum of the outer products
    of the rows centred on it, and how many there are."""
    x = keys.astype(mx.float32)
    ok = mx.all(mx.abs(x) <= FIT_LIMIT, axis=-1, keepdims=True)  # NaN compares False
    zero = mx.array(0.0, mx.float32)
    count = ok.astype(mx.float32).sum(axis=2)                       # [b, h, 1]
    mean = mx.where(ok, x, zero).sum(axis=2) / mx.maximum(count, 1.0)
    xc = mx.where(ok, x - mean[:, :, None, :], zero)
    return mean, xc.swapaxes(-1, -2) @ xc, count[..., 0]


def coded_width(rank: mx.array, head_dim: int, group_quant_size: int) -> mx.array:
    """Channels a head holds for a rank: ``rank`` rounded up to whole groups, at most ``head_dim``."""
    g = group_quant_size
    return mx.minimum(((rank + g - 1) // g) * g, head_dim)


def _eigh_descending(m: mx.array) -> tuple[mx.array, mx.array]:
    """Eigenvalues and eigenvectors (columns) of symmetric ``m`` by decreasing eigenvalue,
    each vector signed so that its largest-magnitude entry is positive (CPU stream)."""
    lam, vec = mx.linalg.eigh(m, stream=mx.cpu)
    lam, vec = lam[..., ::-1], vec[..., ::-1]
    top = mx.abs(vec).argmax(axis=-2)[..., None, :]
    return lam, vec * mx.where(mx.take_along_axis(vec, top, axis=-2) < 0, -1.0, 1.0)


def fit(scatter: mx.array, count: mx.array, *, rank: int, energy_threshold: float,
        group_quant_size: int, heads: Heads = LOCAL) -> mx.array:
    """The basis ``[b, h, d, w]`` (float32) of the rows behind ``scatter [b, h, d, d]`` and
    ``count [b, h]``: the eigenvectors of their covariance by decreasing eigenvalue, each
    signed so that its largest-magnitude entry is positive, those of eigenvalues at most
    ``NULL_SHARE`` of the largest replaced by a canonical basis of their space (the rows do
    not tell its directions apart, so rounding would choose them); each head's ``rank`` (or its energy
    rank: the fewest leading eigenvalues holding ``energy_threshold`` of their sum, at least
    1) rounded up by :func:`coded_width`; ``w`` the widest head's (of the layer: every shard's
    heads, ``heads``), the columns beyond a head's own zero. The eigendecomposition runs on the CPU stream (MLX has it there only), and the
    width is read back to the host (the shapes follow it)."""
    d = scatter.shape[-1]
    cov = scatter / mx.maximum(count, 1.0)[..., None, None]
    lam, vec = _eigh_descending(cov)
    lam = mx.maximum(lam, 0.0)
    # Directions the rows leave (near) empty: eigenvalues at most NULL_SHARE of the largest.
    # eigh returns any orthonormal basis of that space, which the last bits of the rows turn
    # at will; it becomes the eigenvectors of P D P instead (P the projector on it, D =
    # diag(d, ..., 1)): the same basis whatever those bits (e_0, e_1, ... for all-zero keys).
    real = lam > NULL_SHARE * lam[..., :1]
    k = real.astype(mx.int32).sum(axis=-1)
    held = vec * real[..., None, :].astype(mx.float32)
    proj = mx.eye(d, dtype=mx.float32) - held @ held.swapaxes(-1, -2)
    ramp = mx.arange(d, 0, -1, dtype=mx.float32)
    _, free = _eigh_descending((proj * ramp) @ proj)
    j = mx.arange(d, dtype=mx.int32)
    after = mx.take_along_axis(free, mx.maximum(j - k[..., None], 0)[..., None, :], axis=-1)
    vec = mx.where(j < k[..., None, None], vec, after)
    if rank:
        ranks = mx.full(lam.shape[:-1], min(rank, d), mx.int32)
    else:
        cum = mx.cumsum(lam, axis=-1)
        short = (cum < energy_threshold * cum[..., -1:]).astype(mx.int32).sum(axis=-1)
        ranks = mx.clip(short + 1, 1, d).astype(mx.int32)
    width = coded_width(ranks, d, group_quant_size)
    w = host_max(heads, int(width.max().item()))
    keep = mx.arange(w, dtype=mx.int32) < width[..., None, None]
    return mx.where(keep, vec[..., :w], mx.array(0.0, mx.float32))


# --- codes --------------------------------------------------------------------------------

def _widths(state: XKVState, w: int) -> tuple[int, int]:
    """``(quantized, packed)`` code widths of a row of ``w`` latent channels: whole groups of
    ``group_quant_size``, then zero codes to the pack unit of ``latent_bits``."""
    g, bits = state.group_quant_size, state.latent_bits
    wq = -(-w // g) * g
    unit = 32 // bits if 32 % bits == 0 else 32
    return wq, -(-wq // unit) * unit


def _encode_mlx(state: XKVState, basis: mx.array, mean: mx.array, rows: mx.array):
    """Packed codes, scales and zeros of ``rows [b, h, s, d]``' latent channels."""
    b, h, s, _ = rows.shape
    w = basis.shape[-1]
    wq, wp = _widths(state, w)
    g, bits = state.group_quant_size, state.latent_bits
    y = (rows.astype(mx.float32) - mean[:, :, None, :]) @ basis
    if wq > w:
        y = mx.concatenate([y, mx.zeros((b, h, s, wq - w), mx.float32)], axis=-1)
    side = quant.side_dtype(state.pending.dtype)
    q, scales, zeros = quant.affine_codes(y.reshape(b, h, s, wq // g, g), bits, side)
    q = q.reshape(b, h, s, wq)
    if wp > wq:
        q = mx.concatenate([q, mx.zeros((b, h, s, wp - wq), mx.uint32)], axis=-1)
    return quant.pack(q, bits), scales, zeros


def _encode_reference(state: XKVState, basis: mx.array, mean: mx.array, rows: mx.array):
    """:func:`_encode_mlx` in NumPy: the projection, then min/max codes of every group of
    ``group_quant_size`` latent channels of a token (its scale and zero rounded to the side
    dtype first, the codes taken against the rounded ones; a zero scale or a NaN gives code 0)."""
    x = ref.to_np(rows, np.float32)
    b, h, s, _ = x.shape
    w = basis.shape[-1]
    wq, wp = _widths(state, w)
    g, bits = state.group_quant_size, state.latent_bits
    levels = np.float32(2 ** bits - 1)
    side = quant.side_dtype(state.pending.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        y = (x - np.array(mean)[:, :, None, :]) @ np.array(basis)
        y = np.concatenate([y, np.zeros((b, h, s, wq - w), np.float32)], axis=-1)
        y = y.reshape(b, h, s, wq // g, g)
        lo, hi = y.min(axis=-1), y.max(axis=-1)
        scales = ref.round_to((hi - lo) / levels, side)
        zeros = ref.round_to(lo, side)
        safe = np.where(scales > 0, scales, np.float32(1))
        q = np.clip(np.round((y - zeros[..., None]) / safe[..., None]), 0, levels)
        q = np.where((scales[..., None] > 0) & ~np.isnan(q), q, 0).astype(np.uint32)
    codes = np.zeros((b, h, s, wp), np.uint32)
    codes[..., :wq] = q.reshape(b, h, s, wq)
    return (mx.array(ref.pack_codes(codes, bits)), ref.to_mx(scales, side), ref.to_mx(zeros, side))


_ENCODE = {"mlx": _encode_mlx, "reference": _encode_reference}


# --- reading --------------------------------------------------------------------------------

def fitted(state: XKVState) -> bool:
    """Whether the state holds a basis (its own or its group's)."""
    return bool(state.basis.shape[-1] or state.shared_basis.shape[-1])


def basis_of(state: XKVState) -> mx.array:
    """The basis the state projects on, ``[b, h, d, w]``: its own, or its group's."""
    return state.basis if state.basis.shape[-1] else state.shared_basis


def widths(state: XKVState) -> mx.array:
    """Latent channels each head really holds, ``[b, h]`` int32 (its basis's non-zero columns;
    0 before the basis exists)."""
    return (mx.abs(basis_of(state)).max(axis=-2) > 0).astype(mx.int32).sum(axis=-1)


def _latents(state: XKVState) -> mx.array:
    """The dequantized latent channels of the coded keys, ``[b, h, n, w]`` float32."""
    w = basis_of(state).shape[-1]
    return quant.dequantize_f32(state.codes, state.scales, state.zeros, state.latent_bits,
                                state.group_quant_size, count=w)


def get_kv(state: XKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Keys rebuilt from their codes (``latents @ basis.T + mean``), then the pending keys as
    held; every value; in the model's dtype."""
    dt = state.pending.dtype
    keys = state.pending
    if state.codes.shape[2]:
        rebuilt = _latents(state) @ basis_of(state).swapaxes(-1, -2) + state.mean[:, :, None, :]
        keys = mx.concatenate([rebuilt.astype(dt), state.pending], axis=2)
    return keys, state.values.astype(dt)


def nbytes(state: XKVState) -> int:
    """Bytes the layer holds: every array but the group's basis adopted from the layer that
    fitted it (``shared_basis``, counted there)."""
    return state_nbytes(state) - state.shared_basis.nbytes


def dims(state: XKVState) -> tuple[int, int, int, mx.Dtype]:
    """``(batch, kv_heads, head_dim, dtype)``: the pending keys' shape and dtype."""
    b, h, _, d = state.pending.shape
    return b, h, d, state.pending.dtype


positions = quant.every_position(lambda state: state.values.shape[2])


def attend(state: XKVState, queries: Float[Array, "b q s d"], keys: Float[Array, "b h s d"],
           values: Float[Array, "b h s d"], *, scale: float, mask: Any = None) -> Float[Array, "b q s d"]:
    """Attention of ``queries`` over the stored tokens and the ``s`` new ones. One query token
    over coded keys: logits ``(q @ basis) . latent + q . mean`` (the query projected once,
    no key rebuilt), the pending and new keys' exact; one softmax; the stored values and the
    new ones. A chunk (``s > 1``), or nothing coded: MLX's fused attention over ``get_kv``."""
    b, nq, s, d = queries.shape
    if s > 1 or not state.codes.shape[2]:
        k, v = get_kv(state)
        return mx.fast.scaled_dot_product_attention(
            queries, mx.concatenate([k, keys], axis=2), mx.concatenate([v, values], axis=2),
            scale=scale, mask=mask)
    h = keys.shape[1]
    q = queries.astype(mx.float32).reshape(b, h, nq // h, d) * scale
    basis = basis_of(state)
    coded = (q @ basis) @ _latents(state).swapaxes(-1, -2) + (q * state.mean[:, :, None, :]).sum(
        axis=-1, keepdims=True)
    exact = mx.concatenate([state.pending, keys], axis=2).astype(mx.float32)
    logits = mx.concatenate([coded, q @ exact.swapaxes(-1, -2)], axis=-1)
    rows = mx.concatenate([state.values.astype(mx.float32), values.astype(mx.float32)], axis=2)
    out = softmax(logits, axis=-1) @ rows
    return out.reshape(b, nq, 1, d).astype(queries.dtype)


# --- updates --------------------------------------------------------------------------------

def _cat(old: mx.array, new: mx.array) -> mx.array:
    """``new`` after ``old`` on the token axis (an empty ``old`` of another width: ``new``)."""
    return new if old.shape[2] == 0 else mx.concatenate([old, new], axis=2)


def _absorbed(state: XKVState, rows: mx.array, values: mx.array, s: int) -> XKVState:
    """``state`` (its basis set) with ``rows`` coded and appended, ``values`` appended, ``s``
    more tokens seen; nothing left pending."""
    codes, scales, zeros = _ENCODE[state.backend](state, basis_of(state), state.mean, rows)
    b, h, _, d = state.pending.shape
    return state._replace(codes=_cat(state.codes, codes), scales=_cat(state.scales, scales),
                          zeros=_cat(state.zeros, zeros), pending=mx.zeros((b, h, 0, d), state.pending.dtype),
                          values=mx.concatenate([state.values, values.astype(state.values.dtype)], axis=2),
                          next_pos=state.next_pos + s)


def _fitted_alone(state: XKVState, rows: mx.array, extra: tuple | None = None) -> XKVState:
    """``state`` with its own basis fitted on ``rows`` (plus ``extra``'s scatter and count,
    another layer's fan-in) and its mean taken from ``rows``."""
    mean, scatter, count = key_stats(rows)
    if extra is not None:
        scatter, count = scatter + extra[0], count + extra[1]
    basis = fit(scatter, count, rank=state.rank, energy_threshold=state.energy_threshold,
                group_quant_size=state.group_quant_size, heads=state.heads)
    return state._replace(basis=basis, mean=mean)


def _update(state: XKVState, keys, values, queries) -> XKVState:
    """A layer alone (a group of one): the first update that holds tokens fits the basis on
    its keys (and any pending ones), every update codes its keys."""
    s = keys.shape[2]
    if fitted(state):
        return _absorbed(state, keys, values, s)
    rows = _cat(state.pending, keys)
    return _absorbed(_fitted_alone(state, rows), rows, values, s)


# --- across layers ----------------------------------------------------------------------------

def groups(n_layers: int, group_size: int) -> list[list[int]]:
    """The layers of each group: runs of ``group_size`` consecutive layers, the last possibly
    shorter."""
    return [list(range(i, min(i + group_size, n_layers))) for i in range(0, n_layers, group_size)]


def _model_init(per_layer_params: list[dict[str, Any]]) -> XKVRecord:
    """The ``model_init`` hook: no basis yet, no fan-in. The layers must agree on what a
    shared basis depends on (``group_size``, ``rank``, ``energy_threshold``,
    ``group_quant_size``)."""
    params, g = layer_params(KEY, per_layer_params, "group_size")
    for name in ("rank", "energy_threshold", "group_quant_size"):
        layer_params(KEY, params, name)
    n = len(params)
    return XKVRecord(bases={str(i): mx.zeros((0, 0, 0, 0), mx.float32) for i in range(len(groups(n, g)))},
                     fan_in=mx.zeros((0, 0, 0, 0), mx.float32), fan_count=mx.zeros((0, 0), mx.float32),
                     group_size=g, n_layers=n)


def _check_shared(state: XKVState, basis: mx.array, layer: int) -> None:
    b, h, d = state.basis.shape[:3]
    if tuple(basis.shape[:3]) != (b, h, d):
        raise ValueError(f"xkv: layer {layer} (batch {b}, kv_heads {h}, head_dim {d}) cannot take "
                         f"its group's basis of shape {tuple(basis.shape)}: the layers of a group "
                         "must have the same shapes (group_size=1 fits every layer on its own)")


def _layer_update(record: XKVRecord, layer: int, state: XKVState,
                  keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"], *,
                  queries: Float[Array, "b q s d"] | None = None) -> tuple[XKVRecord, XKVState]:
    """The ``layer_update`` hook. A layer with a basis codes its keys. Without one: if its
    group's basis is in the record it adopts it and codes its pending and new keys (the settle
    round); the group's last layer fits the basis on its keys and the fan-in, codes them and
    publishes the basis; an earlier layer, at its first update, takes its mean, adds its
    keys' scatter to the fan-in, and holds its keys pending."""
    b, h, d, dt = dims(state)
    check_update(keys, values, queries, batch=b, heads=h, head_dim=d, dtype=dt)
    if not 0 <= layer < record.n_layers:
        raise ValueError(f"layer={layer} is outside the record's {record.n_layers} layers")
    if state.group_size != record.group_size:
        raise ValueError(f"layer {layer} has group_size={state.group_size}, the record "
                         f"{record.group_size}")
    s = keys.shape[2]
    if fitted(state):
        return record, _absorbed(state, keys, values, s)
    g = layer // record.group_size
    first, last = g * record.group_size, min((g + 1) * record.group_size, record.n_layers) - 1
    shared = record.bases[str(g)]
    rows = _cat(state.pending, keys)
    if shared.shape[-1]:  # the settle round: the group's basis, as the record holds it
        _check_shared(state, shared, layer)
        mean = state.mean if state.pending.shape[2] else key_stats(keys)[0]
        return record, _absorbed(state._replace(shared_basis=shared, mean=mean), rows, values, s)
    has_fan_in = layer > first and record.fan_in.shape[-1] > 0
    if has_fan_in and tuple(record.fan_in.shape) != (b, h, d, d):
        raise ValueError(f"xkv: layer {layer} (batch {b}, kv_heads {h}, head_dim {d}) cannot add "
                         f"to its group's fan-in of shape {tuple(record.fan_in.shape)}: the layers "
                         "of a group must have the same shapes")
    if layer == last:  # fit the group's basis on its keys and the earlier layers' fan-in
        extra = (record.fan_in, record.fan_count) if has_fan_in else None
        state = _absorbed(_fitted_alone(state, rows, extra), rows, values, s)
        bases = dict(record.bases)
        bases[str(g)] = state.basis
        return record._replace(bases=bases, fan_in=mx.zeros((0, 0, 0, 0), mx.float32),
                               fan_count=mx.zeros((0, 0), mx.float32)), state
    if not state.pending.shape[2]:  # first update of an earlier layer: publish its scatter
        mean, scatter, count = key_stats(keys)
        if has_fan_in:
            scatter, count = scatter + record.fan_in, count + record.fan_count
        record = record._replace(fan_in=scatter, fan_count=count)
        state = state._replace(mean=mean)
    return record, state._replace(
        pending=rows, values=mx.concatenate([state.values, values.astype(state.values.dtype)], axis=2),
        next_pos=state.next_pos + s)


method = register(KEY, XKVState, init, {"reference": _update, "mlx": _update},
                  get_kv=get_kv, nbytes=nbytes, positions=positions, dims=dims, attend=attend,
                  model_init=_model_init, layer_update=_layer_update)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
attend = method.attend
