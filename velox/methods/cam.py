"""CaM: H2O eviction whose losers are merged into the kept tokens instead of dropped.

The eviction choice is H2O's (accumulated attention, ``grace``, ``decay``, sinks). Each loser
``e`` of a selection then merges into kept, non-sink targets, gated as in the paper by a
Bernoulli draw with probability ``min(1, A_e / mean A over its targets)`` (``A``: accumulated
scores; the draw is a counter-based hash of ``(seed, position of e)``; ``merge_gate=False``
merges every loser):

* ``sim_weighted``: the target is the kept token whose key is most cosine-similar; it becomes
  the weighted mean ``(x + sum w_e x_e) / (1 + sum w_e)`` of itself and its losers, with
  ``w_e = clip(cos, 0, 1)``;
* ``mean``: the same with ``w_e = 1`` (the plain mean);
* ``window``: the paper's rule: ``x_e / m`` is added to each of the ``m <= merge_window``
  kept tokens that follow ``e``;
* ``drop``: no merge: H2O exactly.

Values always merge, keys too with ``merge_keys``; a merged loser's score moves to its targets
(split evenly in ``window``). A multi-token chunk is one selection whose losers merge at once.
A loser whose key, value or score is not finite is dropped, never merged, and a target is
never one of non-finite cosine (``evict.ranked``), so a NaN never spreads into a kept row.

The state keeps each stored key's L2 norm (``key_norms``, float32, 4 bytes per token and kv
head), computed once when the key arrives (and again for a key changed by a merge), so that
the cosines of a decode step read the kept keys once.

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache: H2O's fused
weights kernel, then one kernel that plans the merge (loser, target, weight, gate, merged key
norms) and one that moves the rows with the targets merged, ``velox.kernels.merge``; every
other step runs the ``mlx`` ops).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float
from ..heavy_hitters import heavy_hitter_kernel, heavy_hitter_reference, heavy_hitter_scores
from ..noise import hash_uniform, hash_uniform_np
from ..registry import register

__all__ = ["CaMState", "State", "init", "update", "get_kv", "nbytes"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, merge: str = "sim_weighted", merge_keys: bool = False,
         merge_gate: bool = True, merge_window: int = 32, grace: int = 16, decay: float = 0.98,
         seed: int = 42, backend: str = "auto") -> CaMState:
    """Empty CaM state holding at most ``budget`` tokens per head.

    Args:
        budget: tokens held per head, sinks included.
        n_sink: leading tokens never evicted and never merged into.
        merge: how a loser merges: into its most similar kept token (cosine-weighted or plain
            mean), into the following kept tokens (the paper), or not at all (h2o).
        merge_keys: merge keys as well as values.
        merge_gate: the paper's Bernoulli merge gate (false merges every loser).
        merge_window: kept tokens after a loser that share it with merge='window' (the
            authors' merge budget; not in the seed).
        grace: newest tokens never evicted (h2o's grace; not in the seed, added with h2o's
            default).
        decay: multiplier applied to accumulated scores at every token (h2o's decay; not in
            the seed, added with h2o's default).
        seed: seed of the merge gate's draws.
    """
    return evict.empty_state(CaMState, locals())


CaMState = State = evict.state_type(
    "CaMState", init,
    "Kept (possibly merged) rows, their absolute positions, accumulated ``scores`` and the "
    "L2 norms of the stored keys.",
    scores=Float[Array, "b h n"], key_norms=Float[Array, "b h n"])


def _rowwise() -> bool:
    """Merge a decode step row by row (no concatenated candidates, only target rows rewritten).

    That moves the fewest bytes, which is what counts on a CPU; on a GPU the extra small
    kernels cost more than the bytes saved (2.0 ms vs 1.0 ms a step on an H200), so there the
    dense form runs: concatenate, gather, scatter-add, rescale every row.
    """
    return mx.default_device() == mx.cpu


def _split_mlx(stored: tuple, fresh: tuple, idx: mx.array, rowwise: bool) -> tuple:
    """Survivors (rows ``idx``) and losers (the other candidates, ascending) of each
    ``stored ++ fresh`` pair, and for each loser the number of survivors before it.

    ``rowwise``: a decode step at a full cache has one loser, the index missing from ``idx``;
    survivors come from :func:`evict.keep_rows` (no concatenated candidates), the loser is one row.
    """
    n, s = stored[0].shape[2], fresh[0].shape[2]
    N, B = n + s, idx.shape[2]
    E = N - B
    if rowwise and s == 1 and E == 1:
        surv = evict.keep_rows(stored, fresh, idx)
        lose = (N * (N - 1) // 2 - idx.sum(axis=2, keepdims=True)).astype(mx.int32)
        src, is_new = mx.minimum(lose, n - 1), lose == n
        losers = tuple(mx.where(is_new.reshape(is_new.shape + (1,) * (a.ndim - 3)), x,
                                evict.take_rows(a, src)) for a, x in zip(stored, fresh))
        return surv, losers, lose  # every candidate before the only loser survives
    cand = tuple(mx.concatenate([a, x], axis=2) for a, x in zip(stored, fresh))
    b, h = idx.shape[:2]
    kept = mx.put_along_axis(mx.zeros((b, h, N), mx.int32), idx, mx.ones(idx.shape, mx.int32), axis=2)
    lose = mx.argsort(kept * N + mx.arange(N, dtype=mx.int32), axis=2)[:, :, :E].astype(mx.int32)
    before = mx.take_along_axis(mx.cumsum(kept, axis=2), lose, axis=2)
    return (tuple(evict.take_rows(c, idx) for c in cand),
            tuple(evict.take_rows(c, lose) for c in cand), before)


def _merge_mlx(state: CaMState, stored: tuple, fresh: tuple, idx: mx.array) -> tuple:
    """Survivors ``idx`` of the candidates ``(keys, values, positions, scores, key_norms)``
    with the losers merged in. Only the target rows are rewritten (in place where MLX can
    donate)."""
    rowwise = _rowwise()
    (sk, sv, spos, s_acc, s_norm), (lk, lv, lpos, l_acc, l_norm), before = _split_mlx(
        stored, fresh, idx, rowwise)
    b, h, B, d = sk.shape
    lose_count = lk.shape[2]
    lk, lv = lk.astype(mx.float32), lv.astype(mx.float32)
    # a loser with a non-finite key, value or score is dropped, not merged
    fine = (mx.isfinite(lk).all(axis=-1) & mx.isfinite(lv).all(axis=-1)
            & mx.isfinite(l_acc))                                           # [b, h, E]
    lk, lv = mx.where(fine[..., None], lk, 0.0), mx.where(fine[..., None], lv, 0.0)
    if state.merge == "window":
        tgt = before[..., None] + mx.arange(state.merge_window, dtype=mx.int32)  # [b, h, E, width]
        valid = tgt < B
        tgt = mx.minimum(tgt, B - 1)
        size = valid.astype(mx.float32).sum(axis=-1)                        # [b, h, E]
        t_acc = mx.take_along_axis(s_acc[:, :, None, :], tgt, axis=3)
        den = mx.where(valid, t_acc, 0.0).sum(axis=-1) / mx.maximum(size, 1.0)
        weight = valid.astype(mx.float32) / mx.maximum(size, 1.0)[..., None]
        has_target = size > 0
    else:
        unit = lk / mx.maximum(l_norm, 1e-30)[..., None]
        cos = (unit @ sk.astype(mx.float32).swapaxes(-1, -2)) / mx.maximum(s_norm, 1e-30)[:, :, None, :]
        cos = mx.where(mx.arange(B) >= state.n_sink, evict.ranked(cos), -mx.inf)  # sinks: first slots
        tgt = mx.argmax(cos, axis=-1).astype(mx.int32)[..., None]           # [b, h, E, 1]
        den = mx.take_along_axis(s_acc, tgt[..., 0], axis=2)
        sim = mx.take_along_axis(cos, tgt, axis=3)
        has_target = sim[..., 0] > -mx.inf  # a non-sink target of finite cosine
        sim = mx.where(has_target[..., None], sim, 0.0)
        weight = mx.clip(sim, 0.0, 1.0) if state.merge == "sim_weighted" else mx.ones_like(sim)
    on = fine if has_target is None else has_target & fine
    if state.merge_gate:
        u = hash_uniform(state.seed, lpos)
        prob = mx.where(l_acc >= den, 1.0, l_acc / mx.maximum(den, 1e-30))
        on = u < prob if on is None else on & (u < prob)
    if on is not None:
        weight = weight * on[..., None].astype(mx.float32)                  # [b, h, E, t]
    flat = (tgt + evict.row_offsets(b, h, B)[..., None]).reshape(-1)
    if state.merge == "window":  # the paper: add x_e / m to each of its m targets
        denom, share = None, weight
    else:  # the weighted mean of each target and the losers merged into it
        share = (weight > 0).astype(mx.float32)
        if rowwise and lose_count == 1:  # one loser per row: a target's mass is its weight
            denom = 1.0 + weight.reshape(-1, 1)
        else:
            mass = mx.zeros((b * h * B,), mx.float32).at[flat].add(weight.reshape(-1))
            denom = (1.0 + mass[flat])[:, None]

    if rowwise:  # where each target row comes from in the inputs: stored row or new row
        n, s = stored[0].shape[2], fresh[0].shape[2]
        per_row = tgt.shape[2] * tgt.shape[3]                               # targets a row
        t = tgt.reshape(b, h, per_row)
        one_loser = s == 1 and lose_count == 1  # _split_mlx's row-wise step: before = loser
        # survivor slot j is candidate j, or j + 1 from the loser on
        cand = t + (t >= before) if one_loser else mx.take_along_axis(idx, t, axis=2)
        from_new = (cand >= n).reshape(-1)[:, None]
        at_new = (mx.maximum(cand - n, 0) + evict.row_offsets(b, h, s)).reshape(-1)
        at_stored = (mx.minimum(cand, max(n - 1, 0)) + evict.row_offsets(b, h, n)).reshape(-1)

    def candidate_rows(x_stored, x_fresh):
        """The targets' rows as they were before merging, read from the inputs."""
        # one new token and one target a row: the new row of each row is the target's
        new = x_fresh.reshape(-1, d) if s == 1 and per_row == 1 else x_fresh.reshape(-1, d)[at_new]
        return new if n == 0 else mx.where(from_new, new, x_stored.reshape(-1, d)[at_stored])

    def merged(x_surv, x_lose, x_stored, x_fresh):
        """Target rows become (row + weighted losers) [/ (1 + mass)]."""
        add = (weight[..., None] * x_lose[:, :, :, None, :]).reshape(-1, d)
        if not rowwise:  # dense: every row in float32, rescaled (by 1 where nothing merged)
            out = x_surv.astype(mx.float32).reshape(-1, d).at[flat].add(add)
            out = out if denom is None else out / (1.0 + mass)[:, None]
            return out.astype(x_surv.dtype).reshape(b, h, B, d)
        rows = x_surv.reshape(-1, d)
        if lose_count * tgt.shape[-1] > 1:  # entries may share a target row (several losers,
            # or window targets clamped to the last row): sum their parts per target
            add = mx.zeros((b * h * B, d), mx.float32).at[flat].add(add)[flat]
        # the targets' rows come from the inputs, not from x_surv: a read of x_surv would
        # keep the scatter below from writing into it in place (a copy of every row)
        new = candidate_rows(x_stored, x_fresh).astype(mx.float32) + add
        new = new if denom is None else new / denom
        rows[flat] = new.astype(rows.dtype)  # a scatter into a new array; x_surv is untouched
        return rows.reshape(b, h, B, d)

    sv = merged(sv, lv, stored[1], fresh[1])
    if state.merge_keys:  # merged keys: the targets' norms are those of their new rows
        sk = merged(sk, lk, stored[0], fresh[0])
        s_norm = s_norm.reshape(-1)
        s_norm[flat] = evict.row_norms(sk.reshape(-1, d)[flat])
        s_norm = s_norm.reshape(b, h, B)
    moved = (share * mx.where(fine, l_acc, 0.0)[..., None]).reshape(-1)     # scores follow merges
    s_acc = (s_acc.reshape(-1).at[flat].add(moved)).reshape(b, h, B)
    return sk, sv, spos, s_acc, s_norm


def _update_mlx(state: CaMState, keys, values, queries) -> CaMState:
    n, s = state.keys.shape[2], keys.shape[2]
    scored = heavy_hitter_scores(state, keys, values, queries)  # H2O's choice of the losers
    old, new = scored.updates["scores"]
    idx = evict.top_budget(scored.scores, state.budget,
                           evict.protected(n + s, state.n_sink, state.grace))
    stored = (state.keys, state.values, state.positions, old, state.key_norms)
    fresh = (keys, values, evict.new_positions(state.next_pos, s), new, evict.row_norms(keys))
    if idx is None or state.merge == "drop":
        k, v, p, sc, kn = evict.keep_rows(stored, fresh, idx)
    else:
        k, v, p, sc, kn = _merge_mlx(state, stored, fresh, idx)
    return state._replace(keys=k, values=v, positions=p, scores=sc, key_norms=kn,
                          next_pos=state.next_pos + s)


def _decode_cuda(state: CaMState, keys, values, queries) -> CaMState:
    from ..kernels.merge import merge_step
    scores = heavy_hitter_kernel.inputs(state, keys, values, queries)["by"]  # H2O's fused weights kernel
    k, v, p, nxt, sc, kn = merge_step(
        state.keys, state.values, state.positions, keys, values, state.next_pos, scores,
        state.key_norms, merge=state.merge, merge_keys=state.merge_keys,
        merge_gate=state.merge_gate, merge_window=state.merge_window, seed=state.seed,
        n_sink=state.n_sink, recent=state.grace)
    return state._replace(keys=k, values=v, positions=p, next_pos=nxt, scores=sc, key_norms=kn)


def _merge_reference(state: CaMState, keys, values, pos, acc, chosen):
    """One row: survivors ``chosen`` with the losers merged in (float64)."""
    keys, values, acc = keys.astype(np.float64), values.astype(np.float64), acc.copy()
    lose = np.setdiff1d(np.arange(len(pos)), chosen)
    sk, sv, s_acc = keys[chosen], values[chosen], acc[chosen]
    add_k, add_v = np.zeros_like(sk), np.zeros_like(sv)
    mass, moved = np.zeros(len(chosen)), np.zeros(len(chosen))
    for e in lose:
        if not (np.isfinite(keys[e]).all() and np.isfinite(values[e]).all() and np.isfinite(acc[e])):
            continue  # a non-finite loser is dropped, not merged
        if state.merge == "window":
            first = np.searchsorted(chosen, e)           # kept tokens before e
            targets = np.arange(first, min(first + state.merge_window, len(chosen)))
            if len(targets) == 0:
                continue
            weights = np.full(len(targets), 1.0 / len(targets))
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                cos = ref.ranked(np.array([keys[e] @ sk[j] / max(np.linalg.norm(keys[e]) * np.linalg.norm(sk[j]), 1e-30)
                                           for j in range(len(chosen))]))
            j = max(range(state.n_sink, len(chosen)), key=lambda t: (cos[t], -t))
            if cos[j] == -np.inf:  # no target of finite cosine
                continue
            targets = np.array([j])
            weights = np.array([min(max(cos[j], 0.0), 1.0) if state.merge == "sim_weighted" else 1.0])
            if weights[0] == 0:  # orthogonal or opposed: nothing to merge
                continue
        den = s_acc[targets].mean()
        prob = 1.0 if acc[e] >= den else acc[e] / den
        if state.merge_gate and not hash_uniform_np(state.seed, pos[e:e + 1])[0] < prob:
            continue
        add_k[targets] += weights[:, None] * keys[e]
        add_v[targets] += weights[:, None] * values[e]
        mass[targets] += weights
        moved[targets] += acc[e] * (weights if state.merge == "window" else 1.0)
    if state.merge == "window":
        sv = sv + add_v
        sk = sk + add_k if state.merge_keys else sk
    else:
        sv = (sv + add_v) / (1.0 + mass[:, None])
        sk = (sk + add_k) / (1.0 + mass[:, None]) if state.merge_keys else sk
    return sk, sv, s_acc + moved


def _update_reference(state: CaMState, keys, values, queries) -> CaMState:
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    old = ref.to_np(state.scores)
    acc = np.zeros((b, h, N))
    chosen = [[None] * h for _ in range(b)]
    merged_k, merged_v = c.keys.astype(np.float64), c.values.astype(np.float64)
    for i in range(b):
        for j in range(h):
            pos = c.positions[i, j]
            head = ref.head(c, i, j, {"scores": old[i, j]}, N > state.budget)
            acc[i, j] = heavy_hitter_reference(state, head)[0]  # H2O's accumulated attention
            keep = ref.protected(pos, c.total[i, j], state.n_sink, state.grace)
            chosen[i][j] = ref.top_budget(acc[i, j], state.budget, keep)
            if chosen[i][j] is not None and state.merge != "drop":
                sel = chosen[i][j]
                sk, sv, sacc = _merge_reference(state, c.keys[i, j], c.values[i, j], pos, acc[i, j], sel)
                merged_k[i, j, sel], merged_v[i, j, sel], acc[i, j, sel] = sk, sv, sacc
    stored_k = ref.round_to(merged_k, state.keys.dtype).astype(np.float64)  # as the state holds them
    return ref.keep(state, c._replace(keys=merged_k, values=merged_v), chosen, scores=acc,
                    key_norms=np.linalg.norm(stored_k, axis=-1))


method = register("cam", CaMState, init, {
    "reference": _update_reference, "mlx": _update_mlx,
    "cuda": evict.cuda_update(_update_mlx, lambda st: st.budget, _decode_cuda)})
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
