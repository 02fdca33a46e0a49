"""Saved prompt caches: a fresh process decodes exactly as the saving one, and load_cache
refuses every kind of damaged or inconsistent file with a ValueError naming the problem."""

from __future__ import annotations

import copy
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

from velox.adapters import cache_files
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
    assert all(want[k][1] == [["deferred", "compiled"]] * 3 for k in ("tova", "h2o", "tova+affine"))
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
        meta["0.sha256"] = cache_files._digest(arrays, meta)
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


def _older(layers: str) -> str:
    """A layers entry as formats 1 and 2 wrote it (no dims, no artifact)."""
    entries = json.loads(layers)
    for e in entries:
        del e["dims"], e["artifact"]
    return json.dumps(entries)


def test_a_file_from_before_the_checksum_loads_with_a_warning(tiny_llama, saved, tmp_path):
    arrays, raw = mx.load(str(saved / "tova.safetensors"), return_metadata=True)
    del arrays[cache_files._MARKER]
    old = {k[2:]: v for k, v in raw.items() if k.startswith("0.") and k != "0.sha256"}
    old["format"] = "velox-prompt-cache-1"
    old["layers"] = _older(old["layers"])
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
    bad = {**raw, "0.layers": "[{"}
    mx.save_safetensors(str(p), arrays, metadata=bad)
    _refused(p, "do not match the sha256 checksum")
    mx.save_safetensors(str(p), arrays, metadata={**bad, "0.sha256": cache_files._digest(arrays, bad)})
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


# --- the checksum covers the whole file ---------------------------------------------------------

def _swap_refs(fields):
    """Layers 0 and 1 name each other's key arrays."""
    a, b = fields["layers"][0]["state"], fields["layers"][1]["state"]
    a["keys"], b["keys"] = b["keys"], a["keys"]


def _swap_data(arrays, fields):
    """The key arrays of layers 0 and 1 change names."""
    arrays["0.keys"], arrays["1.keys"] = arrays["1.keys"], arrays["0.keys"]


@pytest.mark.parametrize("edit", [
    lambda a, f: _swap_refs(f),
    _swap_data,
    lambda a, f: f["layers"][0].update(mode="proxy"),
    lambda a, f: [e.update(real_queries=False) for e in f["layers"]],
    lambda a, f: [e.update(decode="append") for e in f["layers"]],
    lambda a, f: f["layers"][2].update(decode_cap=8),
    lambda a, f: f["layers"][1].update(compile=False),
    lambda a, f: f["layers"][0].update(rollback=2),
    lambda a, f: f["layers"][0].update(backend="reference"),
    lambda a, f: f["layers"][0]["dims"].update(dtype="float16"),
    lambda a, f: f.update(user={"note": "y"}),
    lambda a, f: f.update(layer_params=[{}, {}, {}]),
    lambda a, f: f.update(record={}),
    lambda a, f: f.update(extra=1),
], ids=["layer-array-refs-swapped", "array-names-swapped", "mode", "real_queries", "decode",
        "decode_cap", "compile", "rollback", "backend", "dims", "user", "layer_params", "record",
        "added-field"])
def test_any_change_to_the_metadata_or_arrays_is_refused(saved, tmp_path, edit):
    """A file whose metadata or arrays changed after save is refused by the checksum, before
    any other check: it would have loaded (the edits are consistent) and decoded otherwise."""
    p = _rewrite(saved / "tova.safetensors", tmp_path / "x.safetensors", edit, checksum=False)
    _refused(p, "metadata or array data do not match the sha256 checksum written at save")


def test_format_and_mlx_lm_fields_are_covered_too(saved, tmp_path):
    arrays, raw = mx.load(str(saved / "tova.safetensors"), return_metadata=True)
    for change in ({"0.format": "velox-prompt-cache-2"}, {"1.0": "KVCache"}, {"2.1.1": "x"}):
        mx.save_safetensors(str(tmp_path / "x.safetensors"), arrays, metadata={**raw, **change})
        _refused(tmp_path / "x.safetensors", "do not match the sha256 checksum")


def test_a_file_of_a_newer_format_says_so(saved, tmp_path):
    arrays, raw = mx.load(str(saved / "tova.safetensors"), return_metadata=True)
    mx.save_safetensors(str(tmp_path / "n.safetensors"), arrays,
                        metadata={**raw, "0.format": "velox-prompt-cache-9"})
    _refused(tmp_path / "n.safetensors",
             "saved by a newer velox format 9; this velox reads up to 3")


def _as_format_2(src, dst, edit=None):
    """``src`` as velox format 2 wrote it: entries without dims and artifact, and a checksum of
    the array data only (``edit(fields)`` applied to its metadata first)."""
    arrays, raw = mx.load(str(src), return_metadata=True)
    meta = dict(raw, **{"0.format": "velox-prompt-cache-2", "0.layers": _older(raw["0.layers"])})
    if edit is not None:
        layers = json.loads(meta["0.layers"])
        edit(layers)
        meta["0.layers"] = json.dumps(layers)
    meta["0.sha256"] = cache_files._checksum(arrays)
    mx.save_safetensors(str(dst), arrays, metadata=meta)
    return dst


def test_a_format_2_file_loads_with_a_warning(tiny_llama, saved, tmp_path):
    """Files of the previous format load, their array data verified as that format did, with
    a warning that their metadata cannot be; a change to their arrays is still refused."""
    p = _as_format_2(saved / "h2o.safetensors", tmp_path / "v2.safetensors")
    with pytest.warns(UserWarning, match="velox format 2 .* metadata .* cannot be verified"):
        caches, meta = load_cache(p, tiny_llama)
    ref, _ = load_cache(saved / "h2o.safetensors", tiny_llama)
    assert meta == {"note": "x"}
    assert greedy(tiny_llama, caches, 4, NEXT) == greedy(tiny_llama, ref, 4, NEXT)
    arrays, raw = mx.load(str(p), return_metadata=True)
    arrays["0.keys"] = arrays["0.keys"] + 1
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), arrays, metadata=raw)
    _refused(tmp_path / "bad.safetensors", "the array data do not match the sha256 checksum")
    with pytest.warns(UserWarning):  # the other checks still run on such files
        _refused(_as_format_2(saved / "h2o.safetensors", tmp_path / "r.safetensors",
                              lambda layers: layers[0].update(rollback=10**6)),
                 "rollback=1000000 must be an integer from 0 to ROLLBACK_MAX=64")


# --- a cache saved for another model ------------------------------------------------------------

def _llama(**kw):
    from mlx_lm.models import llama

    args = dict(model_type="llama", hidden_size=128, num_hidden_layers=3, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                rope_theta=10000.0)
    model = llama.Model(llama.ModelArgs(**{**args, **kw}))
    mx.eval(model.parameters())
    return model


def test_a_cache_saved_for_another_model_is_refused(tiny_llama, saved):
    """Same layer count, other kv heads, head dim or dtype: refused at load, naming what
    differs (not at the first forward's matmul)."""
    p = saved / "tova.safetensors"
    _, raw = mx.load(str(p), return_metadata=True)
    assert [e["dims"] for e in json.loads(raw["0.layers"])] == [
        {"batch": 1, "kv_heads": 2, "head_dim": 32, "dtype": "float32"}] * 3
    load_cache(p, _llama())  # the same dims: accepted
    _refused(p, r"layer 0 was saved for another model: it holds kv_heads 2 \(the model's: 1\)",
             model=_llama(num_key_value_heads=1))
    _refused(p, r"head_dim 32 \(the model's: 16\)", model=_llama(hidden_size=64))
    half = _llama()
    half.set_dtype(mx.float16)
    _refused(p, r"dtype float32 \(the model's: float16\); Model gives its layer 0 keys of "
                r"kv_heads=2, head_dim=32, dtype=float16", model=half)
    with mlxlm.query_capture() as taps:  # the probe's forward records no queries
        load_cache(p, tiny_llama)
    assert taps == []


# --- every make_cache argument round-trips --------------------------------------------------------

@pytest.fixture(scope="module")
def spectral_artifact(tiny_llama, tmp_path_factory):
    from velox.adapters import artifacts

    rng = np.random.default_rng(0)
    fits = [artifacts.fit_spectral(rng.standard_normal((200, 2, 32)) * np.linspace(3, 0.1, 32), {})
            for _ in range(3)]
    arrays = {k: np.stack([f[k] for f in fits]) for k in fits[0]}
    path = tmp_path_factory.mktemp("artifact") / "spectral.safetensors"
    artifacts.save_artifact(path, arrays, {"format": artifacts.FORMAT, "method": "spectral",
                                           "model": "tiny", **artifacts.model_dims(tiny_llama)})
    return path


ARGS = [  # (method, make_cache arguments): each argument once, at a value other than its default
    ("h2o", dict(budget=24, grace=4)),
    ("tova", dict(budget=24, backend="mlx")),
    ("tova", dict(budget=24, backend="reference")),
    ("tova", dict(budget=24, real_queries=False)),
    ("tova", dict(budget=24, compile=False)),
    ("tova", dict(budget=24, decode="append", decode_cap=5)),
    ("tova", dict(budget=24, rollback=3)),
    ("tova", dict(budget=24, rollback=mlxlm.ROLLBACK_MAX)),
    ("tova", dict(budget=[16, 20, 24])),
    ("spectral", dict(artifacts=True)),
]


def _config(c):
    return (c.method.key, c.params, c.backend, c.compile, c.real_queries, c.decode, c.decode_cap,
            c.rollback, c.mode, None if c.artifact is None else
            {k: np.asarray(v).tolist() for k, v in c.artifact.items()})


@pytest.mark.parametrize("method, kwargs", ARGS,
                         ids=["method", "backend-mlx", "backend-reference", "real_queries",
                              "compile", "decode", "rollback", "rollback-max", "per-layer-params",
                              "artifacts"])
def test_each_make_cache_argument_round_trips(tiny_llama, spectral_artifact, tmp_path, method, kwargs):
    """What make_cache accepts, save_cache writes and load_cache reads back: the same
    configuration, before the first token and after a few, decoding as the saved caches."""
    if kwargs.get("artifacts"):
        kwargs = dict(kwargs, artifacts=spectral_artifact)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a calibrated method's note
        empty = make_cache(tiny_llama, method, **kwargs)
        fresh = make_cache(tiny_llama, method, **kwargs)
    save_cache(tmp_path / "empty.safetensors", empty)
    back, _ = load_cache(tmp_path / "empty.safetensors", tiny_llama)
    assert [_config(c) for c in back] == [_config(c) for c in fresh]
    assert greedy(tiny_llama, back, 3) == greedy(tiny_llama, fresh, 3)
    save_cache(tmp_path / "after.safetensors", fresh)
    for model in (tiny_llama, None):
        again, _ = load_cache(tmp_path / "after.safetensors", model)
        assert [_config(c) for c in again] == [_config(c) for c in fresh]
        assert [c.offset for c in again] == [c.offset for c in fresh]
        twin = copy.deepcopy(fresh)
        assert greedy(tiny_llama, again, 3, NEXT) == greedy(tiny_llama, twin, 3, NEXT)


@pytest.mark.parametrize("kwargs, match", [
    (dict(compile="yes"), "compile='yes' must be True or False"),
    (dict(compile=1), "compile=1 must be True or False"),
    (dict(real_queries=0), "real_queries=0 must be True or False"),
    (dict(backend="gpu"), "unknown backend 'gpu'"),
    (dict(backend=None), "backend=None must be a backend name"),
    (dict(decode="lazy"), "decode='lazy' must be one of"),
    (dict(decode_cap=0), "decode_cap=0 must be an integer >= 1"),
    (dict(rollback=-1), "rollback=-1 must be an integer from 0 to ROLLBACK_MAX"),
    (dict(artifacts=3), "artifacts=3 must be a path"),
    (dict(budget="24"), "budget"),
    (dict(method=3), "method=3 must be a method key"),
], ids=["compile-str", "compile-int", "real_queries-int", "backend-unknown", "backend-none",
        "decode", "decode_cap", "rollback", "artifacts", "param", "method"])
def test_make_cache_refuses_what_load_cache_would(tiny_llama, kwargs, match, no_shape_checks):
    """Each argument is checked by make_cache (a ValueError naming it), never written to a
    file that load_cache then refuses."""
    kwargs = {"budget": 24, **kwargs}
    with pytest.raises(ValueError, match=match):
        make_cache(tiny_llama, kwargs.pop("method", "tova"), **kwargs)


def _leaves(x, path=()):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))
    else:
        yield path, x


def _changed(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    if isinstance(v, str):
        return v + "x"
    return 0  # None


def test_every_metadata_value_is_covered(saved, tmp_path):
    """Each value of each metadata entry, changed alone (the rest of the file as saved), is
    refused by the checksum."""
    src = saved / "h2o.safetensors"
    arrays, raw = mx.load(str(src), return_metadata=True)
    tried = 0
    for key in ("0.layers", "0.layer_params", "0.record", "0.user"):
        doc = json.loads(raw[key])
        for path, value in _leaves(doc):
            edited = json.loads(raw[key])
            if not path:  # the entry is one value (null)
                edited = _changed(value)
            else:
                at = edited
                for p in path[:-1]:
                    at = at[p]
                at[path[-1]] = _changed(value)
            mx.save_safetensors(str(tmp_path / "x.safetensors"), arrays,
                                metadata={**raw, key: json.dumps(edited)})
            _refused(tmp_path / "x.safetensors", "do not match the sha256 checksum")
            tried += 1
    assert tried > 50
