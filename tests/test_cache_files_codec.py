"""Prompt-cache files coded with KVTC (save_cache(..., codec="kvtc")): the round trip of an
evictor's exact rows (positions, offsets, sinks and recent rows exact; the others within the
coefficient bound's reach), a kvtc state's codes to the bit, the file smaller, unknown codecs
refused."""

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
    with pytest.raises(ValueError, match="codec='zip' is not one of 'kvtc'"):
        save_cache(tmp_path / "z.safetensors", caches, codec="zip")
    with pytest.raises(ValueError, match="codec_params"):
        save_cache(tmp_path / "z.safetensors", caches, codec="kvtc", codec_params={"bits": 2})
