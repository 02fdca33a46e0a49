"""H2O: keep the heavy hitters, the tokens with the largest accumulated attention.

A candidate's score is the attention it has received, accumulated over every query since it
arrived (decayed by ``decay`` per token) and carried in the state (``velox.heavy_hitters``). Backends: ``reference``,
``mlx`` and ``cuda`` (fused kernels for a decode step at a full cache, ``velox.kernels.evict``;
every other step runs the ``mlx`` ops). The score reads the stored keys only as attention
logits (``logits_only``): composed with a codec (``velox.compose``), the attention it
accumulates over the stored tokens comes from the codec's estimates on the key codes.
"""

from __future__ import annotations

import mlx.core as mx

from .. import evict
from .._typing import Array, Float
from ..heavy_hitters import heavy_hitter_kernel, heavy_hitter_reference, heavy_hitter_scores
from ..registry import register

__all__ = ["H2OState", "State", "init", "update", "get_kv", "nbytes"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         budget: int = 512, n_sink: int = 4, grace: int = 16, decay: float = 0.98,
         slack: int = 0, backend: str = "auto") -> H2OState:
    """Empty H2O state keeping at most ``budget`` tokens per head.

    Args:
        budget: tokens kept per head, sinks included.
        n_sink: leading tokens never evicted.
        grace: newest tokens never evicted (they have had no time to accumulate attention).
        decay: multiplier applied to accumulated scores at every token (1 = no decay).
        slack: rows held beyond budget: a full state (budget + slack rows) keeps budget in
            one selection, and the next slack tokens fill the freed slots, their scores
            accumulating from their first step (0 = per token).
    """
    return evict.empty_state(H2OState, locals())


H2OState = State = evict.state_type(
    "H2OState", init,
    "Kept rows, their absolute positions and accumulated attention ``scores``.",
    scores=Float[Array, "b h n"])


method = register("h2o", H2OState, init,
                  evict.score_and_keep(heavy_hitter_scores, heavy_hitter_reference,
                                       kernel=heavy_hitter_kernel, carry=("scores",),
                                       logits_only=True))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
