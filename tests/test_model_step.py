"""The whole model's compiled decode step (``velox.adapters.model_step``): through mlx-lm's
own ``generate_step`` it gives the tokens of the layer-by-layer path, is traced once for a
whole decode, takes only steady velox caches, and leaves other caches and calls alone."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import velox  # noqa: F401
from velox.adapters import model_step
from velox.adapters.mlxlm import make_cache

from tests._helpers import every_method

PROMPT = mx.array([(7 * i + 3) % 97 for i in range(40)])
STEADY = [("tova", {"budget": 16}), ("h2o", {"budget": 16, "grace": 4}), ("knorm", {"budget": 16, "recent": 4}),
          ("streaming_llm", {"window_size": 12}), ("tova", {"budget": 16, "per_head": True})]


def _decode(model, caches, n=24):
    return [int(y) for (y, _), _ in zip(generate_step(PROMPT, model, prompt_cache=caches,
                                                      prefill_step_size=16), range(n))]


@pytest.mark.parametrize("key,params", STEADY, ids=[f"{k}-{i}" for i, (k, _) in enumerate(STEADY)])
def test_compiled_step_gives_the_layer_by_layer_tokens(tiny_llama, key, params):
    plain = make_cache(tiny_llama, key, compile=False, **params)
    want = _decode(tiny_llama, plain)
    model_step.reset(tiny_llama)
    fast = make_cache(tiny_llama, key, **params)
    got = _decode(tiny_llama, fast)
    assert got == want
    assert all(c.last_step == "compiled" for c in fast)
    assert list(model_step.compiled_steps(tiny_llama).values()) == [1]  # traced once
    assert [c.offset for c in fast] == [c.offset for c in plain]
    for a, b in zip(fast, plain):
        assert a.nbytes == b.nbytes
        np.testing.assert_array_equal(np.array(a.positions()), np.array(b.positions()))
        ka, kb = a.velox_state.keys, b.velox_state.keys
        assert ka.shape == kb.shape


@pytest.mark.parametrize("key,params", [("chunkkv", {"budget": 16, "chunk_size": 4, "reuse_layers": 2, "grace": 4}),
                                        ("squeeze", {"budget": 16, "grace": 4})])
def test_cross_layer_methods_take_it_with_their_record(tiny_llama, key, params):
    """A cross-layer method's model-level record is an input and an output of the compiled
    step, threaded through the layers' ``layer_update`` inside it: the tokens, kept positions
    and record of the layer-by-layer path, traced at most twice (the record the prefill left
    may differ in a static field from a decode step's: ChunkKV's candidate count)."""
    from velox.decode import arrays
    plain = make_cache(tiny_llama, key, compile=False, **params)
    want = _decode(tiny_llama, plain)
    model_step.reset(tiny_llama)
    fast = make_cache(tiny_llama, key, **params)
    assert _decode(tiny_llama, fast) == want
    assert all(c.last_step == "compiled" for c in fast)
    assert 1 <= list(model_step.compiled_steps(tiny_llama).values())[0] <= 2
    for a, b in zip(fast, plain):
        np.testing.assert_array_equal(np.array(a.positions()), np.array(b.positions()))
    for x, y in zip(arrays(fast[0]._model.record), arrays(plain[0]._model.record)):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_only_steady_velox_caches_take_it(tiny_llama):
    model_step.reset(tiny_llama)
    # a prefill-bounded method keeps every decode token: its state grows, never steady
    snap = make_cache(tiny_llama, "snapkv", budget=16, obs_window=4)
    _decode(tiny_llama, snap)
    assert all(c.last_step != "compiled" for c in snap)
    # a journal (rollback), an append tail, the proxy: the layer-by-layer path
    for kw in ({"rollback": 2}, {"decode": "append"}, {"real_queries": False}):
        caches = make_cache(tiny_llama, "tova", budget=16, **kw)
        _decode(tiny_llama, caches)
        assert all(c.last_step != "compiled" for c in caches), kw
    assert model_step.compiled_steps(tiny_llama) == {}
    # mlx-lm's own caches go through the original call, unchanged
    full = make_prompt_cache(tiny_llama)
    assert _decode(tiny_llama, full) == _decode(tiny_llama, make_prompt_cache(tiny_llama))
    assert model_step.compiled_steps(tiny_llama) == {}


def test_a_chunk_after_compiled_steps_runs_layer_by_layer(tiny_llama):
    caches = make_cache(tiny_llama, "tova", budget=16)
    ref = make_cache(tiny_llama, "tova", budget=16, compile=False)
    for c in (caches, ref):
        _decode(tiny_llama, c, n=12)
    assert caches[0].last_step == "compiled"
    chunk = mx.array([[5, 9, 11, 2]])
    a, b = tiny_llama(chunk, cache=caches), tiny_llama(chunk, cache=ref)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    assert caches[0].last_step != "compiled" and caches[0].offset == ref[0].offset


def test_install_wraps_the_class_once_and_uninstall_restores(tiny_llama):
    cls = type(tiny_llama)
    make_cache(tiny_llama, "tova", budget=16)
    wrapped = cls.__call__
    make_cache(tiny_llama, "tova", budget=16)
    assert cls.__call__ is wrapped and wrapped.__wrapped__ is not None
    model_step.uninstall(tiny_llama)
    assert cls.__call__ is wrapped.__wrapped__
    caches = make_cache(tiny_llama, "tova", budget=16)  # installs again
    assert cls.__call__ is not wrapped.__wrapped__
    _decode(tiny_llama, caches)
    assert caches[0].last_step == "compiled"


def test_live_memory_stays_flat_over_compiled_steps(tiny_llama):
    caches = make_cache(tiny_llama, "tova", budget=16)
    gen = generate_step(PROMPT, tiny_llama, prompt_cache=caches, prefill_step_size=16)
    for _ in range(8):
        next(gen)
    mx.eval([c.state for c in caches])
    mx.clear_cache()
    before = mx.get_active_memory()
    for _ in range(48):
        next(gen)
    mx.eval([c.state for c in caches])
    assert caches[0].last_step == "compiled"
    # the states are replaced every step: what stays live does not grow with the tokens
    assert mx.get_active_memory() - before < 64 * 1024


def _steady_keys():
    from velox import decode
    from velox.registry import get_method, method_keys
    return [k for k in method_keys() if decode.not_steady_because(get_method(k)) is None]


@pytest.mark.filterwarnings("ignore:.*no calibration artifact")
@pytest.mark.parametrize("key", every_method(_steady_keys()))
def test_every_steady_method_takes_it_at_its_defaults(tiny_llama, key):
    """Every method whose full state is steady (``velox.decode.not_steady_because`` is
    ``None``) decodes at its defaults in the whole model's compiled step, with the tokens of
    the layer-by-layer path; every other method says why not."""
    prompt = mx.array([(5 * i + 1) % 97 for i in range(560)])  # past the default budget of 512

    def run(**kw):
        caches = make_cache(tiny_llama, key, **kw)
        toks = [int(y) for (y, _), _ in zip(generate_step(prompt, tiny_llama, prompt_cache=caches), range(8))]
        return toks, caches

    want, _ = run(compile=False)
    got, caches = run()
    assert got == want
    assert all(c.last_step == "compiled" for c in caches)


def test_methods_that_cannot_take_it_say_why():
    from velox import decode
    from velox.registry import get_method, method_keys
    reasons = {k: decode.not_steady_because(get_method(k)) for k in method_keys()}
    assert reasons["tova"] is None and reasons["h2o"] is None
    assert "grows" in reasons["snapkv"] and "grows" in reasons["kivi"]
    assert reasons["squeeze"] is None and reasons["chunkkv"] is None  # with their record
    assert all(r is None or (isinstance(r, str) and r) for r in reasons.values())


def test_the_design_notes_list_what_each_method_decodes_with():
    from pathlib import Path

    from velox import decode
    from velox.registry import get_method, method_keys
    text = (Path(__file__).parent.parent / "docs" / "design" / "decode.md").read_text()
    table = text.split("<!-- steady-table -->\n", 1)[1].split("<!-- /steady-table -->", 1)[0]
    for k in method_keys():
        r = decode.not_steady_because(get_method(k))
        assert f"| {k} | " + ("whole model, compiled" if r is None else "layer by layer: " + r) + " |" in table, k


def test_the_compiled_steps_go_with_their_model():
    import gc

    from mlx_lm.models import llama
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                           rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    caches = make_cache(model, "tova", budget=16)
    _decode(model, caches, n=12)
    assert caches[0].last_step == "compiled" and model_step.compiled_steps(model)
    key = id(model)
    del model, caches
    gc.collect()
    assert key not in model_step._STEPS


def test_batch_generate_takes_it_for_a_joined_batch(tiny_llama):
    """mlx-lm's ``batch_generate`` (the loop of ``BatchGenerator``, which ``velox serve``
    runs too): once the rows are joined into one steady state, each step is the compiled
    whole-model step with every row at its own offset, giving each row the tokens and kept
    positions of the layer-by-layer path; a batch traced once per batch size (a row that
    finishes leaves a smaller batch)."""
    from types import SimpleNamespace

    from mlx_lm import batch_generate

    tokenizer = SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
    prompts = [[(5 * i + 3) % 97 for i in range(20)], [(7 * i + 1) % 97 for i in range(26)],
               [(11 * i + 2) % 97 for i in range(23)]]

    def run(**kw):
        model_step.reset(tiny_llama)
        caches = [make_cache(tiny_llama, "tova", budget=10, **kw) for _ in prompts]
        r = batch_generate(tiny_llama, tokenizer, prompts, prompt_caches=caches,
                           max_tokens=[30, 24, 30], prefill_step_size=8, return_token_ids=True,
                           return_prompt_caches=True)
        return r, model_step.compiled_steps(tiny_llama)

    plain, none = run(compile=False)
    fast, traces = run()
    assert none == {}
    assert fast.token_ids == plain.token_ids
    assert list(traces.values()) == [2]  # batch sizes 3 and 2
    for got, want in zip(fast.caches, plain.caches):
        assert all(c.last_step == "compiled" for c in got)
        for a, b in zip(got, want):
            assert (a.offset, a.nbytes) == (b.offset, b.nbytes)
            np.testing.assert_array_equal(np.array(a.positions()), np.array(b.positions()))


def test_decode_steps_counts_how_each_single_token_call_ran(tiny_llama):
    model_step.reset(tiny_llama)
    assert model_step.decode_steps(tiny_llama) == {"compiled": 0, "layer_by_layer": 0}
    _decode(tiny_llama, make_cache(tiny_llama, "tova", budget=16), n=24)
    tova = model_step.decode_steps(tiny_llama)
    # the first steps fill the state layer by layer; once steady every step is compiled
    assert tova["compiled"] > 20 and tova["layer_by_layer"] >= 1
    _decode(tiny_llama, make_cache(tiny_llama, "snapkv", budget=16, obs_window=4), n=24)
    after = model_step.decode_steps(tiny_llama)
    assert after["compiled"] == tova["compiled"]  # a state that grows: never compiled
    # the same loop makes the same single-token calls, all of them layer by layer
    assert after["layer_by_layer"] == tova["layer_by_layer"] + sum(tova.values())
    _decode(tiny_llama, make_prompt_cache(tiny_llama), n=8)  # mlx-lm's own caches: not counted
    assert model_step.decode_steps(tiny_llama) == after
    model_step.reset(tiny_llama)
    assert model_step.decode_steps(tiny_llama) == {"compiled": 0, "layer_by_layer": 0}
