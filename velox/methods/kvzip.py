"""KVzip: keep the tokens a context-reconstruction pass relies on most; query-agnostic.

Rule (``probe="context"``): a candidate's importance is the maximum attention it has received
from any probe query, over the probes and the query heads of its kv head. The probes of an
update are the queries given to it, taken as reconstruction queries: run the model over the
repeated context ("Repeat the previous context:" + the chunk; the adapter's
``reconstruction_prefill`` does this) and pass that pass's queries with the chunk's keys and
values; each probe reads every candidate (stored + new), as a reconstruction pass reads the
whole context. Without queries the new tokens' keys are the probes (key-as-query proxy; for
the first chunk every candidate's key). Importance is carried between updates as a running
maximum, so a decode step costs one probe against the cache. ``probe="latest"`` scores by the
chunk's newest query alone, averaged over the group (TOVA's rule). Sinks are protected; the
``budget`` best candidates are kept; a chunk is one selection.

Backends: ``reference``, ``mlx`` and ``cuda`` (a decode step at a full cache: one fused
kernel for the probe's weights (max or mean over the group) and the running maximum, one that
finds the loser and moves the rows and importance; every other step runs the ``mlx`` ops).
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from .. import evict
from .. import reference as ref
from .._typing import Array, Float
from ..attention import candidate_weights, scoring_queries, softmax
from ..distributed import LOCAL, Heads
from ..registry import register

__all__ = ["KVzipState", "State", "init", "update", "get_kv", "nbytes", "kvzip_importance"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, probe: str = "context", per_head: bool = True,
         heads: Heads = LOCAL, backend: str = "auto") -> KVzipState:
    """Empty KVzip state keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head, sinks included.
        n_sink: leading tokens never evicted.
        probe: context: max attention from every probe (given queries, else every candidate
            key); latest: the newest query alone (TOVA).
        per_head: each kv head keeps its own tokens (false: one set per layer, importance
            averaged over heads).
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): one
            selection for the layer gathers every shard's importance.
    """
    return evict.empty_state(KVzipState, locals())


KVzipState = State = evict.state_type(
    "KVzipState", init,
    "Kept rows, their absolute positions and the best probe attention each has received.",
    importance=Float[Array, "b h n"])


def kvzip_importance(probes: Float[Array, "b h g m d"], stored: Float[Array, "b h n d"],
                     new: Float[Array, "b h s d"], block: int = 256) -> Float[Array, "b h ns"]:
    """Max attention each of ``n + s`` candidates receives from any probe (no causal mask).

    Probes go in blocks of ``block`` so ``n + s`` probes never hold every weight at once.
    """
    b, h, g, m, d = probes.shape
    scale = d ** -0.5
    # stored and new keys are scored apart: no concatenated copy of the cache
    parts = [p.astype(mx.float32).swapaxes(-1, -2) for p in (stored, new) if p.shape[2]]
    best = None
    for start in range(0, m, block):
        q = probes[:, :, :, start:start + block].astype(mx.float32) * scale
        q = q.reshape(b, h, -1, d)
        logits = [q @ kt for kt in parts]
        logits = mx.concatenate(logits, axis=-1) if len(logits) > 1 else logits[0]
        w = softmax(logits).max(axis=2)
        best = w if best is None else mx.maximum(best, w)
    return best


def _score(state: KVzipState, keys, values, queries, evicting) -> evict.Scored:
    """This update's probe attention (``current``) folded into the running maximum; the
    score is ``current`` with ``probe="latest"``, else the importance."""
    s = keys.shape[2]
    probes = scoring_queries(keys, queries)
    if state.probe == "latest":  # TOVA: the newest query, averaged over its group
        current = candidate_weights(probes[:, :, :, -1:], state.keys, keys)[:, :, :, 0].mean(axis=2)
    else:
        current = kvzip_importance(probes, state.keys, keys)
    carried = mx.concatenate([state.importance, mx.zeros(current.shape[:2] + (s,), mx.float32)], 2)
    importance = mx.maximum(carried, current)
    return evict.Scored(current if state.probe == "latest" else importance,
                        {"importance": importance})


def _score_reference(state: KVzipState, head: ref.Head) -> evict.Scored:
    pos, d = head.positions, head.keys.shape[1]
    if state.probe == "latest":  # causal attention of the newest query, group mean
        current = ref.attention_weights(head.probes[:, -1:], head.keys, pos, pos[-1:])[:, 0].mean(0)
    else:  # each probe reads every candidate; a candidate keeps its best probe
        q = head.probes.reshape(-1, d)
        current = ref.softmax(q @ head.keys.astype(np.float64).T / np.sqrt(d)).max(axis=0)
    importance = np.maximum(np.concatenate([head.carried["importance"], np.zeros(head.s)]), current)
    return evict.Scored(current if state.probe == "latest" else importance,
                        {"importance": importance})


def _kernel_inputs(state: KVzipState, keys, values, queries) -> dict:
    """The fused decode step's input: the probe's weights (mean over the group with
    ``probe="latest"``, else the max) and the running maximum."""
    from ..kernels.evict import weights
    latest = state.probe == "latest"
    current, importance = weights(queries, state.keys, keys, old=state.importance,
                                  accumulate="max", group="mean" if latest else "max")
    return dict(by=current if latest else importance, carry=importance)


def _select_args(state: KVzipState) -> dict:
    """The same rule in ``velox.kernels.evict.attend_select`` (a whole decode step): ranked by
    the probe's weights or the running maximum it carries."""
    latest = state.probe == "latest"
    return dict(by="weights" if latest else "carried", accumulate="max", old=state.importance,
                group="mean" if latest else "max", carry=True)


_kernel = evict.ScoreKernel(_kernel_inputs, select_args=_select_args)


method = register("kvzip", KVzipState, init,
                  evict.score_and_keep(_score, _score_reference, kernel=_kernel,
                                       carry=("importance",)))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
