"""A cache's step observer (``make_cache(..., observe=fn)``): ``fn(layer, info)`` after every
update of a layer's state, with the step's ``velox.decode.StepInfo``; the tokens are those of
an unobserved run, and an observed cache never takes the whole model's compiled step."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import velox  # noqa: F401
from velox.adapters import model_step
from velox.adapters.mlxlm import make_cache

PROMPT = mx.array([(7 * i + 3) % 97 for i in range(40)])


def _decode(model, caches, n=16):
    return [int(y) for (y, _), _ in zip(generate_step(PROMPT, model, prompt_cache=caches,
                                                      prefill_step_size=16), range(n))]


def _log():
    seen = []
    return seen, lambda layer, info: seen.append((layer, info))


def test_an_observed_eviction_reports_what_each_step_kept_and_dropped(tiny_llama):
    want = _decode(tiny_llama, make_cache(tiny_llama, "tova", budget=16))
    seen, fn = _log()
    model_step.reset(tiny_llama)
    caches = make_cache(tiny_llama, "tova", budget=16, observe=fn)
    assert _decode(tiny_llama, caches) == want  # observing changes nothing
    assert all(c.last_step != "compiled" for c in caches)
    assert model_step.decode_steps(tiny_llama)["compiled"] == 0
    n_layers = len(caches)
    assert {layer for layer, _ in seen} == set(range(n_layers))
    for layer, cache in enumerate(caches):
        infos = [info for i, info in seen if i == layer]
        stored = [np.array(info.stored) for info in infos]
        evicted = [np.array(info.evicted) for info in infos]
        # every token taken is either held at the end or dropped by exactly one step
        assert int(stored[-1].min()) == int(stored[-1].max()) == 16
        assert (sum(evicted) + stored[-1] == cache.offset).all()
        assert all((s <= 16).all() for s in stored)
        # decode steps of a full cache drop one token per kv head
        assert (evicted[-1] == 1).all()
        assert infos[-1].nbytes == cache.nbytes
        # an exact method holds its rows exactly
        assert all(float(info.key_error.max()) == 0.0 == float(info.value_error.max()) for info in infos)


def test_an_observed_quantizer_reports_its_quantization_error(tiny_llama):
    seen, fn = _log()
    caches = make_cache(tiny_llama, "turboquant_mse", observe=fn)
    _decode(tiny_llama, caches, n=6)
    k, v = velox.get_kv(caches[0].velox_state)
    errs = [float(info.key_error.max()) for layer, info in seen if layer == 0]
    assert len(errs) >= 6 and all(e > 0 for e in errs)
    assert all(float(info.evicted.max()) == 0 for _, info in seen)  # every token is kept


def test_observe_is_checked_settable_and_shared_by_copies(tiny_llama):
    with pytest.raises((TypeError, ValueError), match="observe"):  # (the type hint, where checked)
        make_cache(tiny_llama, "tova", budget=16, observe="log")
    seen, fn = _log()
    caches = make_cache(tiny_llama, "tova", budget=16)
    model_step.reset(tiny_llama)
    _decode(tiny_llama, caches, n=8)
    assert caches[0].last_step == "compiled" and not seen
    for c in caches:
        c.observe = fn  # from the next step on
    gen = generate_step(mx.array([5]), tiny_llama, prompt_cache=caches)
    for _ in range(3):
        next(gen)
    assert seen and caches[0].last_step != "compiled"
    twin = copy.deepcopy(caches[0])
    assert twin.observe is fn
    for c in caches:
        c.observe = None
    n = len(seen)
    for _ in range(4):
        next(gen)
    assert caches[0].last_step == "compiled" and len(seen) <= n + len(caches)
