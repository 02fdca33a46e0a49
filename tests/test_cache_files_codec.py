"""Prompt-cache files coded with KVTC (save_cache(..., codec="kvtc")): the round trip of an
evictor's exact rows (positions, offsets, sinks and recent rows exact; the others within the
coefficient bound's reach), a kvtc state's codes to the bit, the file smaller, unknown codecs
refused."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from velox.adapters.mlxlm import load_cache, make_cache, save_cache


@pytest.fixture(scope="module")
def model():
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=100)
    mx.random.seed(0)
    return llama.Model(args)


TOKENS = mx.array(np.random.default_rng(0).integers(0, 100, (1, 300)))


def _filled(model, key, **params):
    caches = make_cache(model, key, **params)
    model(TOKENS, cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def test_evictor_rows_round_trip(model, tmp_path):
    caches = _filled(model, "tova", budget=200)
    path = tmp_path / "c.safetensors"
    save_cache(path, caches, codec="kvtc", codec_params={"bit_budget": 128})
    plain = tmp_path / "p.safetensors"
    save_cache(plain, caches)
    assert path.stat().st_size < plain.stat().st_size
    loaded, _ = load_cache(path, model)
    for a, b in zip(caches, loaded):
        sa, sb = a.velox_state, b.velox_state
        assert a.offset == b.offset == 300
        assert np.array_equal(np.array(sa.positions), np.array(sb.positions))
        assert np.array_equal(np.array(sa.next_pos), np.array(sb.next_pos))
        pos = np.array(sa.positions)
        exact = (pos < 4) | (pos >= 300 - 128)
        for f in ("keys", "values"):
            x, y = np.array(getattr(sa, f)), np.array(getattr(sb, f))
            assert np.array_equal(x[exact], y[exact])
            err = np.abs(x - y)[~exact]
            assert err.max() > 0  # coded, lossy
            # 128 bits a row at head_dim 16: relative RMS error well below the rows' own
            assert np.sqrt((err ** 2).mean()) < 0.25 * np.sqrt((x[~exact] ** 2).mean())
    # the loaded cache decodes
    assert model(TOKENS[:, :1], cache=loaded).shape == (1, 1, 100)


def test_kvtc_state_codes_round_trip_exactly(model, tmp_path):
    caches = _filled(model, "kvtc", bit_budget=48)
    path = tmp_path / "k.safetensors"
    save_cache(path, caches, codec="kvtc")
    loaded, _ = load_cache(path, model)
    for a, b in zip(caches, loaded):
        fa, fb = dict(tree_flatten(a.velox_state)), dict(tree_flatten(b.velox_state))
        for k, v in fa.items():
            if isinstance(v, mx.array):
                assert np.array_equal(np.array(v), np.array(fb[k])), k
    out1 = model(TOKENS[:, :1], cache=caches)
    out2 = model(TOKENS[:, :1], cache=loaded)
    assert np.array_equal(np.array(out1), np.array(out2))


def test_unknown_codec_is_refused(model, tmp_path):
    caches = _filled(model, "tova", budget=200)
    with pytest.raises(ValueError, match="codec=.zip. is not one of .kvtc., .lossless."):
        save_cache(tmp_path / "z.safetensors", caches, codec="zip")
    with pytest.raises(ValueError, match="codec_params"):
        save_cache(tmp_path / "z.safetensors", caches, codec="kvtc", codec_params={"bits": 2})


# ---- entropy-coded KVTC (the default) and the lossless codec ---------------------------------

def _sizes(path):
    """Bytes of each coded part in a file (the arrays as stored), by suffix."""
    arrays = mx.load(str(path))
    out = {}
    for k, v in arrays.items():
        if "@" in k:
            part = k.split("@", 1)[1].split(".", 1)[1]
            out[part] = out.get(part, 0) + v.nbytes
    return out


def _rows_f16(caches):
    return sum(2 * (c.velox_state.keys.size + c.velox_state.values.size) for c in caches)


def test_entropy_coded_rows_round_trip(model, tmp_path):
    """Positions, offsets and exact rows come back to the bit; a coded row is within half a
    step a principal coefficient (the basis is orthonormal): |x - x^| <= step sqrt(h d) / 2,
    the quiet and sink rows at a 16th of it; the file, measured on disk, smaller than the rows
    in float16."""
    from velox.codecs import kvtc
    caches = _filled(model, "streaming_llm", window_size=512)
    path = tmp_path / "e.safetensors"
    save_cache(path, caches, codec="kvtc", codec_params={"key_step": 1.0, "value_step": 1.5,
                                                         "recent": 16, "rope_theta": 10000.0})
    assert path.stat().st_size < _rows_f16(caches)
    loaded, _ = load_cache(path, model)
    arrays, raw = mx.load(str(path), return_metadata=True)
    desc = json.loads(raw["0.codec"])
    assert desc["version"] == 2 and desc["arrays"]["0.keys"]["kind"] == "ecsq"
    assert desc["arrays"]["0.positions"]["kind"] == "ints"
    for i, (a, b) in enumerate(zip(caches, loaded)):
        sa, sb = a.velox_state, b.velox_state
        assert a.offset == b.offset == 300
        assert np.array_equal(np.array(sa.positions), np.array(sb.positions))
        pos = np.array(sa.positions)[0, 0]
        for f, step in (("keys", 1.0), ("values", 1.5)):
            x, y = np.array(getattr(sa, f))[0], np.array(getattr(sb, f))[0]  # [h, n, d]
            assert np.array_equal(x[:, pos >= 300 - 16], y[:, pos >= 300 - 16])   # recent: exact
            got = {k.split("@kvtc.")[1]: np.array(v) for k, v in arrays.items()
                   if k.startswith(f"{i}.{f}@kvtc.")}
            delta = float(got["step"][0])
            z = x if f == "values" else kvtc.rope_np(x, pos, 10000.0, False, inverse=True)
            rms = np.sqrt(((z[:, pos < 300 - 16] - z[:, (pos >= 4) & (pos < 284)].mean(1, keepdims=True)) ** 2).mean())
            assert 0.5 * step * rms < delta < 2 * step * rms
            quiet = np.unpackbits(got["quiet"], count=300).astype(bool)
            assert quiet[:4].all()  # the sinks, at the fine step
            err = np.sqrt(((x - y) ** 2).sum(axis=(0, 2)))                      # a token's heads
            bound = delta * np.sqrt(x.shape[0] * x.shape[2]) / 2 + 1e-4
            assert (err[~quiet] <= bound).all() and err[~quiet].max() > 0
            assert (err[quiet] <= bound / 16).all()
    assert model(TOKENS[:, :1], cache=loaded).shape == (1, 1, 100)


def test_entropy_coded_default_is_far_smaller(model, tmp_path):
    caches = _filled(model, "tova", budget=200)
    path = tmp_path / "d.safetensors"
    save_cache(path, caches, codec="kvtc")
    save_cache(tmp_path / "f.safetensors", caches, codec="kvtc", codec_params={"bit_budget": 128})
    assert path.stat().st_size < (tmp_path / "f.safetensors").stat().st_size
    parts = _sizes(path)
    assert parts["words"] > parts.get("exact_rows", 0)
    loaded, _ = load_cache(path, model)
    assert model(TOKENS[:, :1], cache=loaded).shape == (1, 1, 100)


def test_the_model_gives_kvtc_its_rotary_base(model, tmp_path):
    """``save_cache(..., model=)`` codes keys without the model's rotary embedding: the file's
    description and its rows are those of ``rope_theta`` given by hand; codec_params override
    the model's; another codec or fixed-rate codes leave the model's base unused."""
    caches = _filled(model, "streaming_llm", window_size=512)
    by_model, by_hand, plain = (tmp_path / f"{n}.safetensors" for n in ("m", "h", "p"))
    save_cache(by_model, caches, codec="kvtc", model=model)
    save_cache(by_hand, caches, codec="kvtc", codec_params={
        "rope_theta": float(model.args.rope_theta), "rope_traditional": model.args.rope_traditional})
    save_cache(plain, caches, codec="kvtc")

    def desc(p):
        return json.loads(mx.load(str(p), return_metadata=True)[1]["0.codec"])
    assert desc(by_model) == desc(by_hand) and desc(by_model)["params"]["rope_theta"] == 10000.0
    assert desc(plain)["params"]["rope_theta"] is None
    assert by_model.read_bytes() == by_hand.read_bytes()
    over = tmp_path / "o.safetensors"
    save_cache(over, caches, codec="kvtc", codec_params={"rope_theta": 500000.0}, model=model)
    assert desc(over)["params"]["rope_theta"] == 500000.0
    fixed = tmp_path / "f.safetensors"
    save_cache(fixed, caches, codec="kvtc", codec_params={"bit_budget": 128}, model=model)
    assert "rope_theta" not in desc(fixed)["params"]
    save_cache(tmp_path / "l.safetensors", caches, codec="lossless", model=model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lossless_files_round_trip_to_the_bit(dtype, tmp_path):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=100)
    mx.random.seed(1)
    m = llama.Model(args)
    m.set_dtype(getattr(mx, dtype))
    caches = _filled(m, "streaming_llm", window_size=512)
    save_cache(tmp_path / "p.safetensors", caches)
    save_cache(tmp_path / "l.safetensors", caches, codec="lossless")
    rows = sum(c.velox_state.keys.nbytes + c.velox_state.values.nbytes for c in caches)
    plain, coded = ((tmp_path / f).stat().st_size for f in ("p.safetensors", "l.safetensors"))
    assert coded < plain
    if dtype == "bfloat16":  # rows of a random model: still over 1.2x from the file's bytes
        assert rows / (coded - (plain - rows)) > 1.2
    loaded, _ = load_cache(tmp_path / "l.safetensors", m)
    for a, b in zip(caches, loaded):
        fa, fb = dict(tree_flatten(a.velox_state)), dict(tree_flatten(b.velox_state))
        for k, v in fa.items():
            if isinstance(v, mx.array):
                assert v.dtype == fb[k].dtype
                assert np.array_equal(np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v),
                                      np.array(fb[k].view(mx.uint16) if v.dtype == mx.bfloat16 else fb[k])), k
    assert np.array_equal(np.array(m(TOKENS[:, :1], cache=caches).astype(mx.float32)),
                          np.array(m(TOKENS[:, :1], cache=loaded).astype(mx.float32)))


def _rewrite_codec(src, dst, edit):
    from velox.adapters import cache_files
    arrays, raw = mx.load(str(src), return_metadata=True)
    desc = json.loads(raw["0.codec"])
    edit(desc)
    meta = dict(raw, **{"0.codec": json.dumps(desc)})
    meta["0.sha256"] = cache_files._digest(arrays, meta)
    mx.save_safetensors(str(dst), arrays, metadata=meta)
    return dst


def test_codec_descriptions_of_newer_or_unknown_coding_are_refused(model, tmp_path):
    caches = _filled(model, "tova", budget=200)
    save_cache(tmp_path / "c.safetensors", caches, codec="kvtc")
    newer = _rewrite_codec(tmp_path / "c.safetensors", tmp_path / "n.safetensors",
                           lambda d: d.update(version=3))
    with pytest.raises(ValueError, match="coded by a newer velox"):
        load_cache(newer, model)
    unknown = _rewrite_codec(tmp_path / "c.safetensors", tmp_path / "u.safetensors",
                             lambda d: d["arrays"]["0.keys"].update(kind="zstd"))
    with pytest.raises(ValueError, match="coded in a way this velox does not know"):
        load_cache(unknown, model)
    # a checksum-consistent file whose side arrays disagree is refused, not misread
    broken = _rewrite_codec(tmp_path / "c.safetensors", tmp_path / "b.safetensors",
                            lambda d: d["arrays"]["0.keys"].update(shape=[1, 2, 201, 16]))
    with pytest.raises(ValueError, match="codes of 0.keys do not decode"):
        load_cache(broken, model)


def test_a_file_coded_before_entropy_coded_rows_loads(model, tmp_path, monkeypatch):
    """A fixed-rate file as velox wrote it before: no description version, every other array
    (positions included) stored as it is."""
    from velox import entropy
    caches = _filled(model, "tova", budget=200)
    monkeypatch.setattr(entropy, "int_encode", lambda x: None)
    save_cache(tmp_path / "o.safetensors", caches, codec="kvtc", codec_params={"bit_budget": 128})
    monkeypatch.undo()
    old = _rewrite_codec(tmp_path / "o.safetensors", tmp_path / "v1.safetensors",
                         lambda d: d.pop("version"))
    loaded, _ = load_cache(old, model)
    assert np.array_equal(np.array(loaded[0].velox_state.positions),
                          np.array(caches[0].velox_state.positions))


@pytest.mark.parametrize("params,match", [
    ({"bit_budget": 128, "key_step": 2.0}, "not fixed-rate KVTC's"),
    ({"key_step": 0}, "key_step=0"),
    ({"sinks": -1}, "sinks=-1"),
    ({"rope_theta": 0.5}, "rope_theta"),
    ({"rope_traditional": 1}, "rope_traditional"),
    ({"steps": 2}, "are not KVTC's"),
])
def test_codec_params_are_checked(model, tmp_path, params, match):
    caches = _filled(model, "tova", budget=200)
    with pytest.raises(ValueError, match=match):
        save_cache(tmp_path / "z.safetensors", caches, codec="kvtc", codec_params=params)
    with pytest.raises(ValueError, match="takes none"):
        save_cache(tmp_path / "z.safetensors", caches, codec="lossless", codec_params={"x": 1})
