"""The benchmark scripts run and print what their targets are read from (short runs)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_update_short_run(tmp_path, capsys):
    bench = _load("bench_update")
    out = tmp_path / "rows.json"
    assert bench.main(["--methods", "tova", "kivi", "--steps", "4", "--ref-steps", "1",
                       "--budget", "64", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "compiled/sdpa" in printed and "retraces_after_warmup" in printed
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    tova = rows["tova"]
    assert tova["kept"] == 64  # filled past the budget, then held at it
    assert tova["retraces_after_warmup"] == 0  # a bounded state keeps its shapes
    for col in ("sdpa_us", "mlx_us", "compiled_us", "reference_us"):
        assert tova[col] > 0 and math.isfinite(tova[col])
    assert tova["reference/compiled"] == tova["reference_us"] / tova["compiled_us"]
    assert rows["kivi"]["kept"] > 64  # unbounded: grows by one token a step
    kb = data["kivi_bytes"]
    assert abs(kb["measured/hand"] - 1) < 0.05 and kb["fp16/measured"] > 4.5


def test_bench_update_without_compile(capsys):
    bench = _load("bench_update")
    row = bench.bench_method("streaming_llm", 32, 3, 1, bench.mx.float32, compile_update=False)
    assert row["retraces_after_warmup"] == "n/a" and math.isnan(row["compiled_us"])
    assert math.isnan(row["reference/compiled"])
    assert row["kept"] == 32 and row["mlx_us"] > 0


def test_bench_update_rounds_give_medians_and_ranges(tmp_path, capsys):
    bench = _load("bench_update")
    out = tmp_path / "rows.json"
    assert bench.main(["--methods", "streaming_llm", "--steps", "3", "--ref-steps", "1",
                       "--budget", "32", "--rounds", "3", "--json", str(out)]) == 0
    assert "compiled/sdpa range" in capsys.readouterr().out
    row = json.loads(out.read_text())["rows"][0]
    rounds = row["rounds"]
    assert len(rounds) == 3 and all(r["kept"] == 32 for r in rounds)
    ratios = sorted(r["compiled/sdpa"] for r in rounds)
    assert row["compiled/sdpa"] == ratios[1]  # the median of three
    assert row["compiled/sdpa range"] == f"{ratios[0]:.1f}-{ratios[2]:.1f}"


def test_bench_update_refuses_zero_rounds(capsys):
    bench = _load("bench_update")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--methods", "tova", "--rounds", "0"])
    assert exc.value.code == 2 and "--rounds must be at least 1" in capsys.readouterr().err


def test_codec_attention_short_run(tmp_path, capsys):
    import json
    import runpy

    mod = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "codec_attention.py"))
    out = tmp_path / "a.json"
    assert mod["main"](["--methods", "kivi", "--lengths", "64", "--heads", "2", "--groups", "2",
                        "--dim", "32", "--reps", "2", "--dtype", "float32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["kivi"] and rows[0]["stored"] == 64
    assert all(rows[0][k] > 0 for k in ("attend_us", "deq_us", "full_us", "bytes"))
    assert "attend/deq" in capsys.readouterr().out


@pytest.mark.slow  # runs with --run-slow
def test_decode_speed_short_run(tmp_path, capsys):
    bench = _load("decode_speed")
    out = tmp_path / "speed.json"
    methods = ["tova", "h2o", "streaming_llm", "snapkv", "kivi"]
    assert bench.main(["--model", "tiny-random", "--batch", "1", "2", "--context", "96",
                       "--budget", "48", "--methods", *methods, "--steps", "2", "--reps", "2",
                       "--warmup-rounds", "1", "--chunk", "32", "--resident", "all",
                       "--json", str(out)]) == 0
    assert "| x full |" in capsys.readouterr().out
    data = json.loads(out.read_text())
    meta, rows = data["meta"], data["rows"]
    shape = meta["shape"]
    assert meta["mlx"] and meta["device"] and meta["bandwidth"] > 0
    labels = ["full", "rotating", "tova", "h2o", "streaming_llm", "snapkv", "kivi bits=4"]
    assert [(r["batch"], r["cache"]) for r in rows] == [(b, c) for b in (1, 2) for c in labels]
    decoded = 96 - 1 + 3 * (1 + 2)  # prefill, then 1 + 2 blocks of a warm-up and two steps
    for r in rows:
        assert "error" not in r, r
        b = r["batch"]
        assert r["tokens_seen"] == decoded and len(r["tok_s_blocks"]) == 2
        assert r["tok_s"] > 0 and r["x_full"] > 0 and r["bw_limit_tok_s"] > 0
        assert len(r["x_full_rounds"]) == 2 and min(r["x_full_rounds"]) > 0
        assert r["of_limit"] == r["tok_s"] / r["bw_limit_tok_s"]
        assert r["bw_limit_tok_s"] == b * meta["bandwidth"] / (shape["weight_read_bytes"] + r["kv_bytes"])
        assert r["kv_bytes"] > 0 and r["prefill_peak_bytes"] > 0 and r["decode_peak_bytes"] > 0
        formula = 2 * shape["layers"] * b * shape["kv_heads"] * shape["head_dim"] * 4  # per token
        if r["cache"] == "full":
            assert r["x_full"] == 1.0 and r["stored_tokens"] == decoded
            assert r["kv_bytes"] == formula * decoded <= r["kv_alloc_bytes"]
            full = r
        elif r["cache"] == "kivi bits=4":
            assert r["stored_tokens"] == decoded and r["kv_bytes"] < full["kv_bytes"]
        elif r["cache"] == "snapkv":  # bounded at prefill; decoded tokens are appended
            assert r["stored_tokens"] == 48 + 3 * (1 + 2) and r["kv_bytes"] < full["kv_bytes"]
        else:  # bounded at the budget: flat memory while decoding
            assert r["stored_tokens"] == 48 and r["kv_bytes"] < full["kv_bytes"]
            if r["kind"] == "mlx-lm":
                assert r["kv_bytes"] == formula * 48
            assert r["decode_live_after_bytes"] <= r["decode_live_before_bytes"] + 4096


def test_decode_speed_pipelined_loop_decodes_the_same_tokens():
    """``--loop pipelined`` (mlx-lm's generate_step order: the next step queued before the
    current token is read) runs as many steps as the synchronous loop and reaches the same
    greedy tokens, for mlx-lm's cache and a velox cache."""
    bench = _load("decode_speed")
    import mlx.core as mx
    model, _ = bench.build_model("tiny-random", None, 0)
    prompt = mx.random.randint(0, 100, (2, 40), key=mx.random.key(3))
    for method, params in (("full", {}), ("tova", {"budget": 24})):
        ends = {}
        for loop in ("sync", "pipelined"):
            caches = bench.new_caches(model, method, params)
            bench.prefill(model, prompt[:, :-1], caches, 16)
            _, y = bench.decode_block(model, caches, prompt[:, -1:], 5, loop)
            ends[loop] = (y.tolist(), caches[0].offset)
        assert ends["sync"] == ends["pipelined"], method
        assert ends["sync"][1] == 39 + 1 + 5, method


def test_every_script_imports_velox_before_mlx():
    """A script that imports ``mlx`` imports ``velox`` first: ``import velox`` loads OpenBLAS
    for MLX's CPU matmuls only before ``mlx.core`` is loaded (``velox._blas``), and a CPU
    benchmark that missed it would time the reference BLAS (about 20x slower prefills)."""
    import re
    scripts = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    assert len(scripts) > 10
    late = []
    for path in scripts:
        lines = path.read_text().splitlines()
        first = {kind: next((i for i, line in enumerate(lines)
                             if re.match(rf"(import|from) {kind}\b", line)), None)
                 for kind in ("mlx", "velox")}
        if first["mlx"] is not None and (first["velox"] is None or first["velox"] > first["mlx"]):
            late.append(path.name)
    assert late == []


def test_prefill_cost_times_the_decompositions_and_restores_them():
    """The decomposition timer counts every eigh / svd call of MLX and NumPy while it runs,
    returns their results unchanged, and puts the functions back."""
    import velox  # noqa: F401
    import mlx.core as mx
    import numpy as np

    bench = _load("prefill_cost")
    before = (mx.linalg.eigh, mx.linalg.svd, np.linalg.eigh, np.linalg.svd)
    a = np.array([[2.0, 1.0], [1.0, 3.0]], np.float32)
    total = [0.0]
    with bench.timed_decompositions(total):
        lam, _ = mx.linalg.eigh(mx.array(a), stream=mx.cpu)
        lam_np, _ = np.linalg.eigh(a)
        np.linalg.svd(a)
    assert total[0] > 0
    assert np.allclose(np.array(lam), np.linalg.eigvalsh(a), atol=1e-5)
    assert np.allclose(lam_np, np.linalg.eigvalsh(a))
    assert (mx.linalg.eigh, mx.linalg.svd, np.linalg.eigh, np.linalg.svd) == before
