"""Calibration artifacts: fitted on the embedded SmolLM2, written with their provenance, read
back and checked; every mismatch is a ValueError that names it."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from velox.adapters import artifacts
from velox.adapters.artifacts import calibrate, load_artifact, save_artifact

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def fitted(smollm2, tmp_path_factory):
    model, tokenizer = smollm2
    arrays, info = calibrate("spectral", model, tokenizer, "The quick brown fox. " * 40,
                             model_name="smollm2", source="test text", progress=False)
    path = tmp_path_factory.mktemp("art") / "spectral.safetensors"
    save_artifact(path, arrays, info)
    return model, path, arrays, info


def test_round_trip_and_provenance(fitted):
    model, path, arrays, info = fitted
    back, got = load_artifact(path, method="spectral", model=model)
    assert got == info
    assert set(back) == {"rotation", "scales", "eigenvalues", "participation_ratio"}
    dims = artifacts.model_dims(model)
    L, h, d = dims["layers"], dims["kv_heads"], dims["head_dim"]
    assert back["rotation"].shape == (L, h, d, d) and back["scales"].shape == (L, h, d)
    assert back["eigenvalues"].shape == (L, h, d) and back["participation_ratio"].shape == (L, h)
    assert info["format"] == artifacts.FORMAT == "velox-artifact-2"
    for k in arrays:
        assert np.array_equal(back[k], arrays[k])
    assert info["tokens"] > 100 and info["velox"] and info["source"] == "test text"


def test_rotations_are_orthogonal_and_sorted(fitted):
    _, _, arrays, _ = fitted
    R, ev = arrays["rotation"].astype(np.float64), arrays["eigenvalues"]
    eye = np.eye(R.shape[-1])
    assert np.abs(R @ R.swapaxes(-1, -2) - eye).max() < 1e-5
    assert (np.diff(ev, axis=-1) <= 1e-6).all() and (ev >= 0).all()
    pr = ev.astype(np.float64).sum(-1) ** 2 / (ev.astype(np.float64) ** 2).sum(-1)
    assert ((pr >= 1) & (pr <= R.shape[-1])).all()
    assert np.allclose(arrays["participation_ratio"], pr, rtol=1e-4)
    assert np.allclose((arrays["scales"].astype(np.float64) ** 2).sum(-1), 1.0, atol=1e-5)


def test_each_kv_head_has_its_own_fit(smollm2, fitted):
    """Every (layer, kv head) is the PCA of that head's keys alone: the fit of a head matches
    velox.codecs.spectral.calibrate of its captured keys, and heads of a layer differ."""
    from velox.adapters.calibration import capture_qk
    from velox.codecs.spectral import calibrate as fit_one

    model, tokenizer = smollm2
    _, _, arrays, _ = fitted
    _, keys = capture_qk(model, tokenizer.encode("The quick brown fox. " * 40))
    for layer in (0, len(keys) - 1):
        for h in range(keys[layer].shape[1]):
            one, got = fit_one(keys[layer][:, h]), arrays["rotation"][layer, h]
            # the top directions agree up to sign
            cos = np.abs(np.sum(one["rotation"][:4] * got[:4], -1))
            np.testing.assert_allclose(cos, 1.0, atol=1e-3)
            np.testing.assert_allclose(arrays["scales"][layer, h], one["scales"], rtol=1e-4,
                                       atol=1e-6)
        assert not np.allclose(arrays["scales"][layer, 0], arrays["scales"][layer, 1], rtol=0.05)


def test_mismatches_are_refused(fitted, tmp_path):
    model, path, arrays, info = fitted
    with pytest.raises(ValueError, match="not 'tova'"):
        load_artifact(path, method="tova")
    with pytest.raises(ValueError, match="no artifact"):
        load_artifact(tmp_path / "missing.safetensors", method="spectral")
    other = tmp_path / "other.safetensors"
    save_artifact(other, arrays, dict(info, head_dim=info["head_dim"] * 2))
    with pytest.raises(ValueError, match="head_dim"):
        load_artifact(other, method="spectral", model=model)
    # another kv-head count: in the provenance (against the model), or in the arrays
    heads = tmp_path / "heads.safetensors"
    save_artifact(heads, {k: v[:, :1] for k, v in arrays.items()}, dict(info, kv_heads=1))
    with pytest.raises(ValueError, match="kv_heads=1; this model has kv_heads=3"):
        load_artifact(heads, method="spectral", model=model)
    save_artifact(heads, {k: v[:, :2] for k, v in arrays.items()}, info)
    with pytest.raises(ValueError, match="holds 2 kv heads a layer"):
        load_artifact(heads, method="spectral")
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(plain), {"x": mx.zeros((2,))})
    with pytest.raises(ValueError, match="provenance"):
        load_artifact(plain, method="spectral")
    old = tmp_path / "old.safetensors"  # one pooled basis a layer: the format before per-head fits
    pooled = {"rotation": arrays["rotation"][:, 0], "scales": arrays["scales"][:, 0]}
    save_artifact(old, pooled, dict(info, format="velox-artifact-1"))
    with pytest.raises(ValueError, match="format 'velox-artifact-1'.*re-run `velox calibrate "
                                         "--method spectral"):
        load_artifact(old, method="spectral", model=model)


def test_a_method_without_calibration_refuses_an_artifact(fitted):
    from velox.adapters.mlxlm import make_cache

    model, path, _, _ = fitted
    with pytest.raises(ValueError, match="takes no calibration artifact"):
        make_cache(model, "tova", artifacts=path, budget=64)


def test_the_command_writes_an_artifact(tmp_path):
    from velox.adapters.cli import main

    out = tmp_path / "a.safetensors"
    text = tmp_path / "t.txt"
    text.write_text("A short calibration text. " * 30, encoding="utf-8")
    assert main(["calibrate", "--method", "spectral", "--out", str(out), "--text", str(text)]) == 0
    arrays, info = load_artifact(out, method="spectral")
    assert info["source"] == str(text) and arrays["rotation"].ndim == 4
    assert main(["calibrate", "--method", "tova", "--out", str(out)]) == 2


def test_make_cache_installs_each_layers_calibration(fitted):
    from velox.adapters.mlxlm import make_cache

    model, path, arrays, _ = fitted
    cache = make_cache(model, "spectral", artifacts=path, bits=3)
    ids = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    model(ids, cache=cache)
    for layer in (0, len(cache) - 1):
        st = cache[layer].velox_state
        assert np.array_equal(np.array(st.tables.rotation), arrays["rotation"][layer])
        assert st.tables.rotation.shape == arrays["rotation"].shape[1:]  # [kv_heads, d, d]
        assert np.allclose(np.array(st.tables.scales), arrays["scales"][layer], atol=1e-6)
    plain = make_cache(model, "spectral", bits=3)
    model(ids, cache=plain)
    assert not np.array_equal(np.array(plain[0].velox_state.tables.rotation), arrays["rotation"][0])
    with pytest.raises(ValueError, match="holds tokens"):
        velox_spectral().calibrated(cache[0].velox_state, {k: v[0] for k, v in arrays.items()})


def velox_spectral():
    from velox.methods import spectral
    return spectral


def test_the_fallback_says_so_once(smollm2, monkeypatch):
    import warnings

    from velox.adapters import mlxlm

    from velox.adapters import cache as adapter_cache

    monkeypatch.setattr(adapter_cache, "_FALLBACK_SAID", set())
    model, _ = smollm2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mlxlm.make_cache(model, "spectral")
        mlxlm.make_cache(model, "spectral")
        mlxlm.make_cache(model, "tova", budget=64)
        mlxlm.make_cache(model, "kvtc")
        mlxlm.make_cache(model, "vecinfer")  # the embedded model's shipped fit: nothing to say
    said = [str(w.message) for w in seen if "no calibration artifact" in str(w.message)]
    assert len(said) == 2, said
    assert said[0].startswith("spectral:") and "data-oblivious" in said[0]
    assert said[1].startswith("kvtc:") and "first update (the prefill)" in said[1]
