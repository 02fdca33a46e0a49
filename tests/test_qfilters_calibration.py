"""Q-Filters calibrated on SmolLM2: the capture, the shipped artifact, and held-out ranking."""

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.model

# Held out from calibration: the opening of Jane Austen, "Pride and Prejudice" (1813), public domain.
HELD_OUT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife.\n\n"
    "However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
    "he is considered the rightful property of some one or other of their daughters.\n\n"
    "\"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that Netherfield "
    "Park is let at last?\"\n\n"
    "Mr. Bennet replied that he had not.\n\n"
    "\"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all "
    "about it.\"\n\n"
    "Mr. Bennet made no answer.\n\n"
    "\"Do you not want to know who has taken it?\" cried his wife impatiently.\n\n"
    "\"You want to tell me, and I have no objection to hearing it.\"\n\n"
    "This was invitation enough."
)


@pytest.fixture(scope="module")
def smollm2():
    from velox.adapters.smollm2 import load_default_model

    return load_default_model()


@pytest.fixture(scope="module")
def shipped():
    from velox.adapters.calibration import load_qfilters

    return load_qfilters()


def test_shipped_filters_load_back(shipped):
    filters, meta = shipped
    assert filters.shape == (30, 3, 64) and filters.dtype == np.float32  # SmolLM2-135M: 30 layers
    assert np.allclose(np.linalg.norm(filters, axis=-1), 1, atol=1e-5)
    assert meta["model"] == "smollm2-135m-instruct-f32" and meta["method"] == "qfilters"
    assert meta["tokens"] >= 300


def test_capture_is_post_rope_and_restores_the_model(smollm2):
    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters.calibration import capture_qk

    model, tokenizer = smollm2
    tokens = tokenizer.encode(HELD_OUT)[:40]
    ropes = [layer.self_attn.rope for layer in model.layers]
    queries, keys = capture_qk(model, tokens)
    assert all(layer.self_attn.rope is r for layer, r in zip(model.layers, ropes))
    assert queries[0].shape == (40, 9, 64) and keys[0].shape == (40, 3, 64)
    # A plain mlx-lm cache stores post-RoPE keys: the captured keys are those.
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    for layer in (0, 29):
        stored = np.array(cache[layer].state[0][0, :, :40]).transpose(1, 0, 2)
        assert np.allclose(keys[layer], stored, atol=1e-4)


def test_calibration_reproduces_the_artifact(smollm2, shipped):
    from velox.adapters.calibration import CALIBRATION_TEXT, calibrate_qfilters

    model, tokenizer = smollm2
    filters = calibrate_qfilters(model, tokenizer.encode(CALIBRATION_TEXT))
    cos = (filters * shipped[0]).sum(-1)
    assert (cos > 0.999).all()


def test_filters_rank_held_out_keys_better_than_random(smollm2, shipped):
    """Keeping the top quarter of keys by filter score keeps more of the last queries'
    attention than a random quarter (k / N in expectation) and than the opposite sign."""
    from velox.adapters.calibration import capture_qk

    model, tokenizer = smollm2
    filters = shipped[0]
    tokens = tokenizer.encode(HELD_OUT)
    queries, keys = capture_qk(model, tokens)
    n, m, d = len(tokens), 32, 64
    k = n // 4
    top, flipped, top_rest, rand_rest = [], [], [], []
    visible = np.arange(n)[None, :] <= np.arange(n - m, n)[:, None]
    for q, kk, f in zip(queries, keys, filters):
        g = q.shape[1] // kk.shape[1]
        for j in range(kk.shape[1]):
            logits = q[n - m:, j * g:(j + 1) * g].transpose(1, 0, 2) @ kk[:, j].T / np.sqrt(d)
            a = np.exp(np.where(visible, logits, -np.inf) - logits.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)  # [g, m, n]: the last m queries' attention
            score = kk[:, j] @ f[j]
            top.append(a[..., np.argsort(-score)[:k]].sum(-1).mean())
            flipped.append(a[..., np.argsort(score)[:k]].sum(-1).mean())
            # Sinks aside (both selections would keep the first 4 tokens):
            rest = 4 + np.argsort(-score[4:])[:k]
            top_rest.append(a[..., rest].sum(-1).mean())
            rand_rest.append(a[..., 4:].sum(-1).mean() * k / (n - 4))
    top, flipped, top_rest, rand_rest = map(np.array, (top, flipped, top_rest, rand_rest))
    assert top.mean() > 2 * k / n and top.mean() > 4 * flipped.mean()
    assert (top > k / n).mean() > 0.9
    assert top_rest.mean() > 1.5 * rand_rest.mean()


def test_make_cache_loads_each_layers_shipped_filters(smollm2, shipped):
    from velox.adapters.mlxlm import make_cache

    model, tokenizer = smollm2
    caches = make_cache(model, "qfilters", calibration="smollm2-135m-instruct", budget=48, n_sink=4)
    tokens = mx.array(tokenizer.encode(HELD_OUT)[:80])
    mx.eval(model(tokens[None], cache=caches))
    for layer, c in enumerate(caches):
        st = c.velox_state
        assert st.calibrated and st.layer == layer and c.size() == 48
        assert np.array_equal(np.array(st.filters)[0], shipped[0][layer])
    with pytest.raises(ValueError, match="layer=30"):
        import velox

        velox.qfilters_init(1, 3, 64, calibration="smollm2-135m-instruct", layer=30)
