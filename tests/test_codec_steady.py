"""Codec caches hold their rows in chunks (``velox.codec_cache``): a token is written in place
into the next empty row, the arrays grow a chunk at a time, the state holds what a cache that
appends every token holds, and a state with an empty row takes the whole model's compiled
decode step (``velox.adapters.model_step``)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import velox
from velox import codec_cache, decode, quant
from velox.adapters import model_step
from velox.adapters.mlxlm import load_cache, make_cache, save_cache
from velox.registry import get_method

pytestmark = pytest.mark.unchecked

CODECS = ["turboquant_mse", "turboquant_prod", "turboquant_rvq", "polar", "qjl", "spectral"]
CHUNK = codec_cache.CHUNK


def _rows(rng, *shape):
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def _shapes(st):
    return [tuple(x.shape) for x in (*st.key_codes, *st.value_codes)]


@pytest.mark.filterwarnings("ignore:.*no calibration artifact")
@pytest.mark.parametrize("key", CODECS)
def test_a_token_is_written_in_place_while_the_chunk_lasts(key):
    """A prefill chunk grows the arrays to fit, rounded up to a chunk; single tokens keep every
    shape until the arrays are full; the next one grows them by one chunk; a chunk that does
    not fit grows them to fit at once. ``nbytes`` counts every row."""
    m = get_method(key)
    rng = np.random.default_rng(0)
    st = m.init(1, 2, 32)
    assert codec_cache.capacity(st) == 0 and st.empty == 0
    st = m.update(st, _rows(rng, 1, 2, CHUNK - 3, 32), _rows(rng, 1, 2, CHUNK - 3, 32))
    assert (codec_cache.capacity(st), st.empty, codec_cache.stored_tokens(st)) == (CHUNK, 3, CHUNK - 3)
    shapes = _shapes(st)
    for t in range(3):
        st = m.update(st, _rows(rng, 1, 2, 1, 32), _rows(rng, 1, 2, 1, 32))
        assert _shapes(st) == shapes and st.empty == 2 - t
    st = m.update(st, _rows(rng, 1, 2, 1, 32), _rows(rng, 1, 2, 1, 32))
    assert codec_cache.capacity(st) == 2 * CHUNK and st.empty == CHUNK - 1
    st = m.update(st, _rows(rng, 1, 2, 2 * CHUNK, 32), _rows(rng, 1, 2, 2 * CHUNK, 32))
    assert codec_cache.capacity(st) == 4 * CHUNK and codec_cache.stored_tokens(st) == 3 * CHUNK + 1
    assert m.positions(st).shape == (1, 2, 3 * CHUNK + 1)
    assert m.nbytes(st) == sum(x.nbytes for x in velox.decode.arrays(st))
    np.testing.assert_array_equal(np.array(st.next_pos), 3 * CHUNK + 1)


def test_the_write_does_not_copy_the_arrays():
    """A single-token update of a large state allocates about a row, not a second cache (MLX
    writes the row into the arrays in place when nothing else holds them)."""
    m = get_method("turboquant_prod")
    rng = np.random.default_rng(1)
    st = m.init(1, 8, 128)
    x = _rows(rng, 1, 8, 16 * CHUNK - 8, 128)
    st = m.update(st, x, x)
    mx.eval(st)
    del x
    size = m.nbytes(st)
    assert size > 4 << 20
    k = _rows(rng, 1, 8, 1, 128)
    mx.eval(k)
    for _ in range(3):
        st = m.update(st, k, k)
        mx.eval(st)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(4):
        st = m.update(st, k, k)
        mx.eval(st)
    assert mx.get_peak_memory() - base < size // 8


class _Appending:
    """The cache without chunks, from the same codec: every step's codes appended (the
    method's own encoding with no outlier channels), attention from ``scores`` over all of
    them, the new tokens exact."""

    def __init__(self, state):
        self.tables, self.codec = state.tables, codec_cache.codec_of(state)
        self.cd = quant.dtype_of(state.cache_dtype)
        self.exact = isinstance(state.value_codes, codec_cache.ExactRows)
        self.kc = self.vc = None

    def add(self, keys, values):
        d = keys.shape[3]
        kc = self.codec.encode(self.tables, keys)
        vc = (codec_cache.ExactRows(values.astype(quant.side_dtype(self.cd))) if self.exact
              else codec_cache.Int8Rows(*quant.quantize(values, codec_cache.VALUE_BITS, d, self.cd)))
        if self.kc is None:
            self.kc, self.vc = kc, vc
        else:
            self.kc = type(kc)(*(mx.concatenate([a, b], axis=2) for a, b in zip(self.kc, kc)))
            self.vc = type(vc)(*(mx.concatenate([a, b], axis=2) for a, b in zip(self.vc, vc)))

    def kv(self):
        d = self.vc[0].shape[3] if self.exact else self.vc.codes.shape[3] * 4
        v = (self.vc.rows.astype(mx.float32) if self.exact else
             quant.dequantize_f32(*self.vc, codec_cache.VALUE_BITS, d))
        return self.codec.decode(self.tables, self.kc).astype(self.cd), v.astype(self.cd)

    def attend(self, q, k, v, scale):
        b, hq, _, d = q.shape
        h = k.shape[1]
        qs = (q * scale).reshape(b, h, hq // h, d)
        logits = mx.concatenate([self.codec.scores(self.tables, qs, self.kc),
                                 qs @ k.swapaxes(-1, -2)], axis=-1)
        p = mx.softmax(logits, axis=-1, precise=True)
        vals = mx.concatenate([self.kv()[1].astype(mx.float32), v], axis=2)
        return (p @ vals).reshape(b, hq, 1, d)


@pytest.mark.filterwarnings("ignore:.*no calibration artifact")
@pytest.mark.parametrize("key", CODECS)
def test_decoding_across_a_chunk_equals_appending(key):
    """A prefill, 150 single tokens past the end of the first chunk, a chunk of 7, and more
    single tokens: after every step ``get_kv`` and ``positions`` are those of the codes
    appended step by step (the same codec), and each step's attention (the registered
    ``attend``, ``attend_update``, and ``velox.decode``'s steady step on the state as it is and
    with its count left to its arrays, as the compiled decode step takes it) is theirs."""
    m = get_method(key)
    rng = np.random.default_rng(2)
    b, h, g, d = 1, 2, 2, 32
    st = m.init(b, h, d)
    plain = _Appending(st)
    scale = d ** -0.5
    steps = [150] + [1] * 150 + [7] + [1] * 20
    for i, s in enumerate(steps):
        k, v = _rows(rng, b, h, s, d), _rows(rng, b, h, s, d)
        if s == 1:
            q = _rows(rng, b, h * g, 1, d)
            want = plain.attend(q, k, v, scale)
            out, new = m.attend_update(st, q, k, v, scale=scale)
            outs = [m.attend(st, q, k, v, scale=scale), out]
            if i % 37 == 1 or codec_cache.stored_tokens(st) in (CHUNK - 1, CHUNK):
                for form in (st, codec_cache.uncounted(st)):
                    if form is not st and st.empty == 0:  # (the compiled step takes no full state)
                        continue
                    o, moved, row = decode.split_step(m, form, q, k, v, scale)
                    assert row is None
                    outs.append(o)
                    if form is st:
                        assert _shapes(moved) == _shapes(new)
            for o in outs:
                np.testing.assert_allclose(np.array(o), np.array(want), rtol=2e-5, atol=2e-5)
            st = new
        else:
            st = m.update(st, k, v)
        plain.add(k, v)
        n = sum(steps[:i + 1])
        assert codec_cache.stored_tokens(st) == n
        np.testing.assert_array_equal(np.array(m.positions(st)), np.broadcast_to(np.arange(n), (b, h, n)))
        for got, ref in zip(m.get_kv(st), plain.kv()):
            np.testing.assert_array_equal(np.array(got), np.array(ref))
    assert codec_cache.capacity(st) == 2 * CHUNK


@pytest.mark.parametrize("key", ["turboquant_mse", "qjl"])
def test_the_backends_store_the_same_way(key):
    """The reference backend (NumPy codes) grows and fills the arrays as the mlx one does."""
    m = get_method(key)
    rng = np.random.default_rng(3)
    a, r = m.init(1, 2, 32, backend="mlx"), m.init(1, 2, 32, backend="reference")
    for s in (CHUNK - 2, 1, 1, 1, 5):
        k, v = _rows(rng, 1, 2, s, 32), _rows(rng, 1, 2, s, 32)
        a, r = m.update(a, k, v), m.update(r, k, v)
        assert _shapes(a) == _shapes(r) and a.empty == r.empty and m.nbytes(a) == m.nbytes(r)
        for x, y in zip(m.get_kv(a), m.get_kv(r)):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-5)


def test_a_state_whose_count_is_left_to_its_arrays():
    """``uncounted``: the same arrays, ``empty = UNCOUNTED``; the host reads the count from
    ``next_pos`` where it needs it, and an update of it is the update of the counted state."""
    m = get_method("turboquant_prod")
    rng = np.random.default_rng(4)
    st = m.init(1, 2, 32)
    x = _rows(rng, 1, 2, 40, 32)
    st = m.update(st, x, x)
    u = codec_cache.uncounted(st)
    assert u.empty == codec_cache.UNCOUNTED and m.nbytes(u) == m.nbytes(st)
    assert codec_cache.stored_tokens(u) == 40 and codec_cache.held_rows(u) is u.next_pos
    y = _rows(rng, 1, 2, 3, 32)
    for got, want in zip(m.get_kv(m.update(u, y, y)), m.get_kv(m.update(st, y, y))):
        np.testing.assert_array_equal(np.array(got), np.array(want))
    assert m.update(u, y, y).empty == CHUNK - 43
    with pytest.raises(ValueError, match="empty"):
        codec_cache.stored_tokens(st._replace(empty=300))


@pytest.mark.parametrize("key", ["turboquant_prod", "qjl"])
def test_the_decode_kernels_read_the_held_rows(key, monkeypatch):
    """The CUDA decode kernels (``velox.kernels.codec``), emulated on the CPU from their very
    sources, read the held rows of the arrays in place: the count an int, or data (the
    compiled step's record, the splits planned over every row), equal to ``attend``."""
    from velox.kernels import codec as ck
    from tests import test_codec_kernel as tk

    if tk._CXX is None:
        pytest.skip("needs a C++20 compiler (g++ or clang++)")
    st = tk._state(key, 1, 2, 128, 300, mx.float32, seed=5)  # 300 tokens in 512 rows
    assert codec_cache.capacity(st) == 2 * CHUNK
    q, kn, vn = tk._step(1, 2, 4, 128, mx.float32)
    want = tk._reference(st, q, kn, vn, 128 ** -0.5, monkeypatch)
    monkeypatch.setattr(ck, "_run_kernel", tk._emulated_kernel)
    for form, held in ((st, None), (codec_cache.uncounted(st), None), (st, st.next_pos)):
        out = ck.decode_attend(form, q, kn, vn, scale=128 ** -0.5, held=held)
        tk._check(out, want, mx.float32, f"{key} held={held}")


def test_the_adapter_fill_leaves_the_compiled_steps_record():
    """The adapter's single-token step outside the compiled step (the backend's ``fill``)
    leaves the record the compiled step leaves (the count left to ``next_pos``), with the
    count remembered on the host while that ``next_pos`` lives."""
    import gc

    m = get_method("qjl")
    rng = np.random.default_rng(6)
    st = m.update(m.init(1, 2, 32), _rows(rng, 1, 2, 30, 32), _rows(rng, 1, 2, 30, 32))
    fill = m.backends["mlx"].fill
    new = fill(st, _rows(rng, 1, 2, 1, 32), _rows(rng, 1, 2, 1, 32))
    assert new.empty == codec_cache.UNCOUNTED and codec_cache.stored_tokens(new) == 31
    key = id(new.next_pos)
    assert codec_cache._COUNTS[key][1] == 31
    again = fill(new, _rows(rng, 1, 2, 1, 32), _rows(rng, 1, 2, 1, 32))
    assert codec_cache.stored_tokens(again) == 32 and _shapes(again) == _shapes(st)
    del new, again
    gc.collect()
    assert key not in codec_cache._COUNTS


def test_steady_and_not_steady():
    """The codecs are steady (their spec's ``storage = "chunked"``) at any size while a row is
    empty; ``steady_rows`` names no fixed size for them."""
    for key in CODECS:
        m = get_method(key)
        assert decode.not_steady_because(m) is None and decode.chunked(m)
        assert decode.steady_rows(m, m.spec.defaults) is None
    m = get_method("turboquant_mse")
    st = m.update(m.init(1, 1, 32), mx.zeros((1, 1, 5, 32)), mx.zeros((1, 1, 5, 32)))
    assert decode.steady_room(m, st, 5) == CHUNK - 5 and decode.slot_count(m, st) == CHUNK
    assert decode.steady_form(m, st).empty == codec_cache.UNCOUNTED
    ref = m.update(m.init(1, 1, 32, backend="reference"), mx.zeros((1, 1, 5, 32)), mx.zeros((1, 1, 5, 32)))
    assert decode.steady_room(m, ref, 5) is None  # no in-place step on the reference backend
    assert decode.steady_room(get_method("tova"), st, 5) is None
    assert decode.not_steady_because(get_method("kivi")) is not None


# --- through mlx-lm --------------------------------------------------------------------------

PROMPT = mx.array([(7 * i + 3) % 97 for i in range(200)])


def _generate(model, caches, n, prompt=PROMPT):
    toks, steps = [], []
    for (y, _), _ in zip(generate_step(prompt, model, prompt_cache=caches), range(n)):
        toks.append(int(y))
        steps.append(caches[0].last_step)
    return toks, steps


@pytest.mark.parametrize("key", ["turboquant_mse", "turboquant_prod"])
def test_the_compiled_step_runs_codec_caches(tiny_llama, key):
    """Through mlx-lm's ``generate_step``: a 199-token prefill (one chunk of rows), then 102
    decode steps across the end of the chunk. Every step but the one that grows the arrays
    runs in the whole model's compiled step, traced once per size of the arrays (the prompt's
    last token and the sampled ones cast to one dtype), not per token; tokens, offsets,
    positions, ``get_kv`` and bytes are those of the layer-by-layer path."""
    plain = make_cache(tiny_llama, key, compile=False)
    want, plain_steps = _generate(tiny_llama, plain, 100)
    assert set(plain_steps) == {"deferred"}
    model_step.reset(tiny_llama)
    caches = make_cache(tiny_llama, key)
    got, steps = _generate(tiny_llama, caches, 100)
    assert got == want
    # (generate_step runs a step ahead: at token i the step of token i + 1 has run) token
    # 57 is the cache's 257th: its step grows the arrays, layer by layer
    assert steps[56] == "fill" and steps[:56] + steps[57:] == ["compiled"] * 99
    traces = model_step.compiled_steps(tiny_llama)
    assert list(traces.values()) == [2]  # 256 rows, 512 rows
    assert [c.offset for c in caches] == [c.offset for c in plain] == [301] * 3
    for a, b in zip(caches, plain):
        assert a.nbytes == b.nbytes and codec_cache.capacity(a.velox_state) == 2 * CHUNK
        np.testing.assert_array_equal(np.array(a.positions()), np.array(b.positions()))
        for x, y in zip(velox.get_kv(a.velox_state), velox.get_kv(b.velox_state)):
            np.testing.assert_array_equal(np.array(x), np.array(y))


def _address(x: mx.array) -> int:
    """The address of an array's buffer (read through a NumPy view, let go at once)."""
    view = np.asarray(x)
    return view.__array_interface__["data"][0]


def test_the_compiled_step_writes_in_place(tiny_llama):
    """A compiled decode step writes its row into the arrays the cache holds: after it, every
    code array of every layer is the same buffer (a copy would be a new one: the old is alive
    while it is made)."""
    caches = make_cache(tiny_llama, "turboquant_prod")
    gen = generate_step(PROMPT, tiny_llama, prompt_cache=caches)
    for _ in range(3):
        next(gen)
    for _ in range(5):
        mx.eval([c.state for c in caches])
        before = [[_address(x) for x in (*c.velox_state.key_codes, *c.velox_state.value_codes)]
                  for c in caches]
        next(gen)
        mx.eval([c.state for c in caches])
        assert caches[0].last_step == "compiled"
        assert before == [[_address(x) for x in (*c.velox_state.key_codes, *c.velox_state.value_codes)]
                          for c in caches]


def test_no_trace_per_token(tiny_llama):
    """Within one size of the arrays, more decode tokens add no trace."""
    model_step.reset(tiny_llama)
    caches = make_cache(tiny_llama, "turboquant_mse")
    gen = generate_step(PROMPT[:40], tiny_llama, prompt_cache=caches)
    for _ in range(5):
        next(gen)
    before = dict(model_step.compiled_steps(tiny_llama))
    for _ in range(60):
        next(gen)
    assert caches[0].last_step == "compiled"
    assert model_step.compiled_steps(tiny_llama) == before


def test_steady_state_refuses_a_step_that_grows(tiny_llama):
    """A cache whose arrays are full offers no steady state (its next step grows them, layer
    by layer); nor does one with a rollback journal, an append tail or compile=False."""
    caches = make_cache(tiny_llama, "turboquant_mse")
    tiny_llama(mx.array([[(5 * i + 1) % 97 for i in range(CHUNK)]]), cache=caches)
    assert caches[0].velox_state.empty == 0 and caches[0].steady_state() is None
    tiny_llama(PROMPT[None, :1], cache=caches)  # grows the arrays
    assert caches[0].last_step != "compiled" and caches[0].velox_state.empty == CHUNK - 1
    got = caches[0].steady_state()
    assert got is not None and got[1].empty == codec_cache.UNCOUNTED and got[3] == CHUNK + 1
    for kw in ({"rollback": 2}, {"decode": "append"}, {"compile": False}):
        other = make_cache(tiny_llama, "turboquant_mse", **kw)
        tiny_llama(PROMPT[None, :40], cache=other)
        assert other[0].steady_state() is None, kw


def test_save_and_load_after_compiled_steps(tiny_llama, tmp_path):
    """A cache saved after compiled steps (its count left to its arrays) loads and decodes as
    the saved one."""
    caches = make_cache(tiny_llama, "turboquant_prod")
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
    """A prompt cache written before the codes were held in chunks (no ``empty`` field, arrays
    of the tokens' rows only, format 3) loads and decodes as a cache of today: its arrays are
    full, so its next token grows them."""
    from velox.adapters import cache_files

    caches = make_cache(tiny_llama, "turboquant_mse")
    tiny_llama(PROMPT[None, :50], cache=caches)
    path = tmp_path / "new.safetensors"
    save_cache(path, caches)
    arrays, meta = mx.load(str(path), return_metadata=True)
    layers = json.loads(meta["0.layers"])
    for i, entry in enumerate(layers):  # as the earlier format wrote it
        del entry["state"]["empty"]
        for name in list(arrays):
            if name.startswith((f"{i}.key_codes.", f"{i}.value_codes.")):
                arrays[name] = arrays[name][:, :, :50]
    meta["0.layers"] = json.dumps(layers)
    meta[cache_files._DIGEST] = cache_files._digest(arrays, meta)
    old = tmp_path / "old.safetensors"
    mx.save_safetensors(str(old), arrays, metadata=meta)
    loaded, _ = load_cache(old, tiny_llama)
    st = loaded[0].velox_state
    assert st.empty == 0 and codec_cache.capacity(st) == 50
    for c, d in zip(caches, loaded):  # the same rows decode from the same codes
        for x, y in zip(velox.get_kv(c.velox_state), velox.get_kv(d.velox_state)):
            np.testing.assert_array_equal(np.array(x), np.array(y))
    tok = mx.array([[5]])
    a, b = tiny_llama(tok, cache=caches), tiny_llama(tok, cache=loaded)
    # attention over 256 rows (50 filled) against 51: the same sums in another order
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    assert (np.array(a).argmax(-1) == np.array(b).argmax(-1)).all()
    assert codec_cache.capacity(loaded[0].velox_state) == CHUNK
