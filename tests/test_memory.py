"""Live memory of a long decode follows the bytes a state reports, for every registered method
and through the mlx-lm adapter.

Each method streams 800 single-token updates after a short prefill, the state
evaluated every step as a decoding loop does. With MLX's buffer cache cleared, the growth of
``mx.get_active_memory()`` must stay within 3% of the growth of ``velox.nbytes`` plus
``SLACK``: the cache of shared constants (``velox.evict.CONST_BYTES``, index arrays and
masks, bounded in bytes) and 64 KiB for MLX's own small allocations (so a leak of more than
about 1.4 KiB a step fails). A state, a graph or a
cache that kept one array per step alive grows with the stream and fails.

Through the adapter, the live memory a decode leaves is the caches' ``nbytes`` plus
``ADAPTER_SLACK``, with ``cache.state`` read at every step or not.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests._helpers import every_method

import velox
from velox import evict
from velox.registry import get_method, method_keys

pytestmark = pytest.mark.unchecked

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


@pytest.mark.parametrize("key", every_method())
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


# --- through the mlx-lm adapter -------------------------------------------------------------

# Live bytes a prompt cache may hold beyond its ``nbytes`` after a decode: MLX's own small
# allocations (the last step's token, the compiled steps' bookkeeping). The constants of
# velox.evict exist from the warm-up run already.
ADAPTER_SLACK = 256 << 10


@pytest.fixture(scope="module")
def llama_8l():
    """A random llama whose cache at budget 256 holds ~4 MiB (8 layers, 4 kv heads of 64)."""
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=512,
        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=97,
        rope_theta=10000.0))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("read_state", [True, False], ids=["state-read", "tokens-only"])
@pytest.mark.parametrize("key, params", [("tova", dict(budget=256)), ("h2o", dict(budget=256)),
                                         ("streaming_llm", dict(window_size=256))])
def test_adapter_live_memory_is_what_the_caches_report(llama_8l, key, params, read_state):
    """A prefill past the budget, then 40 decode steps, each evaluating the token and (as
    mlx-lm's prompt-cache code and many harnesses do) every cache's ``state``: the live
    memory the caches leave is their ``nbytes`` plus ``ADAPTER_SLACK``, not a second state
    (the adapter holds no state it has left behind)."""
    from velox.adapters.mlxlm import cache_nbytes, make_cache

    def run(steps):
        caches = make_cache(llama_8l, key, **params)
        logits = llama_8l(mx.array([[i % 90 + 1 for i in range(296)]]), cache=caches)
        mx.eval(logits, [c.state for c in caches])
        tok = mx.argmax(logits[:, -1:], axis=-1)
        for _ in range(steps):
            tok = mx.argmax(llama_8l(tok, cache=caches)[:, -1:], axis=-1)
            mx.eval(tok, [c.state for c in caches] if read_state else [])
        assert caches[0].last_step == "compiled"  # the whole model's compiled step ran
        return caches

    run(4)  # warm: compiled steps and velox.evict's constants exist before the measure
    mx.clear_cache()
    mem0 = mx.get_active_memory()
    caches = run(40)
    mx.clear_cache()
    live, reported = mx.get_active_memory() - mem0, cache_nbytes(caches)
    assert reported > 4 << 20
    assert live <= reported + ADAPTER_SLACK, (
        f"{key}: {live / 2**20:.2f} MiB live, the caches report {reported / 2**20:.2f} MiB")
