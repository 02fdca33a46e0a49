"""Every quantizing method on real SmolLM2 keys and values, at each of its presets.

Keys/values are captured with mlx-lm's plain cache after a prefill of real text (three
layers). Each method absorbs them as a prefill chunk plus decode steps; the reconstruction
must respect the method's declared per-element error bound, and its relative error must order
as its presets say (gentle <= default <= aggressive).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import velox
from velox.registry import get_method, method_keys

pytestmark = [pytest.mark.model, pytest.mark.unchecked]

LOSSY = [k for k in method_keys()
         if get_method(k).spec.family not in ("eviction", "merging")
         and not get_method(k).spec.contract.get("exact_rows", False)]
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
        "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
        "was the winter of despair, we had everything before us, we had nothing before us, we "
        "were all going direct to Heaven, we were all going direct the other way; in short, the "
        "period was so far like the present period, that some of its noisiest authorities "
        "insisted on its being received, for good or for evil, in the superlative degree of "
        "comparison only. There were a king with a large jaw and a queen with a plain face, on "
        "the throne of England; there were a king with a large jaw and a queen with a fair face, "
        "on the throne of France. ") * 3


@pytest.fixture(scope="module")
def real_kv(smollm2):
    model, tok = smollm2
    ids = mx.array(tok.encode(TEXT)[:320])[None]
    cache = make_prompt_cache(model)
    model(ids, cache=cache)
    out = {}
    for layer in (0, 15, 29):
        k, v = cache[layer].state[:2]
        out[layer] = (k[:, :, :320], v[:, :, :320])
    mx.eval(out)
    return out


def _settings(key):
    spec = get_method(key).spec
    yield "default", {}
    for name, preset in spec.presets.items():
        yield name, dict(preset)


def _rel_err(x, y):
    x = np.array(x.astype(mx.float32), np.float64)
    y = np.array(y.astype(mx.float32), np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def _logits_unbiased(m, params, real_kv, seeds: int = 24) -> bool:
    """The codec's logit estimates of ``q . k`` on real keys (the last 32 keys as queries, over
    all keys) are unbiased over the codec's random draws: in every layer, the mean error of
    ``seeds`` independent draws lies within 4 standard errors of zero."""
    from velox import codec_cache

    for k, v in real_kv.values():
        b, h, n, d = k.shape
        q = k[:, :, n - 32:].astype(mx.float32)
        exact = q @ k.astype(mx.float32).swapaxes(-1, -2)
        means = []
        for seed in range(seeds):
            st = m.update(m.init(b, h, d, dtype=k.dtype, **dict(params, seed=seed)), k, v)
            est = codec_cache.codec_of(st).scores(st.tables, q, codec_cache.held_codes(st)[0])
            means.append(float(np.array(est - exact, np.float64).mean()))
        means = np.array(means)
        if abs(means.mean()) > 4 * means.std(ddof=1) / math.sqrt(seeds):
            return False
    return True


@pytest.mark.parametrize("key", LOSSY)
def test_error_on_real_keys_and_values(real_kv, key):
    m = get_method(key)
    errors = {}
    for name, params in _settings(key):
        errs = []
        for layer, (k, v) in real_kv.items():
            b, h, n, d = k.shape
            at = {"layer": layer} if "layer" in m.spec.params else {}  # a per-layer calibration
            st = m.init(b, h, d, dtype=k.dtype, **params, **at)
            st = m.update(st, k[:, :, :288], v[:, :, :288])
            for t in range(288, n):
                st = m.update(st, k[:, :, t:t + 1], v[:, :, t:t + 1])
            pos = velox.positions(st)
            kh, vh = m.get_kv(st)
            want_k = mx.take_along_axis(k, pos[..., None], axis=2)
            want_v = mx.take_along_axis(v, pos[..., None], axis=2)
            if m.error_bound is not None:
                bk, bv = m.error_bound(st)
                assert bool((mx.abs(kh.astype(mx.float32) - want_k) <= bk).all()), (key, name, layer)
                assert bool((mx.abs(vh.astype(mx.float32) - want_v) <= bv).all()), (key, name, layer)
            errs.append((_rel_err(want_k, kh), _rel_err(want_v, vh)))
            assert velox.nbytes(st) < velox.fp16_bytes(n, b, h, d) * 2  # fp32 cache on CPU
        ek = float(np.mean([e[0] for e in errs]))
        ev = float(np.mean([e[1] for e in errs]))
        assert math.isfinite(ek) and math.isfinite(ev)
        if m.spec.contract.get("estimator") == "unbiased":
            # get_kv's keys are an estimate, not a reconstruction: check the logits instead
            assert _logits_unbiased(m, params, real_kv), (key, name)
        else:
            assert ek < 0.6, (key, name, ek, ev)  # far better than storing nothing
        assert ev < 0.8, (key, name, ek, ev)
        errors[name] = ek + ev
    if "gentle" in errors:
        assert errors["gentle"] <= errors["default"] * 1.02, errors
    if "aggressive" in errors:
        assert errors["default"] <= errors["aggressive"] * 1.02, errors
