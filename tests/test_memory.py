"""Live memory of a long decode follows the bytes a state reports, for every registered method.

Each method streams 800 single-token updates after a short prefill, the state
evaluated every step as a decoding loop does. With MLX's buffer cache cleared, the growth of
``mx.get_active_memory()`` must stay within 3% of the growth of ``velox.nbytes`` plus
``SLACK``: the cache of shared constants (``velox.evict.CONST_BYTES``, index arrays and
masks, bounded in bytes) and 64 KiB for MLX's own small allocations (so a leak of more than
about 1.4 KiB a step fails). A state, a graph or a
cache that kept one array per step alive grows with the stream and fails.
"""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import evict
from velox.registry import get_method, method_keys

B, H, PREFILL, WARM, STEPS = 1, 2, 16, 80, 800
SLACK = evict.CONST_BYTES + (64 << 10)


def _state(key: str):
    m = get_method(key)
    d = 32  # rows wider than evict's narrow-row limit: appends take the gather path
    params = {"budget": 64} if "budget" in m.spec.params else {}
    try:
        return m.init(B, H, d, backend="mlx", **params), d
    except ValueError:  # a budget the method's constraints refuse: its defaults
        return m.init(B, H, d, backend="mlx"), d


@pytest.mark.parametrize("key", method_keys())
def test_live_memory_tracks_reported_bytes(key):
    state, d = _state(key)
    rng = np.random.default_rng(0)
    pool = [mx.array(rng.standard_normal((B, H, 1, d)).astype(np.float32)) for _ in range(64)]
    x = mx.array(rng.standard_normal((B, H, PREFILL, d)).astype(np.float32))
    mx.eval(pool, x)
    state = velox.update(state, x, x)
    mx.eval(state)
    for t in range(WARM):  # fill to capacity: the steady state's constants now exist
        state = velox.update(state, pool[t % 64], pool[(t + 7) % 64])
        mx.eval(state)
    mx.clear_cache()
    mem0, bytes0 = mx.get_active_memory(), velox.nbytes(state)
    for t in range(STEPS):
        state = velox.update(state, pool[t % 64], pool[(t + 7) % 64])
        mx.eval(state)
    mx.clear_cache()
    grew, reported = mx.get_active_memory() - mem0, velox.nbytes(state) - bytes0
    assert grew <= 1.03 * max(reported, 0) + SLACK, (
        f"{key}: live memory grew {grew} bytes over {STEPS} steps, nbytes {reported}")
