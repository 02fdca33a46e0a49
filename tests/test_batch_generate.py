"""mlx-lm's batched generation with velox caches: ``batch_generate`` and ``BatchGenerator``
give every sequence exactly its batch-of-one greedy tokens (``generate_step`` with the same
cache settings and ``prefill_step_size``), and the prompt caches they hand back equal the
batch-of-one caches.

Every registered method runs on the small random llama (3 layers: the batch protocol is the
same for any depth); a few, and a request joining a running batch, run on SmolLM2. Prompts of
different lengths and different ``max_tokens`` with ``prefill_step_size=8`` make ragged,
right-padded prompt chunks and rows that finish at different steps; the budgets are tiny so
that eviction, quantization flushes and tail absorptions happen. Greedy fp32 on the CPU:
tokens, positions and integer fields (codes included) are compared exactly; floating state
fields within a relative 2e-3 of the field's largest magnitude, because OpenBLAS rounds the
model's projections of a batch differently from those of one row in the last bits (seen: up
to 2e-5 in float32 fields, one float16 ulp in a residual window), which a row's update and
attention then carry.
"""

import numpy as np

from types import SimpleNamespace

import mlx.core as mx
import pytest

from tests._helpers import every_method
from mlx.utils import tree_flatten
from mlx_lm import batch_generate
from mlx_lm.generate import BatchGenerator, generate_step

import velox
from velox.adapters.mlxlm import VeloxCache, make_cache
from velox.registry import get_method, method_keys
from velox.spec import validate_params

pytestmark = pytest.mark.unchecked

STEP = 8
# Tiny sizes: every parameter a method has of these names takes this value.
TINY = dict(budget=10, window_size=10, obs_window=4, residual_length=2, recent=2, n_sink=2,
            grace=2, chunk_size=4, window=8, recent_boundary=8, mid_boundary=16, merge_window=4,
            threshold_window=8, basis="prefill")


def tiny(key: str) -> dict:
    spec = get_method(key).spec
    params = {k: v for k, v in TINY.items() if k in spec.params}
    validate_params(spec, params)
    return params


def alone(model, prompt, n, key, params, eos=()):
    """The batch-of-one greedy run: ``n`` tokens (fewer at an end-of-sequence token, which
    batch_generate does not return) and its caches."""
    caches = make_cache(model, key, **params)
    out = []
    for t, _ in generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=n,
                              prefill_step_size=STEP):
        if int(t) in eos:
            break
        out.append(int(t))
    return out, caches


def _close(x: mx.array, y: mx.array) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not mx.issubdtype(x.dtype, mx.floating):
        return bool(mx.array_equal(x, y))
    x, y = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
    same = np.isfinite(y)
    return bool((np.isfinite(x) == same).all() and np.allclose(
        x[same], y[same], rtol=0, atol=2e-3 * (np.abs(y[same]).max(initial=0) + 1e-30)))


def assert_same_caches(got, want):
    """Same offsets, sizes and positions; the same state fields (see the module docstring);
    the keys and values attention reads close. A basis of a low-rank factorization (CurDKV's
    ``*_basis``) is left to ``get_kv``: its sign follows the BLAS's rounding."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert isinstance(a, VeloxCache)
        assert (a.offset, a.size()) == (b.offset, b.size())
        assert bool(mx.array_equal(a.positions(), b.positions()))
        sa, sb = a.velox_state, b.velox_state
        assert type(sa) is type(sb)
        for name, x, y in zip(sa._fields, sa, sb):
            if name.endswith("_basis"):
                continue
            la, lb = tree_flatten(x), tree_flatten(y)
            assert [k for k, _ in la] == [k for k, _ in lb], name
            for (_, u), (_, w) in zip(la, lb):
                assert (_close(u, w) if isinstance(u, mx.array) else u == w), name
        assert all(_close(u, w) for u, w in zip(velox.get_kv(sa), velox.get_kv(sb)))


def check_batch(model, tokenizer, prompts, max_tokens, key, params, eos=()):
    caches = [make_cache(model, key, **params) for _ in prompts]
    r = batch_generate(model, tokenizer, prompts, prompt_caches=caches, max_tokens=max_tokens,
                       prefill_step_size=STEP, return_token_ids=True, return_prompt_caches=True)
    for prompt, n, got, got_cache in zip(prompts, max_tokens, r.token_ids, r.caches):
        want, want_cache = alone(model, prompt, n, key, params, eos)
        assert got == want
        assert_same_caches(got_cache, want_cache)
    return r


# -- every method, on the small random llama ---------------------------------------------

TOKENIZER = SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
PROMPTS = [[(5 * i + 3) % 97 for i in range(20)], [(7 * i + 1) % 97 for i in range(6)],
           [(11 * i + 2) % 97 for i in range(13)]]
MAX_TOKENS = [10, 6, 12]


@pytest.mark.parametrize("key", every_method())
def test_batch_generate_equals_batch_of_one_for_every_method(tiny_llama, key):
    """A method whose codes follow the BLAS's rounding (``contract.blas_codes``: a basis fitted
    to the prefill, where OpenBLAS rounds a batch's projections otherwise than one row's, and a
    coefficient on a cell boundary codes to either side) is checked in a process without
    OpenBLAS, where a row's arithmetic is the same alone and in a batch."""
    from velox import _blas
    if get_method(key).spec.contract.get("blas_codes") and _blas.loaded:
        import os
        import subprocess
        import sys
        node = f"{__file__}::test_batch_generate_equals_batch_of_one_for_every_method[{key}]"
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "--run-slow", node],
                             env={**os.environ, "VELOX_NO_OPENBLAS": "1"}, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
        return
    check_batch(tiny_llama, TOKENIZER, PROMPTS, MAX_TOKENS, key, tiny(key))


@pytest.mark.parametrize("params", [dict(budget=10, decode="append", decode_cap=4),
                                    dict(budget=10, real_queries=False)],
                         ids=["append", "proxy"])
def test_batch_generate_in_append_and_proxy_modes(tiny_llama, params):
    check_batch(tiny_llama, TOKENIZER, PROMPTS, MAX_TOKENS, "tova", params)


def test_a_cache_with_history_merges_with_empty_ones(tiny_llama):
    """One request brings a cache that already holds a conversation (prompt and reply);
    the others bring empty ones."""
    params = dict(budget=10)
    history = make_cache(tiny_llama, "tova", **params)
    first = [int(t) for t, _ in generate_step(mx.array(PROMPTS[0]), tiny_llama, prompt_cache=history,
                                              max_tokens=5, prefill_step_size=STEP)]
    follow = [3, 14, 15, 92, 65]
    caches = [history, make_cache(tiny_llama, "tova", **params), make_cache(tiny_llama, "tova", **params)]
    r = batch_generate(tiny_llama, TOKENIZER, [follow, PROMPTS[1], PROMPTS[2]], prompt_caches=caches,
                       max_tokens=[8, 6, 7], prefill_step_size=STEP, return_token_ids=True)
    cont = make_cache(tiny_llama, "tova", **params)
    assert [int(t) for t, _ in generate_step(mx.array(PROMPTS[0]), tiny_llama, prompt_cache=cont,
                                             max_tokens=5, prefill_step_size=STEP)] == first
    want = [int(t) for t, _ in generate_step(mx.array(follow), tiny_llama, prompt_cache=cont,
                                             max_tokens=8, prefill_step_size=STEP)]
    assert r.token_ids[0] == want
    assert r.token_ids[1] == alone(tiny_llama, PROMPTS[1], 6, "tova", params)[0]
    assert r.token_ids[2] == alone(tiny_llama, PROMPTS[2], 7, "tova", params)[0]


# -- SmolLM2 -------------------------------------------------------------------------------

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity")


@pytest.fixture(scope="module")
def smol(smollm2):
    model, tok = smollm2
    ids = tok.encode(TEXT)
    return model, tok, [ids[:20], ids[4:10], ids[7:20]]


@pytest.mark.model
@pytest.mark.parametrize("key,params", [
    ("tova", dict(budget=10)),
    # a quantizer on the real model too (every family runs on the tiny model by default)
    pytest.param("kivi", dict(residual_length=2), marks=pytest.mark.slow)])
def test_batch_generate_on_smollm2(smol, key, params):
    model, tok, prompts = smol
    check_batch(model, tok, prompts, [10, 6, 12], key, params, eos=set(tok.eos_token_ids))


@pytest.mark.model
def test_a_request_joins_a_running_batch(smol):
    """BatchGenerator: two requests decode for three steps, then a third is inserted; it is
    prefilled between the running batch's steps and joins it. Every sequence equals its
    batch-of-one run."""
    model, tok, prompts = smol
    params = dict(budget=10, decode="append", decode_cap=4)
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tok.eos_token_ids], prefill_step_size=STEP)
    max_tokens = [10, 8, 9]
    got: dict[int, list[int]] = {}
    caches: dict[int, list] = {}

    def collect(responses):
        for r in responses:
            if r.finish_reason != "stop":
                got.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache

    uids = gen.insert(prompts[:2], max_tokens[:2],
                      caches=[make_cache(model, "tova", **params) for _ in range(2)])
    for _ in range(3):
        collect(gen.next_generated())
    uids += gen.insert(prompts[2:], max_tokens[2:], caches=[make_cache(model, "tova", **params)])
    while responses := gen.next_generated():
        collect(responses)
    gen.close()
    eos = set(tok.eos_token_ids)
    for uid, prompt, n in zip(uids, prompts, max_tokens):
        want, want_cache = alone(model, prompt, n, "tova", params, eos)
        assert got[uid] == want
        assert_same_caches(caches[uid], want_cache)


# -- the benchmark script ------------------------------------------------------------------

@pytest.mark.slow  # runs with --run-slow
def test_benchmark_short_run(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "batch_generate.py"
    spec = importlib.util.spec_from_file_location("bench_batch_generate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--model", "tiny-random", "--batch", "1", "2", "--context", "24", "--budget", "8",
                       "--max-tokens", "3", "--prefill-step", "8", "--per-row", "--json", str(out)]) == 0
    assert "| batch | cache |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["cache"]) for r in rows] == [
        (b, c) for b in (1, 2) for c in ("mlx-lm", "tova budget=8", "kivi bits=4", "tova budget=8 (per row)")]
    assert [r["joined"] for r in rows[:4]] == [True, True, True, False]  # (kivi never joins: no per-row twin)
    for r in rows:
        assert r["generation_tokens"] == 3 * r["batch"] and r["prompt_tokens"] > 0
        assert r["total_tok_s"] > 0 and r["peak_bytes"] > 0
    by = {(r["batch"], r["method"]): r for r in rows}
    # 24 prompt + 3 new tokens per row: mlx-lm holds them all, TOVA its 8 (2 layers, 2 kv
    # heads, head_dim 32, float32: 8 * 2 * 2 * 32 * 4 * 2 bytes of keys and values, and its
    # positions and scores), KIVI 4-bit codes.
    assert by[(2, "mlx-lm")]["kv_bytes_per_row"] == 27 * 2 * 2 * 32 * 4 * 2
    assert by[(2, "tova")]["kv_bytes_per_row"] < by[(2, "mlx-lm")]["kv_bytes_per_row"] / 2
    assert by[(2, "kivi")]["kv_bytes_per_row"] < by[(2, "mlx-lm")]["kv_bytes_per_row"]
