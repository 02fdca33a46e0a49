"""The ``velox`` command: argument errors (exit 2, one line, no traceback), the method table,
how compare turns budgets into parameters, OpenBLAS re-execution, and short runs on SmolLM2."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from velox import _blas
from velox.adapters import cli
from velox.registry import get_method, method_keys
from velox.spec import method_table


def run_main(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--method", "nope", "hi"], "unknown method 'nope'"),
    (["generate", "--method", "tova", "--budget", "2", "hi"], "budget=2 must be > n_sink=4"),
    (["generate", "--method", "streaming_llm", "--budget", "3", "hi"], "leaves no room"),
    (["generate", "--model", "/nonexistent/velox-model", "hi"], "/nonexistent/velox-model"),
    (["generate", "--param", "budget", "hi"], "--param expects key=value"),
    (["generate", "--method", "tova", "--param", "colour=3", "hi"], "unknown parameter(s) colour"),
    (["generate", "--method", "kivi", "--budget", "64", "hi"], "no budget or window"),
    (["generate", "--method", "full", "--budget", "64", "hi"], "full cache takes no"),
    (["compare", "--methods", "tova,nope"], "unknown method 'nope'"),
    (["compare", "--methods", "tova", "--budgets", "2"], "budget=2 must be > n_sink=4"),
    (["compare", "--methods", "tova", "--param", "bits=2"], "no compared method has"),
    (["compare", "--methods", "kivi", "--param", "bits=9"], "bits=9 is not one of"),
    (["compare", "--methods", "tova", "--param", "h2o.grace=3"], "which is not compared"),
    (["compare", "--methods", "tova", "--context", "64", "--prefix", "64"], "--prefix"),
    (["compare", "--methods", "tova", "--passkey-depths", "1.5"], "--passkey-depths"),
    (["compare", "--methods", "tova", "--text", "nope"], "unknown text 'nope'"),
    (["compare", "--methods", "tova", "--text", "/nonexistent/t.txt"], "does not exist"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, needle):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("velox: error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["compare", "--budgets", "x"], ["generate"], ["frobnicate"],
                                  ["generate", "--max-tokens", "0", "hi"]])
def test_argparse_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_bad_arguments_in_a_subprocess(tmp_path):
    env = dict(os.environ, VELOX_NO_OPENBLAS="1")
    r = subprocess.run([sys.executable, "-m", "velox.adapters.cli", "generate", "--method", "nope",
                        "hi"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("velox: error: unknown method 'nope'")


_MATMUL = """
import sys, time
{first}
import mlx.core as mx
from velox import _blas
a = mx.random.normal((512, 512)); mx.eval(a)
mx.eval(a @ a)
best = float("inf")
for _ in range(5):
    t = time.perf_counter(); mx.eval(a @ a); best = min(best, time.perf_counter() - t)
maps = open("/proc/self/maps").read()
print(_blas.loaded is not None, _blas.OPENBLAS in maps, best, _blas.reason)
"""


def _matmul_run(first: str, **env) -> tuple[bool, bool, float, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VELOX_NO_OPENBLAS")}
    r = subprocess.run([sys.executable, "-c", _MATMUL.format(first=first)], capture_output=True,
                       text=True, env={**clean, **env}, timeout=300, check=True)
    loaded, mapped, best, reason = r.stdout.split(" ", 3)
    return loaded == "True", mapped == "True", float(best), reason.strip()


@pytest.mark.skipif(not os.path.exists(_blas.OPENBLAS), reason="OpenBLAS is not installed "
                    "(apt-get install libopenblas0-pthread)")
def test_import_velox_loads_openblas_in_process():
    """Without LD_PRELOAD, ``import velox`` before mlx.core puts OpenBLAS under MLX's matmuls
    (several times faster); VELOX_NO_OPENBLAS=1 and a late import leave MLX's own BLAS."""
    on = _matmul_run("import velox")
    off = _matmul_run("import velox", VELOX_NO_OPENBLAS="1")
    late = _matmul_run("import mlx.core; import velox")
    assert on[:2] == (True, True) and on[3] == "loaded before mlx.core"
    assert off[:2] == (False, False) and "VELOX_NO_OPENBLAS" in off[3]
    assert late[:2] == (False, False) and "imported before velox" in late[3]
    assert on[2] * 3 < off[2], (on, off)  # 512x512 fp32: ~1 ms against ~45 ms on 2 cores


def test_methods_prints_the_spec_table(capsys):
    code, out, err = run_main(capsys, "methods")
    assert code == 0 and out == method_table() and err == ""
    for key in ("tova", "kivi", "streaming_llm"):
        assert f"| `{key}` |" in out


def test_parse_param():
    assert cli.parse_param("budget=256") == ("budget", 256)
    assert cli.parse_param("decay=0.5") == ("decay", 0.5)
    assert cli.parse_param("per_head=true") == ("per_head", True)
    assert cli.parse_param("pooling=maxpool") == ("pooling", "maxpool")
    with pytest.raises(ValueError, match="key=value"):
        cli.parse_param("=3")


def test_budgets_become_each_methods_parameters():
    configs = cli.method_configs(list(cli.CORE_METHODS), [64, 256], [])
    by = {}
    for m, p in configs:
        by.setdefault(m, []).append(p)
    assert by["tova"] == [{"budget": 64}, {"budget": 256}]
    assert by["streaming_llm"] == [{"window_size": 60}, {"window_size": 252}]  # n_sink=4 + window
    assert by["kivi"] == [{}, {"bits": 2, "residual_length": 32}]  # default, aggressive preset
    spec = get_method("streaming_llm").spec
    for p in by["streaming_llm"]:
        assert spec.capacity({**spec.defaults, **p}) in (64, 256)
    # a global --param reaches every method that has it; the window follows the sinks
    configs = cli.method_configs(["streaming_llm", "tova", "kivi"], [64], ["n_sink=2"])
    assert ("streaming_llm", {"n_sink": 2, "window_size": 62}) in configs
    assert ("tova", {"n_sink": 2, "budget": 64}) in configs and ("kivi", {}) in configs
    # an explicit budget wins over --budgets; a scoped parameter reaches one method
    assert cli.method_configs(["tova", "h2o"], [64, 128], ["tova.budget=100", "h2o.grace=2"]) == [
        ("tova", {"budget": 100}), ("h2o", {"grace": 2, "budget": 64}), ("h2o", {"grace": 2, "budget": 128})]


def test_quantizers_run_at_default_and_their_aggressive_preset():
    assert cli.method_configs(["kivi"], [64], ["bits=4", "residual_length=32"]) == [
        ("kivi", {"bits": 4, "residual_length": 32})]  # the user's values leave nothing to vary
    seen = 0
    for key in method_keys():
        spec = get_method(key).spec
        if cli.budget_params(key, 64, {}) is not None:
            continue
        configs = cli.method_configs([key], [64], [])
        assert configs[0] == (key, {})
        if "aggressive" in spec.presets:
            assert configs[1] == (key, dict(spec.presets["aggressive"]))
            seen += 1
        elif len(configs) == 2:  # no preset: every bit width at its minimum
            for n, v in configs[1][1].items():
                p = spec.params[n]
                assert "bit" in n and v == (min(p.choices) if p.type == "choice" else p.min) != p.default
    assert seen >= 10  # the quantizers ship an aggressive preset


# --- on SmolLM2 ----------------------------------------------------------------------

@pytest.mark.model
def test_compare_end_to_end_writes_json_csv_png(capsys, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run_main(
        capsys, "compare", "--methods", "tova,streaming_llm", "--budgets", "48", "--context", "112",
        "--chunk", "16", "--new-tokens", "4", "--passkey-lengths", "160", "--passkey-depths", "0.5",
        "--text", "holmes", "--out", str(out))
    assert code == 0, err
    data = json.loads((out / "compare.json").read_text())
    rows = data["rows"]
    assert [r["method"] for r in rows] == ["full", "tova", "streaming_llm"]
    assert [r["params"] for r in rows] == ["", "budget=48", "window_size=44"]
    full, tova, stream = rows
    assert full["agreement"] == 1.0 and full["kl"] == 0.0 and full["ppl_delta_pct"] == 0.0
    assert full["passkey"] == 1.0  # the 135M model finds a key in 160 tokens
    assert tova["kv_bytes"] < full["kv_bytes"] and stream["kv_bytes"] < full["kv_bytes"]
    assert tova["tokens_seen"] == full["tokens_seen"] == 112 + 4 - 1
    for r in rows:
        assert r["ppl"] > 1 and r["decode_tok_s"] > 0 and 0 <= r["agreement"] <= 1
        assert r["ratio"] == pytest.approx(r["fp16_bytes"] / r["kv_bytes"])
    assert data["settings"]["context"] == 112 and data["settings"]["wall_seconds"] > 0
    with open(out / "compare.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == ["full", "tova", "streaming_llm"]
    assert float(table[1]["ppl"]) == pytest.approx(tova["ppl"])
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "compare.md").read_text()
    assert md in stdout and "| `tova` | budget=48 |" in md


@pytest.mark.model
def test_generate_streams_and_reports(capsys):
    code, out, err = run_main(capsys, "generate", "--method", "tova", "--budget", "32",
                              "--max-tokens", "12", "What is the capital of France?")
    assert code == 0, err
    answer, stats = out.strip().rsplit("\n", 1)
    assert "Paris" in answer
    assert stats.startswith("[tova budget=32] KV cache ") and "x vs fp16" in stats
    assert "decode" in stats and "tok/s" in stats
