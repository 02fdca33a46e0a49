"""TOVA: evict the tokens the current query attends to least; memoryless.

A candidate's score is the attention the newest query pays it (averaged over the query heads
of its kv head; with ``per_head=False``, over every head of the layer, one selection for all).
Backends: ``reference``, ``mlx`` and ``cuda`` (fused kernels for a decode step at a full cache,
``velox.kernels.evict``; every other step runs the ``mlx`` ops). The score reads the stored keys
only as attention logits (``logits_only``): composed with a codec (``velox.compose``), the
stored tokens' logits are the codec's estimates from the key codes.
"""

from __future__ import annotations

import mlx.core as mx

from .. import evict
from .. import reference as ref
from ..attention import candidate_weights, head_weights, scoring_queries
from ..distributed import LOCAL, Heads
from ..registry import register

__all__ = ["TovaState", "State", "init", "update", "get_kv", "nbytes"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, per_head: bool = False, slack: int = 0,
         heads: Heads = LOCAL, backend: str = "auto") -> TovaState:
    """Empty TOVA state keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head, sinks included.
        n_sink: leading tokens never evicted (0 = the paper).
        per_head: each kv head keeps its own tokens (false = the paper: one set per layer,
            attention averaged over heads).
        slack: rows held beyond budget: a full state (budget + slack rows) keeps budget in
            one selection, and the next slack tokens fill the freed slots (0 = per token).
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): one
            selection for the layer gathers every shard's scores.
    """
    return evict.empty_state(TovaState, locals())


TovaState = State = evict.state_type(
    "TovaState", init, "Kept rows and their absolute positions; no score memory.")


def _score(state: TovaState, keys, values, queries, evicting):
    last = scoring_queries(keys, queries)[:, :, :, -1:]
    return candidate_weights(last, state.keys, keys)[:, :, :, 0].mean(axis=2)


def _score_reference(state: TovaState, head: ref.Head):
    pos = head.positions  # attention of the newest query, averaged over the group's heads
    return head_weights(head.probes[:, -1:], head.keys, pos, pos[-1:])[:, 0].mean(0)


def _kernel_inputs(state: TovaState, keys, values, queries, attend: bool = False):
    from ..kernels.evict import attend_weights, weights
    if attend:  # the step's attention output from the same softmax
        out, w, _ = attend_weights(queries, state.keys, state.values, keys, values)
        return dict(by=w, out=out)
    return dict(by=weights(queries, state.keys, keys)[0])


# a whole decode step in kernels.evict.attend_select: ranked by the step's weights
_kernel = evict.ScoreKernel(_kernel_inputs, attends=True, select_args=lambda state: dict(by="weights"))


method = register("tova", TovaState, init,
                  evict.score_and_keep(_score, _score_reference, kernel=_kernel, logits_only=True))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
