"""KIVI holds its quantized groups in chunks and its residual window in a buffer of its
capacity (``velox.methods.kivi``): a token that joins the window is written in place, the
state holds what the appending layout held, and a state whose next token joins the window
takes the whole model's compiled decode step (``velox.adapters.model_step``); the step that
flushes a group runs layer by layer."""

import json

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import velox
from velox import decode
from velox.adapters import model_step
from velox.adapters.mlxlm import load_cache, make_cache, save_cache
from velox.methods import kivi
from velox.registry import get_method

PROMPT = mx.array([(7 * i + 3) % 97 for i in range(200)])
PARAMS = dict(bits=4, residual_length=16)  # a window of 16 to 47 tokens: a flush every 32


def _generate(model, caches, n, prompt=PROMPT):
    toks, steps = [], []
    for (y, _), _ in zip(generate_step(prompt, model, prompt_cache=caches), range(n)):
        toks.append(int(y))
        steps.append(caches[0].last_step)
    return toks, steps


def test_a_token_joins_the_window_in_place():
    """A single token that joins the window writes its row into the buffer (same shapes,
    one more token); a flush quantizes a group into the arrays' next rows; the state's
    tokens are the appending layout's (``held_state``) and its bytes count every row."""
    rng = np.random.default_rng(0)
    st = velox.init("kivi", 1, 2, 64, **PARAMS)
    st = kivi.update(st, mx.array(rng.standard_normal((1, 2, 40, 64)), mx.float32),
                     mx.array(rng.standard_normal((1, 2, 40, 64)), mx.float32))
    assert kivi.held_counts(st) == (0, 40) and kivi.residual_rows(st) == 47
    assert st.empty == 7 and kivi.quantized_rows(st) == 0
    shapes = [x.shape for x in st if isinstance(x, mx.array)]
    for i in range(7):
        x = mx.array(rng.standard_normal((1, 2, 1, 64)), mx.float32)
        st = kivi.update(st, x, x)
        assert [x.shape for x in st if isinstance(x, mx.array)] == shapes
        assert kivi.steady_room(st, 41 + i) == 6 - i
    x = mx.array(rng.standard_normal((1, 2, 1, 64)), mx.float32)
    st = kivi.update(st, x, x)  # the 48th token: a group of 32 quantized
    assert kivi.held_counts(st) == (32, 16) and kivi.quantized_rows(st) == kivi.CHUNK
    assert st.empty == kivi.CHUNK - 32 + 47 - 16
    assert velox.nbytes(st) == sum(x.nbytes for x in st if isinstance(x, mx.array))
    assert kivi.get_kv(st)[0].shape == (1, 2, 48, 64)


def test_steady_and_not_steady():
    m = get_method("kivi")
    assert decode.chunked(m) and decode.not_steady_because(m) is None
    st = m.update(m.init(1, 1, 64, **PARAMS), mx.zeros((1, 1, 20, 64)), mx.zeros((1, 1, 20, 64)))
    assert decode.steady_room(m, st, 20) == 47 - 20
    form = decode.steady_form(m, st)
    assert form.empty == kivi.UNCOUNTED and kivi.stored_tokens(form) == 20
    ref = m.update(m.init(1, 1, 64, backend="reference"), mx.zeros((1, 1, 5, 64)), mx.zeros((1, 1, 5, 64)))
    assert decode.steady_room(m, ref, 5) is None  # no in-place step on the reference backend


def test_the_compiled_step_runs_kivi(tiny_llama):
    """Through mlx-lm's ``generate_step``: a 199-token prefill, then 140 decode steps across
    flushes and the growth of the quantized arrays. Every step but those that flush a group
    runs in the whole model's compiled step, traced once per size of the arrays (and once
    more for the prompt's last token, whose dtype is the prompt's), not per token; tokens,
    offsets, positions, ``get_kv`` and bytes are those of the layer-by-layer path."""
    n = 140
    plain = make_cache(tiny_llama, "kivi", compile=False, **PARAMS)
    want, plain_steps = _generate(tiny_llama, plain, n)
    assert set(plain_steps) == {"deferred"}
    model_step.reset(tiny_llama)
    caches = make_cache(tiny_llama, "kivi", **PARAMS)
    got, steps = _generate(tiny_llama, caches, n)
    assert got == want
    # (generate_step runs a step ahead: at token i the cache holds 201 + i tokens); a step
    # flushes where the window held 47 tokens, layer by layer (the backend's fill)
    flushes = [i for i in range(n) if (201 + i - 16) % 32 == 0]
    assert [i for i, s in enumerate(steps) if s != "compiled"] == flushes
    assert {steps[i] for i in flushes} == {"fill"}
    assert steps.count("compiled") == n - len(flushes) and len(flushes) == 5
    traces = model_step.compiled_steps(tiny_llama)
    assert list(traces.values()) == [3]  # 256 quantized rows (prompt token, sampled), 512
    counts = model_step.decode_steps(tiny_llama)
    assert counts.get("compiled", 0) >= n - len(flushes)
    assert [c.offset for c in caches] == [c.offset for c in plain] == [201 + n] * 3
    for a, b in zip(caches, plain):
        assert a.nbytes == b.nbytes and kivi.quantized_rows(a.velox_state) == 512
        np.testing.assert_array_equal(np.array(a.positions()), np.array(b.positions()))
        for x, y in zip(velox.get_kv(a.velox_state), velox.get_kv(b.velox_state)):
            np.testing.assert_array_equal(np.array(x), np.array(y))


def test_save_and_load_after_compiled_steps(tiny_llama, tmp_path):
    """A cache saved after compiled steps (its count left to next_pos) loads and decodes as
    the saved one."""
    caches = make_cache(tiny_llama, "kivi", **PARAMS)
    gen = generate_step(PROMPT[:60], tiny_llama, prompt_cache=caches)
    for _ in range(6):
        next(gen)
    assert caches[0].last_step == "compiled"
    path = tmp_path / "c.safetensors"
    save_cache(path, caches)
    loaded, _ = load_cache(path, tiny_llama)
    assert [c.offset for c in loaded] == [c.offset for c in caches]
    tok = mx.array([[5]])
    a, b = tiny_llama(tok, cache=caches), tiny_llama(tok, cache=loaded)
    np.testing.assert_array_equal(np.array(a), np.array(b))


def test_a_file_of_the_appending_layout_loads(tiny_llama, tmp_path):
    """A prompt cache written before KIVI held its rows in chunks (no ``empty`` field, arrays
    of the tokens' rows only) loads as a full state and decodes as a cache of today."""
    from velox.adapters import mlxlm

    caches = make_cache(tiny_llama, "kivi", **PARAMS)
    tiny_llama(PROMPT[None, :90], cache=caches)
    q, r = kivi.held_counts(caches[0].velox_state)
    path = tmp_path / "new.safetensors"
    save_cache(path, caches)
    arrays, meta = mx.load(str(path), return_metadata=True)
    layers = json.loads(meta["0.layers"])
    cut = {"key_codes": q * PARAMS["bits"] // 32, "key_scales": q // 32, "key_zeros": q // 32}
    for i, entry in enumerate(layers):  # as the earlier format wrote it
        del entry["state"]["empty"]
        for name in list(arrays):
            field = name.split(".")[1] if name.startswith(f"{i}.") else None
            if field in cut:
                arrays[name] = arrays[name][..., :cut[field]]
            elif field in ("value_codes", "value_scales", "value_zeros"):
                arrays[name] = arrays[name][:, :, :q]
            elif field in ("residual_keys", "residual_values"):
                arrays[name] = arrays[name][:, :, :r]
    meta["0.layers"] = json.dumps(layers)
    meta[mlxlm._DIGEST] = mlxlm._digest(arrays, meta)
    old = tmp_path / "old.safetensors"
    mx.save_safetensors(str(old), arrays, metadata=meta)
    loaded, _ = load_cache(old, tiny_llama)
    st = loaded[0].velox_state
    assert st.empty == 0 and kivi.held_counts(st) == (q, r) and kivi.capacity(st) == q + r
    tok = mx.array([[5]])
    a, b = tiny_llama(tok, cache=caches), tiny_llama(tok, cache=loaded)
    np.testing.assert_array_equal(np.array(a), np.array(b))
