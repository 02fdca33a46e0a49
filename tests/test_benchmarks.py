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
