"""The adapter on the embedded SmolLM2 model: mlx-lm's generate and stream_generate, and one
short run of every registered method."""

import mlx.core as mx
import pytest

from tests._helpers import every_method
from mlx_lm import generate, stream_generate
from mlx_lm.generate import generate_step

import velox
from velox.adapters.mlxlm import cache_fp16_bytes, cache_nbytes, make_cache
from velox.registry import get_method, method_keys

pytestmark = [pytest.mark.model, pytest.mark.unchecked]

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
        "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
        "was the winter of despair, we had everything before us, we had nothing before us, we "
        "were all going direct to Heaven, we were all going direct the other way. ") * 3


def test_generate_and_stream_generate_with_a_velox_cache(smollm2):
    model, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    cache = make_cache(model, "tova", budget=64)
    text = generate(model, tok, prompt, max_tokens=12, prompt_cache=cache, prefill_step_size=16)
    assert "Paris" in text
    assert all(c.size() <= 64 for c in cache)
    cache = make_cache(model, "kivi", bits=4, residual_length=0)
    pieces = [r.text for r in stream_generate(model, tok, prompt, max_tokens=12, prompt_cache=cache)]
    assert "Paris" in "".join(pieces)
    st = cache[0].velox_state
    assert st.key_scales.shape[-1] >= 1  # whole groups of tokens were quantized
    assert cache_nbytes(cache) == sum(velox.nbytes(c.velox_state) for c in cache)


@pytest.mark.parametrize("key", every_method())
def test_every_method_runs_on_smollm2(smollm2, key):
    model, tok = smollm2
    tokens = mx.array(tok.encode(TEXT)[:240])
    spec = get_method(key).spec
    params = {}
    if "budget" in spec.params:
        params["budget"] = max(64, spec.defaults["budget"] // 8)
    if "window_size" in spec.params:
        params["window_size"] = 60
    caches = make_cache(model, key, **params)
    out = [int(t) for t, lp in generate_step(tokens, model, prompt_cache=caches, max_tokens=4,
                                             prefill_step_size=120)]  # two chunks, then decode
    assert len(out) == 4
    for c in caches:
        assert c.offset == len(tokens) + 4
        k, v = velox.get_kv(c.velox_state)
        assert bool(mx.isfinite(k).all()) and bool(mx.isfinite(v).all())
    cap = spec.capacity(get_method(key).spec.defaults | params)
    if cap is not None and cap < len(tokens):
        assert cache_nbytes(caches) < cache_fp16_bytes(caches)


@pytest.mark.parametrize("kw", [dict(kv_bits=4), dict(max_kv_size=64)])
def test_generate_refuses_what_a_velox_cache_cannot_honour(smollm2, kw):
    model, tok = smollm2
    cache = make_cache(model, "tova", budget=64)
    with pytest.raises(ValueError, match=next(iter(kw))):
        generate(model, tok, "Tell me a story.", max_tokens=4, prompt_cache=cache, **kw)
    assert all(c.empty() for c in cache)
