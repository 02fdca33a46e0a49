"""Palu: keys and values held as low-rank latents of groups of kv heads, the bases from the
model's projection weights, the latent channels quantized per token at mixed precision.

The ``h`` kv heads fall in ``G`` groups (the largest divisor of ``h`` not above
``n_head_groups``); a token's rows of a group's ``g`` heads, side by side, are projected on the
group's basis (``velox.codecs.palu``): ``key_rank`` latent channels for keys, ``value_rank``
for values, each scaled by its spread, the first ``hi_fraction`` of them coded at ``hi_bit``
bits and the rest at ``lo_bit``, in groups of ``group_size`` channels with a float16 scale and
zero each (values held unquantized, in float16, without ``quantize_values``). Every token is
kept; ``trim`` is the adapter's journal (``make_cache(..., rollback=d)``).

Bases (``basis``):

* ``"smollm2-135m-instruct"`` (the default): Palu's decomposition of the embedded SmolLM2's
  ``k_proj`` and ``v_proj`` weights, shipped with the package (``velox.adapters/data``; layer
  ``layer``, which ``make_cache`` numbers), or any model's from ``velox calibrate --method palu``
  installed by ``make_cache(model, "palu", artifacts=FILE)`` (:func:`calibrated`): each group's
  weights' SVD whitened by the calibration inputs. Such a basis maps position-free (pre-RoPE)
  keys, so each post-RoPE key is un-rotated by its position (rotate-half RoPE with the model's
  frequencies, measured at calibration) before it is projected, and turned back when it is
  rebuilt. A state without a basis that fits (another model, or no layer) refuses its first
  tokens with a ``ValueError`` naming :data:`CALIBRATE`. The rank is ``rank``, or the fewest
  channels holding ``energy_threshold`` of each group's energy on the calibration text (the
  largest over the layer's groups), fixed when the basis is installed.
* ``"prefill"`` (the seed's adaptation; explicit, for models without a calibration): a centred
  PCA a batch row and group of the first update's rows (post-RoPE keys, values), frozen from
  then on; ``rank`` channels, or ``g * head_dim`` with the directions past each group's energy
  rank zeroed (shapes cannot follow the data).

Attention (``attend``) of a decode step: the stored values are read in the latent space (the
weights times the latents, then one projection a query head: no value is rebuilt); the stored
keys' logits project the query once onto the latent channels with a ``"prefill"`` basis (no
key is rebuilt), and with a weight basis rebuild the keys from their latents and turn them by
their positions (RoPE does not commute with the projection: Palu's path for RoPE models). A
chunk (a prefill) decodes the stored rows once and runs MLX's fused attention.

Bytes a token and group: ``ceil(total / 8)`` code bytes and two float16 a channel group, keys
and values; the tables (float32 bases, means and spreads, one set a batch row and group) count
too.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, Int
from ..attention import softmax
from ..codecs import palu as codec
from ..codecs.a2ats import rotate, rotate_np
from ..codecs.palu import LatentCodes, LatentRows, PaluTables
from ..distributed import LOCAL, Heads, first_head, host_max, total_heads
from ..evict import append_rows
from ..registry import register

__all__ = ["PaluState", "State", "init", "update", "get_kv", "nbytes", "positions", "attend",
           "calibrated", "key_layout", "value_layout", "CALIBRATE"]

#: The command that fits a model's bases.
CALIBRATE = "velox calibrate --method palu --out FILE"
BASES = ("smollm2-135m-instruct", "prefill")


class PaluState(NamedTuple):
    """Latent codes of keys and values (a group of kv heads a row), the bases."""

    key_codes: LatentCodes
    value_codes: Union[LatentCodes, LatentRows]
    tables: PaluTables
    next_pos: Int[Array, "b h"]
    rank: int
    energy_threshold: float
    n_head_groups: int
    hi_bit: int
    lo_bit: int
    hi_fraction: float
    group_size: int
    quantize_values: bool
    basis: str
    layer: int
    cache_dtype: str
    heads: Heads  # where its kv heads sit among the layer's (velox.distributed)
    backend: str


State = PaluState


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         rank: int = 0, energy_threshold: float = 0.9, n_head_groups: int = 4, hi_bit: int = 4,
         lo_bit: int = 2, hi_fraction: float = 0.25, group_size: int = 32,
         quantize_values: bool = True, basis: str = "smollm2-135m-instruct", layer: int = -1,
         heads: Heads = LOCAL, backend: str = "auto") -> PaluState:
    """Empty Palu state.

    Args:
        rank: latent channels of a group's keys and of its values; 0: by energy_threshold.
        energy_threshold: the share of a group's energy the rank keeps (rank=0).
        n_head_groups: groups of kv heads sharing a latent (the largest divisor of kv_heads
            not above it).
        hi_bit: bits of the first hi_fraction of the latent channels.
        lo_bit: bits of the other latent channels.
        hi_fraction: the share of the latent channels (the leading ones) coded at hi_bit.
        group_size: latent channels sharing a scale and zero (per token).
        quantize_values: code the value latents (else float16 latents).
        basis: "smollm2-135m-instruct", the decomposition of the embedded SmolLM2's
            projection weights shipped with the package (layer `layer`; any model's through
            make_cache(..., artifacts=FILE)), or "prefill" (a PCA of the first update's rows).
        layer: the model layer whose shipped bases the state takes (-1: none).
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): the
            groups are the layer's, a shard holding whole ones; a weight basis's energy rank
            is the largest over the layer's groups.
    """
    groups = _local_groups(kv_heads, n_head_groups, heads)
    e = kv_heads // groups * head_dim
    if rank > e:
        raise ValueError(f"rank={rank} exceeds a group's width: {kv_heads // groups} kv heads "
                         f"of head_dim {head_dim} ({e}) with n_head_groups={n_head_groups}")
    t = _placeholder(batch, groups, e, head_dim, rank or e)
    if basis != "prefill":
        t = _shipped(t, batch, kv_heads, head_dim, basis, layer, rank, energy_threshold, heads)
    state = PaluState(None, None, t, mx.zeros((batch, kv_heads), mx.int32), rank,
                      energy_threshold, n_head_groups, hi_bit, lo_bit, hi_fraction, group_size,
                      quantize_values, basis, layer, quant.dtype_name(dtype), heads, backend)
    return _emptied(state)


def _local_groups(kv_heads: int, n_head_groups: int, heads: Heads) -> int:
    """The groups of a state's ``kv_heads``: the layer's groups (of all its heads, every
    shard's) that the state's shard holds, whole; a ``ValueError`` where one would straddle
    two shards."""
    total = total_heads(heads, kv_heads)
    groups = codec.head_groups(total, n_head_groups)
    if groups % heads.shards:
        raise ValueError(
            f"palu groups the layer's {total} kv heads in {groups} groups of {total // groups} "
            f"(n_head_groups={n_head_groups}); {heads.shards} shards of {kv_heads} heads would "
            f"split a group: take n_head_groups a multiple of {heads.shards} that divides {total}")
    return groups // heads.shards


def _placeholder(b: int, groups: int, e: int, d: int, r: int) -> PaluTables:
    """Tables of no basis: the first ``r`` unit vectors, zero means, unit spreads."""
    eye = mx.array(np.ascontiguousarray(np.broadcast_to(np.eye(e, dtype=np.float32)[:r], (b, groups, r, e))))
    zero = mx.zeros((b, groups, e), mx.float32)
    one = mx.ones((b, groups, r), mx.float32)
    return PaluTables(eye, zero, one, eye, zero, one, mx.zeros((d // 2,), mx.float32), d, groups,
                      r, r, False, False)


def _emptied(state: PaluState) -> PaluState:
    """``state`` holding no token: code records of zero rows in its tables' layouts."""
    t = state.tables
    b, c = t.key_basis.shape[:2]
    side = quant.side_dtype(quant.dtype_of(state.cache_dtype))
    zk = mx.zeros((b, c, 1, t.key_rank), mx.float32)
    zv = mx.zeros((b, c, 1, t.value_rank), mx.float32)
    kc = codec.quantize(zk, key_layout(state), side)
    vc = codec.quantize(zv, value_layout(state), side) if state.quantize_values \
        else LatentRows(zv.astype(side))
    cut = lambda r: type(r)(*(x[:, :, :0] for x in r))  # noqa: E731
    return state._replace(key_codes=cut(kc), value_codes=cut(vc))


def key_layout(state: PaluState) -> codec.Layout:
    """The static layout of the state's key latents."""
    return codec.layout(state.tables.key_rank, state.hi_fraction, state.hi_bit, state.lo_bit,
                        state.group_size)


def value_layout(state: PaluState) -> codec.Layout:
    return codec.layout(state.tables.value_rank, state.hi_fraction, state.hi_bit, state.lo_bit,
                        state.group_size)


# --- bases ------------------------------------------------------------------------------

def _group_arrays(a: np.ndarray, groups: int) -> np.ndarray:
    """A head-by-head array ``[h, d, ...]`` as its groups' ``[G, g d, ...]``."""
    h = a.shape[0]
    return a.reshape(groups, h // groups * a.shape[1], *a.shape[2:])


def _tables_from(arrays: dict, b: int, kv_heads: int, d: int, rank: int, threshold: float,
                 heads: Heads = LOCAL) -> PaluTables:
    """Tables of one layer's calibration (``velox.adapters.artifacts``'s ``fit_palu``) for a
    state of ``kv_heads`` (its shard's arrays: ``heads``; the rank is the layer's)."""
    e = arrays["key_basis"].shape[-1]
    groups = kv_heads * d // e
    sides = {}
    for kind in ("key", "value"):
        basis = _group_arrays(np.asarray(arrays[f"{kind}_basis"], np.float32), groups)  # [G, e, e]
        spread = np.asarray(arrays[f"{kind}_spread"], np.float32).reshape(groups, -1, e)[:, 0]
        mean = np.asarray(arrays[f"{kind}_mean"], np.float32).reshape(groups, e)
        r = host_max(heads, codec.calibrated_rank(spread, threshold, rank))
        top = spread[:, :1]
        sigma = np.where(top > 0, np.maximum(spread, codec.SPREAD_FLOOR * top), 1.0)[:, :r]
        rep = lambda a: mx.array(np.ascontiguousarray(np.broadcast_to(a, (b, *a.shape))))  # noqa: E731
        sides[kind] = (rep(np.swapaxes(basis, -1, -2)[:, :r]), rep(mean), rep(sigma), r)
    freqs = np.asarray(arrays["freqs"], np.float32)[0]
    (kb, km, ks, kr), (vb, vm, vs, vr) = sides["key"], sides["value"]
    return PaluTables(kb, km, ks, vb, vm, vs, mx.array(freqs), d, groups, kr, vr, True, True)


def _check_arrays(arrays: dict, kv_heads: int, d: int, groups: int) -> str | None:
    """Why one layer's calibration does not fit a state, or ``None``."""
    e = kv_heads // groups * d
    want = {"key_basis": (kv_heads, d, e), "value_basis": (kv_heads, d, e),
            "key_spread": (kv_heads, e), "value_spread": (kv_heads, e),
            "key_mean": (kv_heads, d), "value_mean": (kv_heads, d), "freqs": (kv_heads, d // 2)}
    for name, shape in want.items():
        got = np.shape(arrays.get(name))
        if got != shape:
            return (f"{name} of shape {got}, expected {shape} (kv_heads={kv_heads}, "
                    f"head_dim={d}, {groups} groups of {kv_heads // groups} heads)")
    return None


def _shipped(t: PaluTables, b: int, kv_heads: int, d: int, name: str, layer: int, rank: int,
             threshold: float, heads: Heads = LOCAL) -> PaluTables:
    """The shipped calibration's layer ``layer`` where it fits, else ``t`` (no basis); on a
    shard (``heads``), its heads of the layer's."""
    arrays, info = codec.shipped_arrays(name)
    if not 0 <= layer < info["layers"]:
        return t
    total, first = total_heads(heads, kv_heads), first_head(heads, kv_heads)
    one = {k: v[layer] for k, v in arrays.items()}
    if _check_arrays(one, total, d, t.groups * heads.shards) is not None:
        return t
    one = {k: v[first:first + kv_heads] for k, v in one.items()}
    return _tables_from(one, b, kv_heads, d, rank, threshold, heads)


def calibrated(state: PaluState, arrays: dict) -> PaluState:
    """``state`` with one layer's calibration installed (``velox.adapters.artifacts``'s
    ``fit_palu``: ``key_basis``, ``value_basis [kv_heads, d, g d]``, ``key_spread``,
    ``value_spread [kv_heads, g d]``, ``key_mean``, ``value_mean [kv_heads, d]``, ``freqs
    [kv_heads, d / 2]``), its ranks fixed; the state must hold no token yet."""
    if state.key_codes.codes.shape[2]:
        raise ValueError("install a calibration into an empty state: this one holds tokens")
    b, h = state.next_pos.shape
    d, groups = state.tables.head_dim, state.tables.groups
    why = _check_arrays(arrays, h, d, groups)
    if why is not None:
        raise ValueError(f"the palu calibration does not fit this state: {why}; fit it with "
                         f"`{CALIBRATE}` (--param n_head_groups=... to group the heads as the "
                         f"cache does)")
    t = _tables_from(arrays, b, h, d, state.rank, state.energy_threshold, state.heads)
    return _emptied(state._replace(tables=t))


def _refuse(state: PaluState) -> None:
    b, h = state.next_pos.shape
    raise ValueError(
        f"palu has no bases for this cache (kv_heads={h}, head_dim={state.tables.head_dim}, "
        f"layer={state.layer}): the shipped decomposition fits the embedded SmolLM2 only. Fit "
        f"this model's with `{CALIBRATE}` and pass make_cache(model, 'palu', artifacts=FILE), "
        "or take basis='prefill' (a PCA of the prompt's rows)")


def _prepared(state: PaluState, keys: mx.array, values: mx.array) -> PaluState:
    """The state with its bases: as it is when it has them; a ``"prefill"`` state fits them
    to its first rows (one MLX fit for both backends); any other refuses."""
    t = state.tables
    if t.ready:
        return state
    if state.basis != "prefill":
        _refuse(state)
    fixed = bool(state.rank)
    kb, km, ks = codec.prefill_bases(codec.to_groups(keys, t.groups), t.key_rank,
                                     state.energy_threshold, fixed)
    vb, vm, vs = codec.prefill_bases(codec.to_groups(values, t.groups), t.value_rank,
                                     state.energy_threshold, fixed)
    return state._replace(tables=t._replace(key_basis=kb, key_mean=km, key_sigma=ks,
                                            value_basis=vb, value_mean=vm, value_sigma=vs,
                                            ready=True))


# --- update -----------------------------------------------------------------------------

def _new_positions(state: PaluState, s: int) -> mx.array:
    return state.next_pos[..., None] + mx.arange(s, dtype=mx.int32)


def _stored(state: PaluState, kc, vc, s: int) -> PaluState:
    app = lambda a, x: type(a)(*(append_rows(p, q) for p, q in zip(a, x)))  # noqa: E731
    return state._replace(key_codes=app(state.key_codes, kc), value_codes=app(state.value_codes, vc),
                          next_pos=state.next_pos + s)


def _update_mlx(state, keys, values, queries):
    s = keys.shape[2]
    if s == 0:
        return state
    state = _prepared(state, keys, values)
    t = state.tables
    side = quant.side_dtype(quant.dtype_of(state.cache_dtype))
    k = keys.astype(mx.float32)
    if t.prerope:
        k = rotate(k, -_new_positions(state, s), t.freqs)
    uk = codec.project(t.key_basis, t.key_mean, t.key_sigma, codec.to_groups(k, t.groups))
    uv = codec.project(t.value_basis, t.value_mean, t.value_sigma,
                       codec.to_groups(values.astype(mx.float32), t.groups))
    kc = codec.quantize(uk, key_layout(state), side)
    vc = codec.quantize(uv, value_layout(state), side) if state.quantize_values \
        else LatentRows(uv.astype(side))
    return _stored(state, kc, vc, s)


def _update_reference(state, keys, values, queries):
    s = keys.shape[2]
    if s == 0:
        return state
    state = _prepared(state, keys, values)
    t = state.tables
    side = quant.side_dtype(quant.dtype_of(state.cache_dtype))
    k = ref.to_np(keys, np.float32)
    if t.prerope:
        pos = np.array(state.next_pos)[..., None] + np.arange(s, dtype=np.int32)
        k = rotate_np(k, -pos, np.array(t.freqs))
    tn = {f: np.array(getattr(t, f)) for f in ("key_basis", "key_mean", "key_sigma", "value_basis",
                                               "value_mean", "value_sigma")}
    uk = codec.project_np(tn["key_basis"], tn["key_mean"], tn["key_sigma"], codec.to_groups_np(k, t.groups))
    uv = codec.project_np(tn["value_basis"], tn["value_mean"], tn["value_sigma"],
                          codec.to_groups_np(ref.to_np(values, np.float32), t.groups))

    def codes(u, lay):
        c = codec.quantize_np(u, lay, side)
        return LatentCodes(mx.array(np.ascontiguousarray(c.codes)), ref.to_mx(c.scales, side),
                           ref.to_mx(c.zeros, side))
    kc = codes(uk, key_layout(state))
    vc = codes(uv, value_layout(state)) if state.quantize_values else LatentRows(ref.to_mx(uv, side))
    return _stored(state, kc, vc, s)


# --- reading ----------------------------------------------------------------------------

def _key_latents(state: PaluState) -> mx.array:
    """The stored keys' latent channels ``[b, G, n, key_rank]`` (float32, spreads applied)."""
    return codec.dequantize(state.key_codes, key_layout(state)) * state.tables.key_sigma[..., None, :]


def _value_latents(state: PaluState) -> mx.array:
    v = state.value_codes
    u = v.rows.astype(mx.float32) if isinstance(v, LatentRows) else codec.dequantize(v, value_layout(state))
    return u * state.tables.value_sigma[..., None, :]


def _stored_keys(state: PaluState) -> mx.array:
    """The stored keys ``[b, h, n, d]`` (float32, post-RoPE)."""
    t = state.tables
    y = _key_latents(state) @ t.key_basis + t.key_mean[..., None, :]
    k = codec.from_groups(y, t.head_dim)
    if t.prerope:
        n = k.shape[2]
        k = rotate(k, mx.broadcast_to(mx.arange(n, dtype=mx.int32), k.shape[:3]), t.freqs)
    return k


def _stored_values(state: PaluState) -> mx.array:
    t = state.tables
    return codec.from_groups(_value_latents(state) @ t.value_basis + t.value_mean[..., None, :],
                             t.head_dim)


def get_kv(state: PaluState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """The keys rebuilt from their latents (turned back by their positions where the basis is
    position-free) and the values, in the model's dtype."""
    cd = quant.dtype_of(state.cache_dtype)
    return _stored_keys(state).astype(cd), _stored_values(state).astype(cd)


def _positions(state: PaluState) -> Int[Array, "b h n"]:
    b, h = state.next_pos.shape
    n = state.key_codes.codes.shape[2]
    return mx.broadcast_to(mx.arange(n, dtype=mx.int32), (b, h, n))


def _dims(state: PaluState) -> tuple[int, int, int, mx.Dtype]:
    b, h = state.next_pos.shape
    return b, h, state.tables.head_dim, quant.dtype_of(state.cache_dtype)


# --- attention --------------------------------------------------------------------------

def attend(state: PaluState, queries: Float[Array, "b q s d"], keys: Float[Array, "b h t d"],
           values: Float[Array, "b h t d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention of ``queries`` over the stored tokens and ``t`` new rows (module doc)."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise ValueError("attend takes mask=None or 'causal'")
    bsz, hq, s, d = queries.shape
    n = state.key_codes.codes.shape[2]
    if s > 1 or n == 0:  # a chunk: the stored rows decoded once, MLX's fused attention
        dt = queries.dtype if queries.dtype in (mx.float16, mx.bfloat16) else mx.float32
        k = mx.concatenate([_stored_keys(state).astype(dt), keys.astype(dt)], axis=2)
        v = mx.concatenate([_stored_values(state).astype(dt), values.astype(dt)], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries.astype(dt), k, v, scale=scale,
                                                   mask=None if mask is None else "causal")
        return out.astype(queries.dtype)
    t = state.tables
    h, c = keys.shape[1], t.groups
    g, gq = h // c, hq // h
    q = queries.astype(mx.float32).reshape(bsz, h, gq, d) * scale
    if t.prerope:  # the keys rebuilt and turned by their positions
        stored = q @ _stored_keys(state).swapaxes(-1, -2)                           # [b, h, gq, n]
    else:  # the query projected once onto each group's latent channels
        qg = q.reshape(bsz, c, g, gq, d)
        kb = t.key_basis.reshape(bsz, c, t.key_rank, g, d).transpose(0, 1, 3, 4, 2)  # [b, c, g, d, r]
        ql = (qg @ kb).reshape(bsz, c, g * gq, t.key_rank)
        qm = (qg * t.key_mean.reshape(bsz, c, g, 1, d)).sum(axis=-1).reshape(bsz, c, g * gq, 1)
        stored = (ql @ _key_latents(state).swapaxes(-1, -2) + qm).reshape(bsz, h, gq, n)
    new = q @ keys.astype(mx.float32).swapaxes(-1, -2)                              # [b, h, gq, t]
    p = softmax(mx.concatenate([stored, new], axis=-1), axis=-1)
    ps, pn = p[..., :n], p[..., n:]
    z = ps.reshape(bsz, c, g * gq, n) @ _value_latents(state)                        # [b, c, g gq, r]
    vb = t.value_basis.reshape(bsz, c, t.value_rank, g, d).transpose(0, 1, 3, 2, 4)  # [b, c, g, r, d]
    out = z.reshape(bsz, c, g, gq, t.value_rank) @ vb
    out = out + ps.reshape(bsz, c, g, gq, n).sum(axis=-1, keepdims=True) \
        * t.value_mean.reshape(bsz, c, g, 1, d)
    out = out.reshape(bsz, h, gq, d) + pn @ values.astype(mx.float32)
    return out.reshape(bsz, hq, 1, d).astype(queries.dtype)


# --- registration -----------------------------------------------------------------------

def _layer_params(n_layers: int, params: dict) -> list[dict]:
    """Layer ``i`` takes layer ``i`` of the shipped bases when the model has their layer
    count; otherwise no layer (-1: the first tokens ask for an artifact)."""
    shipped = params.get("basis", BASES[0])
    fits = shipped != "prefill" and codec.shipped_arrays(shipped)[1]["layers"] == n_layers
    return [dict(params, layer=i if fits else -1) for i in range(n_layers)]


method = register("palu", PaluState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=_positions, dims=_dims, attend=attend,
                  calibrate=calibrated, layer_params=_layer_params)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend
