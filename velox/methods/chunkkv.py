"""ChunkKV: evict whole chunks of ``chunk_size`` consecutive tokens, scored together.

Tokens are scored as in H2O (``score="attn_mass"``: accumulated attention with ``grace``,
``decay`` and the chunk rule below; :func:`velox.methods.h2o.heavy_hitter_scores`) or by key
norm (``"key_norm"``, high = important, fixed at insertion). Absolute positions are cut into
fixed chunks ``[c * chunk_size, (c + 1) * chunk_size)``; a chunk's score is the mean score of
its members among the candidates (stored + new), every member takes its chunk's score, and the
``budget`` best candidates are kept, so whole chunks survive except at most one per selection,
which keeps its newest members (the tie rule). A multi-token chunk of input is one selection.
``chunk_size = 1`` is H2O exactly. Across layers (``model_init`` / ``layer_update``), layers
come in blocks of ``reuse_layers``: the first of a block selects, the others keep exactly its
kept positions.

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache: H2O's fused
weights kernel, or the new key's norm, then one kernel that takes each candidate's chunk mean,
finds the loser and moves the rows and scores; every other step, and the leaders of reused
layers, run the ``mlx`` ops).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float, Int
from ..crosslayer import checked_update, layer_params
from ..distributed import LOCAL, Heads, head_gather
from ..heavy_hitters import heavy_hitter_kernel, heavy_hitter_reference, heavy_hitter_scores
from ..registry import register

__all__ = ["ChunkKVState", "ChunkKVRecord", "State", "init", "update", "get_kv", "nbytes"]


class ChunkKVRecord(NamedTuple):
    """Model-level record: the latest leader layer's selection, reused by its followers."""

    index: Int[Array, "b h k"]   # kept candidate indices (empty until layer 0 runs)
    scores: Float[Array, "b h k"]
    candidates: int              # the leader's candidate count (stored + new)
    reuse_layers: int


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, chunk_size: int = 8, n_sink: int = 4, score: str = "attn_mass",
         reuse_layers: int = 1, grace: int = 16, decay: float = 0.98, per_head: bool = True,
         heads: Heads = LOCAL, backend: str = "auto") -> ChunkKVState:
    """Empty ChunkKV state keeping at most ``budget`` tokens per head (sinks included).

    Args:
        budget: tokens kept per head, sinks included.
        chunk_size: tokens per chunk (fixed runs of absolute positions); 1 = h2o.
        n_sink: leading tokens never evicted.
        score: token score: accumulated attention (as h2o) or key L2 norm (high = important).
        reuse_layers: layers per block sharing the first layer's kept positions (1 = every
            layer selects).
        grace: newest tokens never evicted (h2o's grace; not in the seed, added with h2o's
            default).
        decay: multiplier applied to accumulated scores at every token (h2o's decay; not in
            the seed, added with h2o's default).
        per_head: each kv head selects its own chunks (false = the paper: one selection per
            layer).
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): one
            selection for the layer gathers every shard's token scores.
    """
    return evict.empty_state(ChunkKVState, locals())


ChunkKVState = State = evict.state_type(
    "ChunkKVState", init,
    "Kept rows, their absolute positions and per-token ``scores`` (attention mass or key norm).",
    scores=Float[Array, "b h n"])


def _chunk_mean_mlx(scores: mx.array, positions: mx.array, size: int) -> mx.array:
    """Each candidate's chunk mean: candidates are position-sorted, so chunks are contiguous runs.

    On the CPU a run's sum is a difference of float64 prefix sums at the run's ends (found by
    a running max / min of the run boundaries), ~4x faster there than scatter-adds and exact
    to float32 rounding; devices without float64 scatter-add the runs.
    """
    b, h, N = scores.shape
    cid = positions // size
    change = cid[:, :, 1:] != cid[:, :, :-1]
    edge = mx.ones((b, h, 1), mx.bool_)
    start = mx.concatenate([edge, change], axis=2)  # a run (chunk) begins here
    if mx.default_device() == mx.cpu:
        t = mx.arange(N, dtype=mx.int32)
        first = mx.cummax(mx.where(start, t, 0), axis=2)
        last = mx.cummin(mx.where(mx.concatenate([change, edge], axis=2), t, N - 1), axis=2,
                         reverse=True)
        prefix = mx.cumsum(scores.astype(mx.float64), axis=2)
        prefix = mx.concatenate([mx.zeros((b, h, 1), mx.float64), prefix], axis=2)
        total = (mx.take_along_axis(prefix, last + 1, axis=2)
                 - mx.take_along_axis(prefix, first, axis=2))
        return (total / (last - first + 1).astype(mx.float64)).astype(mx.float32)
    run = mx.cumsum(start.astype(mx.int32), axis=2) - 1            # chunk rank within the row
    flat = (run + evict.row_offsets(b, h, N)).reshape(-1)
    sums = mx.zeros((b * h * N,), mx.float32).at[flat].add(scores.reshape(-1))
    counts = mx.zeros((b * h * N,), mx.float32).at[flat].add(mx.ones((b * h * N,), mx.float32))
    return (sums[flat] / counts[flat]).reshape(b, h, N)


def _token_scores(state: ChunkKVState, keys, values, queries) -> evict.Scored:
    """Every candidate's token score (stored ++ new) and the new carried ``scores``: H2O's
    accumulated attention, or the stored norms with the new keys' norms."""
    if state.score == "attn_mass":
        return heavy_hitter_scores(state, keys, values, queries)
    old, new = state.scores, evict.row_norms(keys)
    return evict.Scored(mx.concatenate([old, new], axis=2), {"scores": (old, new)})


def _select_mlx(state: ChunkKVState, keys, values, queries) -> tuple[ChunkKVState, mx.array | None]:
    n, s = state.keys.shape[2], keys.shape[2]
    tokens = _token_scores(state, keys, values, queries)
    old, new = tokens.updates["scores"]
    new_pos = evict.new_positions(state.next_pos, s)
    idx = None
    if n + s > state.budget:
        scores, cand_pos = tokens.scores, mx.concatenate([state.positions, new_pos], axis=2)
        if not state.per_head:  # one selection per layer: every head holds the same positions
            scores = head_gather(state.heads, scores).mean(axis=1, keepdims=True)
            cand_pos = cand_pos[:, :1]
        chunk = _chunk_mean_mlx(scores, cand_pos, state.chunk_size)
        idx = evict.top_budget(chunk, state.budget, evict.protected(n + s, state.n_sink, state.grace))
        idx = mx.broadcast_to(idx, state.positions.shape[:2] + idx.shape[2:])
    k, v, p, sc = evict.keep_rows((state.keys, state.values, state.positions, old),
                                  (keys, values, new_pos, new), idx)
    return state._replace(keys=k, values=v, positions=p, scores=sc, next_pos=state.next_pos + s), idx


def _update_mlx(state: ChunkKVState, keys, values, queries) -> ChunkKVState:
    return _select_mlx(state, keys, values, queries)[0]


def _decode_cuda(state: ChunkKVState, keys, values, queries) -> ChunkKVState:
    from ..kernels.evict import compact
    if state.score == "attn_mass":  # H2O's fused weights kernel accumulates the step
        args = heavy_hitter_kernel.inputs(state, keys, values, queries)
    else:
        scores = (state.scores, evict.row_norms(keys))
        args = dict(by=scores, carry=scores)
    return evict.with_compacted(state, compact(
        state.keys, state.values, state.positions, keys, values, state.next_pos, **args,
        chunk_size=state.chunk_size, shared=not state.per_head, n_sink=state.n_sink,
        recent=state.grace))


def _chunk_mean_reference(scores: np.ndarray, positions: np.ndarray, size: int) -> np.ndarray:
    """One row: the mean score of each candidate's chunk ``position // size``."""
    cid = positions // size
    return np.array([scores[cid == c].mean() for c in cid])


def _select_reference(state: ChunkKVState, keys, values, queries):
    c = ref.candidates(state, keys, values, queries)
    b, h, N = c.positions.shape
    old = ref.to_np(state.scores)
    tokens = np.zeros((b, h, N))
    for i in range(b):
        for j in range(h):
            if state.score == "attn_mass":
                head = ref.head(c, i, j, {"scores": old[i, j]}, N > state.budget)
                tokens[i, j] = heavy_hitter_reference(state, head)[0]
            else:
                new = np.linalg.norm(c.new_keys[i, j], axis=-1)
                tokens[i, j] = np.concatenate([old[i, j], new])
    chosen = [[None] * h for _ in range(b)]
    if N > state.budget:
        # one selection for the layer: every shard's heads (velox.distributed)
        shared = tokens if state.per_head else head_gather(state.heads, tokens)
        for i in range(b):
            rows = [shared[i].mean(axis=0)] if not state.per_head else tokens[i]
            for j, row in enumerate(rows):
                pos = c.positions[i, j]
                chunk = _chunk_mean_reference(row, pos, state.chunk_size)
                keep = ref.protected(pos, c.total[i, j], state.n_sink, state.grace)
                chosen[i][j] = ref.top_budget(chunk, state.budget, keep)
            if not state.per_head:
                chosen[i] = [chosen[i][0]] * h
    return ref.keep(state, c, chosen, scores=tokens), chosen


def _update_reference(state: ChunkKVState, keys, values, queries) -> ChunkKVState:
    return _select_reference(state, keys, values, queries)[0]


def _model_init(per_layer_params: list[dict[str, Any]]) -> ChunkKVRecord:
    """The ``model_init`` hook: an empty record; layers ``l % reuse_layers == 0`` lead."""
    _, reuse = layer_params("chunkkv", per_layer_params, "reuse_layers")
    return ChunkKVRecord(index=mx.zeros((0, 0, 0), mx.int32), scores=mx.zeros((0, 0, 0), mx.float32),
                         candidates=0, reuse_layers=reuse)


def _layer_update(record: ChunkKVRecord, layer: int, state: ChunkKVState,
                  keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"], *,
                  queries: Float[Array, "b q s d"] | None = None) -> tuple[ChunkKVRecord, ChunkKVState]:
    """The ``layer_update`` hook: a leader selects and publishes; a follower keeps the same rows.
    Without followers (``reuse_layers=1``) it is the layer's own update (kernels included)."""
    if record.reuse_layers == 1:
        return record, update(state, keys, values, queries=queries)
    checked_update(state, keys, values, queries)
    n, s = state.keys.shape[2], keys.shape[2]
    if layer % record.reuse_layers == 0:
        if state.backend == "reference":
            state, chosen = _select_reference(state, keys, values, queries)
            idx = None if chosen[0][0] is None else mx.array(np.array(chosen, dtype=np.int32))
        else:
            state, idx = _select_mlx(state, keys, values, queries)
        if idx is None:
            idx = mx.broadcast_to(mx.arange(n + s, dtype=mx.int32), state.positions.shape)
        return record._replace(index=idx, scores=state.scores, candidates=n + s), state
    if n + s != record.candidates:
        raise ValueError(f"follower layer {layer} has {n} + {s} candidates, its leader had "
                         f"{record.candidates}: reused layers must see the same tokens")
    idx = None if record.index.shape[2] == n + s else record.index
    k, v, p = evict.keep_rows((state.keys, state.values, state.positions),
                              (keys, values, evict.new_positions(state.next_pos, s)), idx)
    state = state._replace(keys=k, values=v, positions=p, scores=record.scores,
                           next_pos=state.next_pos + s)
    return record, state


method = register("chunkkv", ChunkKVState, init,
                  {"reference": _update_reference, "mlx": _update_mlx,
                   "cuda": evict.cuda_update(_update_mlx, lambda st: st.budget, _decode_cuda)},
                  model_init=_model_init, layer_update=_layer_update)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
