"""MiniCache: the layers of a group share one direction per token, each keeping its own magnitude.

From layer ``floor(start_frac * L)`` on, layers come in groups of ``group_size``
(``model_init`` / ``layer_update``; ``make_cache`` gives each layer its ``role`` through
``layer_params``); earlier layers, and a last group of one, keep every token exact. For each
token and kv head, keys and values apart, a group's vectors ``x_0 .. x_{g-1}`` become one
direction: ``e = u_0``, then ``e = slerp(e, u_j, slerp_t)`` for each later layer (``u = x /
||x||``; two layers: the paper's ``slerp(u_0, u_1, t)``), and layer ``j`` is restored as
``||x_j|| e``. A token is retained, kept exact by every layer of its group, where some
layer's direction is farther from the first layer's than the threshold: ``cos(u_0, u_j) <
retention_threshold``.

Who holds what: the group's first layer (``role="primary"``) owns the merged directions
(``directions_*``, a retained token's row holding its own vector) and the retention flags
(``kept_*``); every other layer (``role="merge"``) holds those very arrays (the same
``mx.array``, not counted in its ``nbytes``), its own magnitudes and its retained tokens' rows,
compacted (``own_*`` with their token indices). A layer's newest tokens wait exact
(``keys``/``values``) until they are merged: a group's tokens are merged by its first layer
at its next update, when the other layers' rows of the same tokens have reached it through
the model-level record (layers run in order within a forward, so those rows exist only after
the first layer's update); each layer therefore holds its last update's tokens exact.

The model-level record (:class:`MiniCacheRecord`) says which layer is in which group and
carries the rows the merge layers hand their primary and the primary's directions and flags
the merge layers read. Updated alone (no record) a layer of either role keeps every token
exact: the seed's degenerate primary, a passthrough. Everything grows with the tokens.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Bool, Float, Int
from ..accounting import state_nbytes
from ..crosslayer import checked_update, layer_params
from ..distributed import LOCAL, Heads, host_max
from ..registry import get_method, register

__all__ = ["MiniCacheState", "MiniCacheRecord", "State", "init", "update", "get_kv", "nbytes",
           "positions", "groups", "slerp", "merge_rows", "counts"]

KEY = "minicache"
ROLES = ("primary", "merge")
_TINY = 1e-30


class MiniCacheState(NamedTuple):
    """One layer: its newest tokens exact, the merged directions and retention flags of its
    older ones (a primary's own, a merge layer's its primary's), its own magnitudes and (a
    merge layer's) its retained tokens' rows."""

    keys: Float[Array, "b h r d"]                 # the newest tokens, not merged yet
    values: Float[Array, "b h r d"]
    directions_keys: Float[Array, "b h m d"]      # the group's merged directions (a retained
    directions_values: Float[Array, "b h m d"]    # token: the primary's own vector)
    kept_keys: Bool[Array, "b h m"]               # retained tokens
    kept_values: Bool[Array, "b h m"]
    norm_keys: Float[Array, "b h m"]              # this layer's magnitudes
    norm_values: Float[Array, "b h m"]
    own_keys: Float[Array, "b h rk d"]            # a merge layer's retained rows, compacted
    own_values: Float[Array, "b h rv d"]
    own_key_index: Int[Array, "b h rk"]           # their token index (-1: padding)
    own_value_index: Int[Array, "b h rv"]
    next_pos: Int[Array, "b h"]
    start_frac: float
    group_size: int
    retention_threshold: float
    slerp_t: float
    role: str
    heads: Heads                                  # where its kv heads sit (velox.distributed)
    backend: str


class MiniCacheRecord(NamedTuple):
    """Model-level record: the groups, the rows each merge layer hands its primary, and each
    primary's merged directions and retention flags (its own arrays)."""

    primary: tuple[int, ...]     # primary[i]: the first layer of layer i's group; -1: none
    rows: dict                   # "<layer>.keys"/"<layer>.values": a merge layer's last rows
    shared: dict                 # "<primary>.directions_keys", ..., "<primary>.kept_values"


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         start_frac: float = 0.5, group_size: int = 2, retention_threshold: float = 0.9,
         slerp_t: float = 0.5, role: str = "primary", heads: Heads = LOCAL,
         backend: str = "auto") -> MiniCacheState:
    """Empty MiniCache state of one layer.

    Args:
        start_frac: layers below ``floor(start_frac * n_layers)`` are never merged.
        group_size: layers merged into one direction per token (1: none).
        retention_threshold: a token whose directions have a cosine below this in some layer
            of the group (against the group's first layer) is kept exact by every layer.
        slerp_t: the interpolation weight toward each later layer's direction (0: the first
            layer's direction, 1: the later layer's).
        role: ``"primary"`` (a group's first layer, or a layer merged with none) or
            ``"merge"`` (the others); ``make_cache`` gives each layer its role. Alone, either
            keeps every token exact.
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): a
            merge layer's retained rows pad to the most any of the layer's heads holds.
    """
    b, h, d = batch, kv_heads, head_dim
    rows = lambda: mx.zeros((b, h, 0, d), dtype)  # noqa: E731
    flags = lambda: mx.zeros((b, h, 0), mx.bool_)  # noqa: E731
    norms = lambda: mx.zeros((b, h, 0), dtype)  # noqa: E731
    index = lambda: mx.zeros((b, h, 0), mx.int32)  # noqa: E731
    return MiniCacheState(
        keys=rows(), values=rows(), directions_keys=rows(), directions_values=rows(),
        kept_keys=flags(), kept_values=flags(), norm_keys=norms(), norm_values=norms(),
        own_keys=rows(), own_values=rows(), own_key_index=index(), own_value_index=index(),
        next_pos=mx.zeros((b, h), mx.int32), start_frac=start_frac, group_size=group_size,
        retention_threshold=retention_threshold, slerp_t=slerp_t, role=role, heads=heads,
        backend=backend)


State = MiniCacheState


# --- the merge rule (mlx) ---------------------------------------------------------------------


def _unit(x: mx.array) -> tuple[mx.array, mx.array]:
    """``(x / ||x||, ||x||)`` along the last axis in float32 (a zero vector: direction 0)."""
    x = x.astype(mx.float32)
    n = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
    return mx.where(n > 0, x / mx.maximum(n, _TINY), 0.0), n[..., 0]


def slerp(a: Float[Array, "*batch d"], b: Float[Array, "*batch d"], t: float) -> Float[Array, "*batch d"]:
    """Spherical interpolation of unit vectors ``a`` to ``b`` at ``t`` (unit-norm; ``t=0``:
    ``a``, ``t=1``: ``b``). Where ``a`` and ``b`` are (nearly) collinear, ``sin`` of their
    angle below ``1e-6``, the normalized linear interpolation; a zero result (antipodal
    halfway, or zero inputs) stays zero."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    cos = mx.clip((a * b).sum(axis=-1, keepdims=True), -1.0, 1.0)
    omega = mx.arccos(cos)
    sin = mx.sin(omega)
    far = sin > 1e-6
    safe = mx.where(far, sin, 1.0)
    spherical = (mx.sin((1 - t) * omega) * a + mx.sin(t * omega) * b) / safe
    out = mx.where(far, spherical, (1 - t) * a + t * b)
    return _unit(out)[0]


def merge_rows(rows: list[mx.array], t: float, threshold: float) -> tuple[mx.array, mx.array]:
    """The group's merged direction of each token ``[..., d]`` (unit, float32) and the
    retention flags ``[...]``: retained where some later row's direction has a cosine below
    ``threshold`` with the first row's."""
    u0, _ = _unit(rows[0])
    e, kept = u0, mx.zeros(u0.shape[:-1], mx.bool_)
    for r in rows[1:]:
        u, _ = _unit(r)
        kept = kept | ((u0 * u).sum(axis=-1) < threshold)
        e = slerp(e, u, t)
    return e, kept


def _compact(rows: mx.array, index: mx.array, valid: mx.array,
             heads: Heads = LOCAL) -> tuple[mx.array, mx.array]:
    """The valid ``rows [b, h, n, d]`` of each ``(b, h)`` first, in their order, cut to the
    largest count of any ``(b, h)`` (of the layer: every shard's heads, ``heads``; others
    padded with zero rows, index -1)."""
    n = valid.shape[-1]
    if n == 0:
        return rows, index
    count = host_max(heads, int(valid.sum(axis=-1).max().item()))
    order = mx.argsort(mx.where(valid, 0, n) + mx.arange(n), axis=-1)[..., :count]
    keep = mx.take_along_axis(valid, order, axis=-1)
    rows = mx.where(keep[..., None], mx.take_along_axis(rows, order[..., None], axis=2), 0)
    return rows, mx.where(keep, mx.take_along_axis(index, order, axis=-1), -1)


def _lead_mlx(state: MiniCacheState, keys, values, follower: list | None) -> MiniCacheState:
    """A primary's update: merge its exact rows with its merge layers' rows of the same tokens
    (``follower``: their ``(keys, values)``; ``None``: nothing to merge, the rows stay exact),
    then hold the new rows exact."""
    r, dt = state.keys.shape[2], state.keys.dtype
    fields: dict[str, Any] = dict(next_pos=state.next_pos + keys.shape[2])
    if follower is None or r == 0:
        fields.update(keys=mx.concatenate([state.keys, keys.astype(dt)], axis=2),
                      values=mx.concatenate([state.values, values.astype(dt)], axis=2))
        return state._replace(**fields)
    for side, own, others in (("keys", state.keys, [f[0] for f in follower]),
                              ("values", state.values, [f[1] for f in follower])):
        e, kept = merge_rows([own, *others], state.slerp_t, state.retention_threshold)
        rows = mx.where(kept[..., None], own, e.astype(dt))
        fields[f"directions_{side}"] = mx.concatenate([getattr(state, f"directions_{side}"), rows], axis=2)
        fields[f"kept_{side}"] = mx.concatenate([getattr(state, f"kept_{side}"), kept], axis=2)
        fields[f"norm_{side}"] = mx.concatenate([getattr(state, f"norm_{side}"),
                                                 _unit(own)[1].astype(dt)], axis=2)
    fields.update(keys=keys.astype(dt), values=values.astype(dt))
    return state._replace(**fields)


def _follow_mlx(state: MiniCacheState, keys, values, shared: dict | None) -> MiniCacheState:
    """A merge layer's update: take its primary's directions and flags (``shared``, which
    now cover its exact rows; ``None``: alone, the rows stay exact), keep its magnitudes and
    its retained rows, then hold the new rows exact."""
    r, m, dt = state.keys.shape[2], state.norm_keys.shape[2], state.keys.dtype
    fields: dict[str, Any] = dict(next_pos=state.next_pos + keys.shape[2])
    if shared is None or r == 0:
        fields.update(keys=mx.concatenate([state.keys, keys.astype(dt)], axis=2),
                      values=mx.concatenate([state.values, values.astype(dt)], axis=2))
        if shared is not None:
            fields.update(shared)
        return state._replace(**fields)
    for side in ("keys", "values"):
        own, kept = getattr(state, side), shared[f"kept_{side}"][..., m:]
        fields[f"norm_{side}"] = mx.concatenate([getattr(state, f"norm_{side}"),
                                                 _unit(own)[1].astype(dt)], axis=2)
        name = "own_key_index" if side == "keys" else "own_value_index"
        idx = getattr(state, name)
        cand = mx.concatenate([getattr(state, f"own_{side}"), own], axis=2)
        index = mx.concatenate([idx, mx.broadcast_to(m + mx.arange(r, dtype=mx.int32), kept.shape)], axis=2)
        rows, index = _compact(cand, index, mx.concatenate([idx >= 0, kept], axis=2), state.heads)
        fields.update({f"own_{side}": rows, name: index})
    fields.update(shared, keys=keys.astype(dt), values=values.astype(dt))
    return state._replace(**fields)


def _update_mlx(state: MiniCacheState, keys, values, queries) -> MiniCacheState:
    step = _lead_mlx if state.role == "primary" else _follow_mlx
    return step(state, keys, values, None)


# --- reference: NumPy, one token at a time (velox.reference) ------------------------------------


def _unit_np(x: np.ndarray) -> tuple[np.ndarray, float]:
    n = float(np.sqrt((x.astype(np.float32) ** 2).sum(dtype=np.float32)))
    return (x / np.float32(max(n, _TINY)) if n > 0 else np.zeros_like(x)).astype(np.float32), n


def _slerp_np(a: np.ndarray, b: np.ndarray, t: float) -> np.ndarray:
    cos = float(np.clip(np.dot(a, b), -1.0, 1.0))
    omega = math.acos(cos)
    if math.sin(omega) > 1e-6:
        out = (math.sin((1 - t) * omega) * a + math.sin(t * omega) * b) / math.sin(omega)
    else:
        out = (1 - t) * a + t * b
    return _unit_np(out.astype(np.float32))[0]


def _merge_token_np(vectors: list[np.ndarray], t: float, threshold: float) -> tuple[np.ndarray, bool]:
    """One token and head: the merged direction and whether the token is retained."""
    u0, _ = _unit_np(vectors[0])
    e, kept = u0, False
    for v in vectors[1:]:
        u, _ = _unit_np(v)
        kept = kept or float(np.dot(u0, u)) < threshold
        e = _slerp_np(e, u, t)
    return e, kept


def _lead_reference(state: MiniCacheState, keys, values, follower: list | None) -> MiniCacheState:
    r, dt = state.keys.shape[2], state.keys.dtype
    if follower is None or r == 0:
        return _lead_mlx(state, keys, values, follower)  # rows appended: nothing computed
    fields: dict[str, Any] = dict(next_pos=state.next_pos + keys.shape[2])
    for i, (side, own) in enumerate((("keys", state.keys), ("values", state.values))):
        x = [ref.to_np(own, np.float32)] + [ref.to_np(f[i], np.float32) for f in follower]
        b, h, _, d = x[0].shape
        rows = np.zeros((b, h, r, d), np.float32)
        kept = np.zeros((b, h, r), bool)
        norms = np.zeros((b, h, r), np.float32)
        for bi in range(b):
            for hi in range(h):
                for t in range(r):
                    e, keep = _merge_token_np([xi[bi, hi, t] for xi in x], state.slerp_t,
                                              state.retention_threshold)
                    kept[bi, hi, t] = keep
                    rows[bi, hi, t] = x[0][bi, hi, t] if keep else e
                    norms[bi, hi, t] = _unit_np(x[0][bi, hi, t])[1]
        fields[f"directions_{side}"] = mx.concatenate([getattr(state, f"directions_{side}"),
                                                       ref.to_mx(rows, dt)], axis=2)
        fields[f"kept_{side}"] = mx.concatenate([getattr(state, f"kept_{side}"), mx.array(kept)], axis=2)
        fields[f"norm_{side}"] = mx.concatenate([getattr(state, f"norm_{side}"),
                                                 ref.to_mx(norms, dt)], axis=2)
    fields.update(keys=keys.astype(dt), values=values.astype(dt))
    return state._replace(**fields)


def _follow_reference(state: MiniCacheState, keys, values, shared: dict | None) -> MiniCacheState:
    r, m, dt = state.keys.shape[2], state.norm_keys.shape[2], state.keys.dtype
    if shared is None or r == 0:
        return _follow_mlx(state, keys, values, shared)
    fields: dict[str, Any] = dict(next_pos=state.next_pos + keys.shape[2])
    for side, name in (("keys", "own_key_index"), ("values", "own_value_index")):
        own = ref.to_np(getattr(state, side), np.float32)
        kept = np.array(shared[f"kept_{side}"])[..., m:]
        old_rows = ref.to_np(getattr(state, f"own_{side}"), np.float32)
        old_idx = np.array(getattr(state, name))
        b, h, _, d = own.shape
        per = [[[(j, row) for j, row in zip(old_idx[bi, hi], old_rows[bi, hi]) if j >= 0]
                + [(m + t, own[bi, hi, t]) for t in range(r) if kept[bi, hi, t]]
                for hi in range(h)] for bi in range(b)]
        count = host_max(state.heads, max(len(p) for row in per for p in row))
        rows = np.zeros((b, h, count, d), np.float32)
        index = np.full((b, h, count), -1, np.int32)
        for bi in range(b):
            for hi in range(h):
                for k, (j, row) in enumerate(per[bi][hi]):
                    rows[bi, hi, k], index[bi, hi, k] = row, j
        norms = np.array([[[_unit_np(own[bi, hi, t])[1] for t in range(r)] for hi in range(h)]
                          for bi in range(b)], np.float32).reshape(b, h, r)
        fields.update({f"own_{side}": ref.to_mx(rows, dt), name: mx.array(index),
                       f"norm_{side}": mx.concatenate([getattr(state, f"norm_{side}"),
                                                       ref.to_mx(norms, dt)], axis=2)})
    fields.update(shared, keys=keys.astype(dt), values=values.astype(dt))
    return state._replace(**fields)


def _update_reference(state: MiniCacheState, keys, values, queries) -> MiniCacheState:
    step = _lead_reference if state.role == "primary" else _follow_reference
    return step(state, keys, values, None)


_STEPS = {"reference": (_lead_reference, _follow_reference), "mlx": (_lead_mlx, _follow_mlx)}


# --- reading ------------------------------------------------------------------------------------


def _restored(state: MiniCacheState, side: str) -> mx.array:
    """The layer's merged tokens ``[b, h, m, d]``: its magnitude times the shared direction;
    retained tokens exact (a primary's from the directions, a merge layer's own rows)."""
    m = state.norm_keys.shape[2]
    directions = getattr(state, f"directions_{side}")[:, :, :m]
    out = getattr(state, f"norm_{side}")[..., None] * directions
    if state.role == "primary":
        return mx.where(getattr(state, f"kept_{side}")[:, :, :m, None], directions, out)
    rows = getattr(state, f"own_{side}")
    if rows.shape[2] == 0:
        return out
    index = getattr(state, "own_key_index" if side == "keys" else "own_value_index")
    spill = mx.concatenate([out, mx.zeros(out.shape[:2] + (1,) + out.shape[3:], out.dtype)], axis=2)
    spill = mx.put_along_axis(spill, mx.where(index >= 0, index, m)[..., None], rows, axis=2)
    return spill[:, :, :m]


def get_kv(state: MiniCacheState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Merged tokens restored (magnitude times direction, retained ones exact), then the
    newest tokens exact."""
    return tuple(mx.concatenate([_restored(state, side), getattr(state, side)], axis=2)
                 for side in ("keys", "values"))


_SHARED = ("directions_keys", "directions_values", "kept_keys", "kept_values")


def nbytes(state: MiniCacheState) -> int:
    """Bytes the layer owns: every array but, for a merge layer, its primary's directions and
    flags (counted by the primary)."""
    total = state_nbytes(state)
    if state.role == "merge":
        total -= sum(getattr(state, f).nbytes for f in _SHARED)
    return total


positions = quant.every_position(lambda state: state.norm_keys.shape[2] + state.keys.shape[2])


def counts(state: MiniCacheState) -> dict[str, int]:
    """Tokens of batch row 0, kv head 0 a layer holds, by kind: ``merged`` and ``retained``
    (keys), ``exact`` (not merged yet); ``merged + retained + exact`` is every token."""
    m = state.norm_keys.shape[2]
    kept = int(state.kept_keys[0, 0, :m].sum().item()) if m else 0
    return {"merged": m - kept, "retained": kept, "exact": state.keys.shape[2]}


# --- across layers ------------------------------------------------------------------------------


def groups(n_layers: int, start_frac: float, group_size: int) -> list[tuple[int, ...]]:
    """The merge groups: from layer ``floor(start_frac * n_layers)``, consecutive runs of
    ``group_size`` layers (a last run of one layer is no group)."""
    start = math.floor(start_frac * n_layers)
    runs = [tuple(range(i, min(i + group_size, n_layers))) for i in range(start, n_layers, group_size)]
    return [r for r in runs if len(r) > 1]


def _roles(n_layers: int, start_frac: float, group_size: int) -> list[str]:
    merged = {i for g in groups(n_layers, start_frac, group_size) for i in g[1:]}
    return ["merge" if i in merged else "primary" for i in range(n_layers)]


def _layer_params(n_layers: int, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Each layer's role: ``"merge"`` for every layer of a group but its first."""
    defaults = get_method(KEY).spec.defaults
    f, g = (params.get(k, defaults[k]) for k in ("start_frac", "group_size"))
    return [dict(params, role=r) for r in _roles(n_layers, f, g)]


def _model_init(per_layer_params: list[dict[str, Any]]) -> MiniCacheRecord:
    """The ``model_init`` hook: the groups; no rows or directions yet."""
    params, frac = layer_params(KEY, per_layer_params, "start_frac")
    _, g = layer_params(KEY, params, "group_size")
    n = len(params)
    for i, (p, want) in enumerate(zip(params, _roles(n, frac, g))):
        if p["role"] != want:
            raise ValueError(f"layer {i} has role={p['role']!r}; with start_frac={frac}, "
                             f"group_size={g} it is {want!r} (make_cache gives each layer its role)")
    primary = [-1] * n
    empty_rows, empty_flags = mx.zeros((0, 0, 0, 0), mx.float32), mx.zeros((0, 0, 0), mx.bool_)
    rows, shared = {}, {}
    for group in groups(n, frac, g):
        for i in group:
            primary[i] = group[0]
        for i in group[1:]:
            rows.update({f"{i}.keys": empty_rows, f"{i}.values": empty_rows})
        shared.update({f"{group[0]}.{f}": empty_flags if f.startswith("kept") else empty_rows
                       for f in _SHARED})
    return MiniCacheRecord(primary=tuple(primary), rows=rows, shared=shared)


def _layer_update(record: MiniCacheRecord, layer: int, state: MiniCacheState,
                  keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"], *,
                  queries: Float[Array, "b q s d"] | None = None) -> tuple[MiniCacheRecord, MiniCacheState]:
    """The ``layer_update`` hook: a primary merges its group's last tokens (its merge layers'
    rows from the record) and publishes its directions and flags; a merge layer takes them and
    publishes its new rows; a layer outside every group keeps its tokens exact."""
    checked_update(state, keys, values, queries)
    if not 0 <= layer < len(record.primary):
        raise ValueError(f"layer={layer} is outside the record's {len(record.primary)} layers")
    first = record.primary[layer]
    want = "merge" if 0 <= first != layer else "primary"
    if state.role != want:
        raise ValueError(f"layer {layer} is {want!r} in the record, but its state has "
                         f"role={state.role!r}")
    lead, follow = _STEPS[state.backend]
    if first < 0:  # outside every group: exact
        return record, lead(state, keys, values, None)
    members = [i for i, p in enumerate(record.primary) if p == first and i != first]
    if want == "primary":
        r = state.keys.shape[2]
        follower = [(record.rows[f"{i}.keys"], record.rows[f"{i}.values"]) for i in members]
        for i, (k, _) in zip(members, follower):
            if r and tuple(k.shape) != tuple(state.keys.shape):
                raise ValueError(
                    f"minicache: layer {layer} merges its {tuple(state.keys.shape)} exact rows "
                    f"with layer {i}'s {tuple(k.shape)}: the layers of a group must have the "
                    "same shapes and see the same tokens (group_size=1 merges none)")
        state = lead(state, keys, values, follower)
        shared = dict(record.shared)
        shared.update({f"{layer}.{f}": getattr(state, f) for f in _SHARED})
        rows = dict(record.rows)  # handed over: their layers drop them at their update
        rows.update({f"{i}.{s}": mx.zeros((0, 0, 0, 0), state.keys.dtype) for i in members
                     for s in ("keys", "values")})
        return record._replace(rows=rows, shared=shared), state
    shared = {f: record.shared[f"{first}.{f}"] for f in _SHARED}
    m, r = state.norm_keys.shape[2], state.keys.shape[2]
    got = shared["kept_keys"]
    if got.ndim != 3 or tuple(got.shape[:2]) != tuple(state.keys.shape[:2]) or got.shape[2] != m + r:
        raise ValueError(
            f"minicache: layer {layer} holds {m} merged and {r} exact tokens of batch and heads "
            f"{tuple(state.keys.shape[:2])}, but its primary (layer {first}) has merged "
            f"{tuple(got.shape)}: the layers of a group must have the same shapes and see the "
            "same tokens, in order (group_size=1 merges none)")
    state = follow(state, keys, values, shared)
    rows = dict(record.rows)
    rows.update({f"{layer}.keys": state.keys, f"{layer}.values": state.values})
    return record._replace(rows=rows), state


method = register(KEY, MiniCacheState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, nbytes=nbytes, positions=positions, layer_params=_layer_params,
                  model_init=_model_init, layer_update=_layer_update)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
