"""Saved prompt caches: a fresh process decodes exactly as the saving one, and load_cache
refuses every kind of damaged or inconsistent file with a ValueError naming the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from velox.adapters import mlxlm
from velox.adapters.mlxlm import load_cache, make_cache, save_cache
from velox.backend import BackendUnavailable, device_supports

PROMPT = mx.array([1, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 3, 5, 7, 9] * 3)
NEXT = mx.array([3])  # one token: the first step after loading is a decode step


def greedy(model, cache, n, prompt=PROMPT, step=7):
    return [int(t) for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=n,
                                             prefill_step_size=step)]


# --- a fresh process ---------------------------------------------------------------------

FRESH = {
    "rocketkv": dict(budget=24, obs_window=8),
    "tova+affine": dict(budget=24, bits=4),
    "tova": dict(budget=24),
    "kivi": dict(residual_length=8),
    "h2o": dict(budget=24, grace=4),
    "squeeze": dict(budget=24, grace=4),
}

CHILD = textwrap.dedent("""
    import json, sys
    import velox  # first, as in the parent: the same BLAS (OpenBLAS loads before mlx.core)
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama
    from velox.adapters.mlxlm import load_cache, save_cache

    d = sys.argv[1]
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=3,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0)
    model = llama.Model(args)
    model.load_weights(d + "/model.safetensors")
    mx.eval(model.parameters())
    out = {}
    for key in json.loads(sys.argv[2]):
        for how in ("with-model", "alone"):
            caches, _ = load_cache(f"{d}/{key}.safetensors", model if how == "with-model" else None)
            toks = [int(t) for t, _ in generate_step(mx.array([3]), model, prompt_cache=caches,
                                                     max_tokens=int(sys.argv[3]))]
            save_cache(f"{d}/{key}.{how}.safetensors", caches)
            out[f"{key}/{how}"] = [toks, [[c.mode.value, c.last_step] for c in caches]]
    print(json.dumps(out))
""")


def _same_files(a, b) -> None:
    xa, ma = mx.load(str(a), return_metadata=True)
    xb, mb = mx.load(str(b), return_metadata=True)
    assert sorted(xa) == sorted(xb)
    for name in xa:
        assert xa[name].dtype == xb[name].dtype and xa[name].shape == xb[name].shape, name
        assert np.array_equal(np.array(xa[name].view(mx.uint8) if xa[name].ndim else xa[name]),
                              np.array(xb[name].view(mx.uint8) if xb[name].ndim else xb[name])), name
    assert json.loads(ma["0.layers"]) == json.loads(mb["0.layers"])
    assert ma["0.record"] == mb["0.record"] and ma["0.sha256"] == mb["0.sha256"]


def test_a_loaded_cache_decodes_in_a_fresh_process_as_the_saved_one(tiny_llama, tmp_path):
    n = 12
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(tiny_llama.parameters())))
    want = {}
    for key, params in FRESH.items():
        caches = make_cache(tiny_llama, key, **params)
        greedy(tiny_llama, caches, n=6)
        save_cache(tmp_path / f"{key}.safetensors", caches)
        toks = greedy(tiny_llama, caches, n=n, prompt=NEXT)  # the saving process continues
        want[key] = [toks, [[c.mode.value, c.last_step] for c in caches]]
        save_cache(tmp_path / f"{key}.after.safetensors", caches)
    assert all(want[k][1] == [["deferred", "fused"]] * 3 for k in ("tova", "h2o", "tova+affine"))
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(list(FRESH)), str(n)],
                         capture_output=True, text=True, env=dict(os.environ), timeout=600,
                         cwd=tmp_path)  # the installed velox, not the source tree
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for key in FRESH:
        for how in ("with-model", "alone"):
            assert got[f"{key}/{how}"] == want[key], (key, how)
            _same_files(tmp_path / f"{key}.after.safetensors", tmp_path / f"{key}.{how}.safetensors")


# --- damaged and inconsistent files ----------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tiny_llama, tmp_path_factory):
    """A tova cache (budget 24, full) and an h2o one, saved after a prefill and three tokens."""
    d = tmp_path_factory.mktemp("saved")
    for key, params in (("tova", dict(budget=24)), ("h2o", dict(budget=24, grace=4))):
        caches = make_cache(tiny_llama, key, **params)
        greedy(tiny_llama, caches, n=3)
        save_cache(d / f"{key}.safetensors", caches, {"note": "x"})
    return d


def _rewrite(src, dst, edit=None, *, checksum=True):
    """Copy a saved file through ``edit(arrays, fields)`` (fields: the parsed metadata);
    the checksum is recomputed unless told not to, so the later checks are the ones tried."""
    arrays, raw = mx.load(str(src), return_metadata=True)
    fields = {k[2:]: json.loads(v) for k, v in raw.items()
              if k.startswith("0.") and k != "0.format" and k != "0.sha256"}
    if edit is not None:
        edit(arrays, fields)
    meta = dict(raw)
    meta.update({f"0.{k}": json.dumps(v) for k, v in fields.items()})
    if checksum:
        meta["0.sha256"] = mlxlm._checksum(arrays)
    mx.save_safetensors(str(dst), arrays, metadata=meta)
    return dst


def _refused(path, match, *, error=ValueError, **kwargs):
    with pytest.raises(error, match=match):
        load_cache(path, **kwargs)


def test_an_intact_file_loads_with_the_state_it_saved(saved, tmp_path):
    caches, meta = load_cache(_rewrite(saved / "tova.safetensors", tmp_path / "same.safetensors"))
    assert meta == {"note": "x"} and [c.offset for c in caches] == [len(PROMPT) + 3] * 3


def test_flipped_bytes_fail_the_checksum(saved, tmp_path):
    def flip(arrays, fields):
        k = np.array(arrays["1.keys"])
        k.view(np.uint8).reshape(-1)[5] ^= 0x10
        arrays["1.keys"] = mx.array(k)

    _refused(_rewrite(saved / "tova.safetensors", tmp_path / "f.safetensors", flip, checksum=False),
             "do not match the sha256 checksum")


def test_a_file_without_its_checksum_is_refused(saved, tmp_path):
    p = _rewrite(saved / "tova.safetensors", tmp_path / "f.safetensors")
    arrays, raw = mx.load(str(p), return_metadata=True)
    del raw["0.sha256"]
    mx.save_safetensors(str(p), arrays, metadata=raw)
    _refused(p, "without its sha256 checksum")


def test_a_file_from_before_the_checksum_loads_with_a_warning(tiny_llama, saved, tmp_path):
    arrays, raw = mx.load(str(saved / "tova.safetensors"), return_metadata=True)
    del arrays[mlxlm._MARKER]
    old = {k[2:]: v for k, v in raw.items() if k.startswith("0.") and k != "0.sha256"}
    old["format"] = "velox-prompt-cache-1"
    mx.save_safetensors(str(tmp_path / "v1.safetensors"), arrays, metadata=old)
    with pytest.warns(UserWarning, match="before velox prompt caches carried a checksum"):
        caches, meta = load_cache(tmp_path / "v1.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh, _ = load_cache(saved / "tova.safetensors")
    assert meta == {"note": "x"}
    assert greedy(tiny_llama, caches, 4, NEXT) == greedy(tiny_llama, fresh, 4, NEXT)
    # the other checks still run on such files
    old["layers"] = old["layers"].replace('"offset": 63', '"offset": -1')
    mx.save_safetensors(str(tmp_path / "v1bad.safetensors"), arrays, metadata=old)
    with pytest.warns(UserWarning):
        _refused(tmp_path / "v1bad.safetensors", "offset=-1 is negative")


def _layer(i, change):
    def edit(arrays, fields):
        change(fields["layers"][i], arrays)
    return edit


def test_a_state_on_a_backend_this_machine_lacks(tiny_llama, saved, tmp_path):
    gone = "cuda" if not device_supports("cuda") else "metal"

    def move(entry, arrays):
        entry["state"]["backend"] = gone

    p = _rewrite(saved / "tova.safetensors", tmp_path / "b.safetensors", _layer(1, move))
    _refused(p, f"layer 1.*{gone}.*backend='mlx'", error=BackendUnavailable)
    caches, _ = load_cache(p, backend="mlx")
    assert all(c.velox_state.backend == "mlx" for c in caches)
    ref, _ = load_cache(saved / "tova.safetensors")
    assert greedy(tiny_llama, caches, 4, NEXT) == greedy(tiny_llama, ref, 4, NEXT)
    _refused(p, "unknown backend", backend="gpu")


@pytest.mark.parametrize("change, match", [
    (lambda e, a: e.update(offset=-1), "layer 0: offset=-1 is negative"),
    (lambda e, a: e.update(offset=e["offset"] + 1), "offset=64 but the state has seen \\[63\\] tokens"),
    (lambda e, a: e.update(offset=True), "offset=True is not a int"),
    (lambda e, a: e.update(method="nope"), "unknown method 'nope'"),
    (lambda e, a: e.update(params={"budget": 8}), "budget=24 in the state, but its parameters give 8"),
    (lambda e, a: e.update(params={"budget": 24.0}), "budget must be an integer"),
    (lambda e, a: e.update(params={"budget": 24, "bits": 4}), "unknown parameter"),
    (lambda e, a: e.update(params={"budget": 2, "n_sink": 4}), "budget=2 must be > n_sink=4"),
    (lambda e, a: e.pop("compile"), "must have the fields"),
    (lambda e, a: e["state"].pop("positions"), "fields missing: positions"),
    (lambda e, a: e["state"].update(extra=1), "unknown: extra"),
    (lambda e, a: a.pop("0.values"), "array '0.values' \\(values\\) is missing"),
    (lambda e, a: a.update({"0.values": a["0.values"][..., :16]}), "values has shape \\(1, 2, 24, 16\\), expected \\(1, 2, \\*, 32\\)"),
    (lambda e, a: a.update({"0.values": a["0.values"].astype(mx.float16)}), "values is float16, the method holds float32"),
    (lambda e, a: a.update({"0.positions": a["0.positions"].astype(mx.float32)}), "positions is float32"),
    (lambda e, a: a.update({"0.values": a["0.values"][:, :, :23]}), "arrays disagree"),
    (lambda e, a: a.update({"0.positions": mx.concatenate([a["0.positions"][:, :, 1:2], a["0.positions"][:, :, 1:]], axis=2)}),
     "positions must be unique"),
    (lambda e, a: a.update({"0.positions": a["0.positions"] + 100}), "positions must increase within \\[0, offset=63\\)"),
], ids=["negative-offset", "offset-off-by-one", "offset-bool", "unknown-method", "params-vs-state",
        "float-param", "unknown-param", "constraint", "entry-field", "state-field-missing",
        "state-field-unknown", "missing-array", "shape", "dtype", "positions-dtype",
        "rows-disagree", "positions-twice", "positions-range"])
def test_inconsistent_files_are_refused(saved, tmp_path, change, match, no_shape_checks):
    _refused(_rewrite(saved / "tova.safetensors", tmp_path / "x.safetensors", _layer(0, change)),
             match)


def test_more_tokens_than_the_parameters_keep(saved, tmp_path):
    def shrink(entry, arrays):  # a budget of 8 throughout, but 24 tokens stored
        entry["params"]["budget"] = entry["state"]["budget"] = 8
        entry["params"]["n_sink"] = entry["state"]["n_sink"] = 2

    p = _rewrite(saved / "tova.safetensors", tmp_path / "x.safetensors", _layer(2, shrink))
    _refused(p, "layer 2: the state holds 24 tokens; after 63 its parameters keep 8")


def test_score_rows_that_disagree_with_the_kept_rows(saved, tmp_path, no_shape_checks):
    def cut(entry, arrays):
        arrays["0.scores"] = arrays["0.scores"][:, :, :23]

    _refused(_rewrite(saved / "h2o.safetensors", tmp_path / "x.safetensors", _layer(0, cut)),
             "arrays disagree")


def test_stray_arrays_bad_metadata_and_foreign_files(tiny_llama, saved, tmp_path):
    def stray(arrays, fields):
        arrays["9.keys"] = mx.zeros((1,))

    _refused(_rewrite(saved / "tova.safetensors", tmp_path / "s.safetensors", stray),
             "arrays 9.keys belong to no layer")
    p = _rewrite(saved / "tova.safetensors", tmp_path / "j.safetensors")
    arrays, raw = mx.load(str(p), return_metadata=True)
    mx.save_safetensors(str(p), arrays, metadata={**raw, "0.layers": "[{"})
    _refused(p, "'layers' is not valid JSON")
    mlx_file = tmp_path / "mlx.safetensors"
    cache = make_prompt_cache(tiny_llama)
    tiny_llama(PROMPT[None], cache=cache)
    save_prompt_cache(str(mlx_file), cache)
    _refused(mlx_file, "not a velox prompt cache.*mlx_lm.models.cache.load_prompt_cache")
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}")
    _refused(tmp_path / "junk.safetensors", "not a velox prompt cache")
    _refused(saved / "tova.safetensors", "holds 3 velox layers; Model has 1 plain KV layers",
             model=_one_layer_llama())


def _one_layer_llama():
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1,
                                       intermediate_size=64, num_attention_heads=2,
                                       num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=97))


def test_mlx_lm_load_prompt_cache_points_to_load_cache(saved):
    with pytest.raises(ValueError, match=r"velox prompt cache: load it with velox\.adapters\.mlxlm\.load_cache"):
        load_prompt_cache(str(saved / "tova.safetensors"))


def test_empty_slots_before_filled_ones_are_refused(tiny_llama, tmp_path):
    """Amortized eviction keeps its empty slots last (kv_slots reads the filled ones as a
    prefix): a file whose empty slot sits before a filled one is refused; the file as saved
    loads and decodes as the saving caches."""
    caches = make_cache(tiny_llama, "tova", budget=24, slack=5)
    greedy(tiny_llama, caches, n=4)  # 60 prompt tokens: a selection, then filled slots
    st = caches[0].velox_state
    assert 0 < st.empty < 5 and (np.array(st.positions)[..., -st.empty:] == -1).all()
    src = tmp_path / "slack.safetensors"
    save_cache(src, caches)
    back, _ = load_cache(src)
    assert greedy(tiny_llama, back, 3, NEXT) == greedy(tiny_llama, caches, 3, NEXT)

    def swap(entry, arrays):  # the last slot (empty) and the first one change places
        for name in ("0.keys", "0.values", "0.positions"):
            a = arrays[name]
            arrays[name] = mx.concatenate([a[:, :, -1:], a[:, :, 1:-1], a[:, :, :1]], axis=2)

    _refused(_rewrite(src, tmp_path / "x.safetensors", _layer(0, swap)),
             "layer 0: the empty slots must be the last")


def test_a_snapkv_file_from_before_grown_slots_loads(tiny_llama, tmp_path):
    """SnapKV's state holds ``empty`` since its decode steps fill grown slots; a file saved
    before (no ``empty``, every slot filled) loads and decodes as the caches that were saved,
    and a slot at position -1 in such a file is refused."""
    caches = make_cache(tiny_llama, "snapkv", budget=24, obs_window=4)
    tiny_llama(mx.array([PROMPT]), cache=caches)  # prefill only: no slot empty yet
    assert caches[0].velox_state.empty == 0
    src = tmp_path / "snap.safetensors"
    save_cache(src, caches)

    def legacy(entry, arrays):
        del entry["state"]["empty"]

    old = _rewrite(src, tmp_path / "old.safetensors", _layer(0, legacy))
    back, _ = load_cache(old)
    assert back[0].velox_state.empty == 0
    assert greedy(tiny_llama, back, 3, NEXT) == greedy(tiny_llama, caches, 3, NEXT)

    def hole(entry, arrays):
        del entry["state"]["empty"]
        p = np.array(arrays["0.positions"])
        p[..., -1] = -1
        arrays["0.positions"] = mx.array(p)

    _refused(_rewrite(src, tmp_path / "hole.safetensors", _layer(0, hole)), "layer 0: each row must hold empty=0 empty slots")
