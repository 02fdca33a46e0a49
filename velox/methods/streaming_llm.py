"""StreamingLLM: keep the attention sinks and a window of the most recent tokens.

No score: the ``n_sink`` first tokens and the ``window_size`` newest are the protected slots
of the eviction skeleton, and they fill the capacity. Backends: ``reference``, ``mlx`` and
``cuda`` (fused kernels for a decode step at a full cache, ``velox.kernels.evict``; every
other step runs the ``mlx`` ops).
"""

from __future__ import annotations

import mlx.core as mx

from .. import evict
from ..registry import register

__all__ = ["StreamingLLMState", "State", "init", "update", "get_kv", "nbytes"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         n_sink: int = 4, window_size: int = 512, slack: int = 0,
         backend: str = "auto") -> StreamingLLMState:
    """Empty state keeping ``n_sink`` sinks and the ``window_size`` newest tokens.

    Args:
        n_sink: leading tokens (attention sinks) never evicted.
        window_size: most recent tokens kept besides the sinks.
        slack: rows held beyond the sinks and the window: a full state drops its
            ``slack + 1`` oldest non-sink tokens at once, and the next ``slack`` tokens fill
            the freed slots (the window then spans ``window_size`` to ``window_size +
            slack`` tokens; 0 = the paper's fixed window).
    """
    return evict.empty_state(StreamingLLMState, locals())


StreamingLLMState = State = evict.state_type(
    "StreamingLLMState", init,
    "Sinks + recency window. ``positions`` are absolute; ``next_pos`` = tokens seen.")


def _kernel_inputs(state: StreamingLLMState, keys, values, queries):
    # the loser is the oldest non-sink token, or the new one when there is no window
    return dict(drop=state.n_sink if state.window_size else state.keys.shape[2])


# a whole decode step in kernels.evict.attend_select: no score, the protected tokens stay and
# the oldest other goes, as the per-token select decides it
_kernel = evict.ScoreKernel(_kernel_inputs, select_args=lambda state: dict(by="none"))


method = register("streaming_llm", StreamingLLMState, init,
                  evict.score_and_keep(None, None, kernel=_kernel))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
