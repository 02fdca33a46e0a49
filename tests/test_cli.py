"""The ``velox`` command: argument errors (exit 2, one line, no traceback), the method table,
how compare turns budgets into parameters, OpenBLAS re-execution, and short runs on SmolLM2."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
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
    (["compare", "--methods", "tova", "--context", "1"], "--context must be at least 2 (one context token and one scored), got 1"),
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
print(_blas.loaded is not None, (_blas.loaded or _blas.OPENBLAS) in maps, best, _blas.reason)
"""


def _matmul_run(first: str, cwd, **env) -> tuple[bool, bool, float, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VELOX_NO_OPENBLAS")}
    r = subprocess.run([sys.executable, "-c", _MATMUL.format(first=first)], capture_output=True,
                       text=True, env={**clean, **env}, timeout=300, check=True, cwd=cwd)
    loaded, mapped, best, reason = r.stdout.split(" ", 3)
    return loaded == "True", mapped == "True", float(best), reason.strip()


@pytest.mark.skipif(not os.path.exists(_blas.OPENBLAS), reason="OpenBLAS is not installed "
                    "(apt-get install libopenblas0-pthread)")
def test_import_velox_loads_openblas_in_process(tmp_path):
    """Without LD_PRELOAD, ``import velox`` before mlx.core puts OpenBLAS under MLX's matmuls
    (several times faster); VELOX_NO_OPENBLAS=1 and a late import leave MLX's own BLAS."""
    on = _matmul_run("import velox", tmp_path)  # (not in the checkout: the installed velox)
    off = _matmul_run("import velox", tmp_path, VELOX_NO_OPENBLAS="1")
    late = _matmul_run("import mlx.core; import velox", tmp_path)
    assert on[:2] == (True, True) and on[3].startswith("loaded before mlx.core")
    assert off[:2] == (False, False) and "VELOX_NO_OPENBLAS" in off[3]
    assert late[:2] == (False, False) and "imported before velox" in late[3]
    assert on[2] * 3 < off[2], (on, off)  # 512x512 fp32: ~1 ms against ~45 ms on 2 cores


@pytest.mark.skipif(not os.path.exists(_blas.OPENBLAS), reason="OpenBLAS is not installed "
                    "(apt-get install libopenblas0-pthread)")
def test_a_late_import_warns_that_openblas_was_not_loaded(tmp_path):
    """``import mlx.core`` (or mlx_lm) before velox leaves MLX's bundled BLAS under the CPU
    matmuls: velox says so once, with what to do; imported first, it says nothing."""
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VELOX_NO_OPENBLAS")}

    def stderr(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=clean, timeout=300, check=True, cwd=tmp_path).stderr

    late = stderr("import mlx.core; import velox")
    assert "RuntimeWarning" in late and "Import velox before mlx" in late and _blas.OPENBLAS in late
    assert "OpenBLAS" not in stderr("import velox; import mlx.core")


def _no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(cli, "_load", refuse)


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--no-chat", ""], "the prompt is empty"),
    (["generate", "--no-chat", "  "], "the prompt is empty"),
    (["compare", "--methods", "tova", "--out", "{file}/sub"], "cannot create the folder"),
    (["compare", "--methods", "tova", "--out", "{file}"], "cannot create the folder"),
    (["compare", "--methods", "tova", "--out", "{dir}"], "compare.json is a folder"),
])
def test_errors_come_before_the_model_loads(capsys, monkeypatch, tmp_path, argv, needle):
    _no_model(monkeypatch)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "d" / "compare.json").mkdir(parents=True)
    argv = [a.format(file=tmp_path / "a-file", dir=tmp_path / "d") for a in argv]
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("velox: error: ") and needle in err, err


def test_every_option_says_what_it_does():
    parser = cli._parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subs.items():
        for action in sub._actions:
            if action.dest in ("help", "verbose"):
                continue
            assert action.help, f"velox {name} {action.option_strings or action.dest} has no help"
            if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
                shown = ",".join(map(str, action.default)) if isinstance(action.default, list) \
                    else str(action.default)
                assert shown in action.help, (name, action.option_strings, action.help)


def test_methods_fits_the_terminal_and_markdown_is_a_flag(capsys, monkeypatch):
    for columns in (80, 120):
        monkeypatch.setenv("COLUMNS", str(columns))
        code, out, err = run_main(capsys, "methods")
        assert code == 0 and err == ""
        lines = out.splitlines()
        assert max(map(len, lines)) <= columns
        table, rest = lines[:lines.index("")], lines[lines.index("") + 1:]
        keys = [line.split()[0] for line in table[2:] if not line.startswith(" ")]
        # the compositions --method takes are listed under the table
        composed = sorted(k for k in method_keys() if "+" in k)
        assert composed and rest[0].startswith("compositions")
        listed = " ".join(line for line in rest if line.startswith("    "))
        assert listed.replace(",", " ").split() == composed
        assert keys == sorted(get_method(k).spec.key for k in keys) and "tova" in keys
        assert len(keys) == len(method_table().splitlines()) - 2
    assert "budget=512, n_sink=4, per_head=False" in out
    code, out, err = run_main(capsys, "methods", "--markdown")
    assert code == 0 and out == method_table() and err == ""
    for key in ("tova", "kivi", "streaming_llm"):
        assert f"| `{key}` |" in out


def test_pareto_keeps_what_nothing_beats():
    pts = [(3.0, 17.0), (2.8, 16.9), (2.9, 15.9), (11.3, 15.4), (11.4, 15.42), (33.7, 15.42),
           (12.0, 15.37)]
    assert cli.pareto(pts, lower_is_better=True) == [1, 2, 3, 6]
    acc = [(2.8, 0.0), (2.9, 0.5), (4.7, 0.5), (11.3, 1.0), (33.7, 1.0)]
    assert cli.pareto(acc, lower_is_better=False) == [0, 1, 3]
    assert cli.pareto([], lower_is_better=True) == []


def _rows(n: int = 3) -> list[dict]:
    base = dict(params="", capacity=None, kv_bytes=2**20, ratio_vs_full=1.0, ratio_vs_fp16=0.5,
                fp16_bytes=2**19, dense_bytes=2**20, dtype="float32", tokens_seen=100,
                tokens_stored=100, ppl=10.0, nll=2.3, ppl_delta_pct=0.0, passkey=1.0,
                passkey_cells={}, agreement=1.0, first_divergence=4, kl=0.0, top1=1.0,
                decode_tok_s=10.0, seconds=1.0, phase_seconds={}, load_before=0.5,
                load_after=0.7, cpu_per_wall=1.0)
    return [dict(base, method=m, kv_bytes=2**20 >> i, ppl=10.0 + i, capacity=None if i == 0 else 64)
            for i, m in enumerate(["full", "tova", "h2o"][:n])]


def test_a_failed_write_loses_nothing_else(tmp_path):
    out = tmp_path / "run"
    (out / "compare.csv").mkdir(parents=True)  # this one cannot be written
    args = cli._parser().parse_args(["compare"])
    load = {"before": 0.5, "after": 0.6, "cpu_per_wall": 1.0}
    failed = cli._write(out, _rows(), "the table\n", args, 1.0, 1.0, 256, load)
    assert list(failed) == ["compare.csv"] and failed["compare.csv"]
    assert json.loads((out / "compare.json").read_text())["rows"][1]["method"] == "tova"
    assert (out / "compare.md").read_text() == "the table\n"
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_notes_say_what_ratios_and_speed_are_against():
    rows = _rows()
    notes = cli._notes(rows, {"before": 0.4, "after": 2.5, "cpu_per_wall": 1.8}, 16)
    assert "*vs full*: the full cache of this run, 1.00 MiB" in notes[0]
    assert "float32" in notes[0] and "100 tokens seen" in notes[0]
    assert "*vs fp16*" in notes[0] and "512.00 KiB" in notes[0]
    assert "15 whole-model decode steps" in notes[1] and "0.40 before" in notes[1]
    assert "2.50 after" in notes[1] and "1.80 CPU-seconds per second" in notes[1]
    md = cli._markdown(rows, 16, notes)
    assert "| ratio vs full | ratio vs fp16 |" in md and md.endswith(notes[1] + "\n")


def test_parse_param():
    assert cli.parse_param("budget=256") == ("budget", 256)
    assert cli.parse_param("decay=0.5") == ("decay", 0.5)
    assert cli.parse_param("per_head=true") == ("per_head", True)
    assert cli.parse_param("pooling=maxpool") == ("pooling", "maxpool")
    assert cli.parse_param("bit_schedule=8,4,2,1,1,0,0,0") == ("bit_schedule", "8,4,2,1,1,0,0,0")
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
        assert r["ratio_vs_fp16"] == pytest.approx(r["fp16_bytes"] / r["kv_bytes"])
        assert r["ratio_vs_full"] == pytest.approx(full["kv_bytes"] / r["kv_bytes"])
        assert r["dense_bytes"] == 2 * r["fp16_bytes"] and r["dtype"] == "float32"
        assert r["load_before"] >= 0 and r["cpu_per_wall"] > 0
    assert full["ratio_vs_full"] == 1.0 and tova["ratio_vs_full"] > 1
    assert full["tokens_stored"] == 115 and tova["tokens_stored"] == stream["tokens_stored"] == 48
    assert data["settings"]["context"] == 112 and data["settings"]["wall_seconds"] > 0
    with open(out / "compare.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == ["full", "tova", "streaming_llm"]
    assert float(table[1]["ppl"]) == pytest.approx(tova["ppl"])
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "compare.md").read_text()
    assert md in stdout and "| `tova` | budget=48 |" in md
    assert "*vs full*: the full cache of this run" in md and "decode tok/s:" in md
    assert f"wrote {out / 'compare.json'}, {out / 'compare.csv'}" in stdout


@pytest.mark.model
def test_generate_streams_and_reports(capsys):
    code, out, err = run_main(capsys, "generate", "--method", "tova", "--budget", "32",
                              "--max-tokens", "12", "What is the capital of France?")
    assert code == 0, err
    answer, stats = out.strip().rsplit("\n", 1)
    assert "Paris" in answer
    assert stats.startswith("[tova budget=32] KV cache ")
    found = re.search(r"holding (\d+) of the (\d+) tokens seen; a full float32 cache of them "
                      r"[\d.]+ [KM]iB \(([\d.]+)x the bytes held\), as fp16 [\d.]+ [KM]iB "
                      r"\(([\d.]+)x\)", stats)
    assert found, stats
    stored, seen, vs_full, vs_fp16 = found.groups()
    assert int(stored) == 32 < int(seen) and float(vs_full) == pytest.approx(2 * float(vs_fp16), abs=0.011)
    assert "decode" in stats and "tok/s" in stats


def test_eval_is_a_subcommand(tmp_path, capsys):
    """``velox eval`` reaches the quality suite: its merge path runs through ``cli.main``."""
    assert cli._parser().parse_args(["eval", "--quick", "--methods", "tova"]).command == "eval"
    assert cli.main(["eval", "--merge", str(tmp_path / "a.json")]) == 2
    assert "--merge needs --out" in capsys.readouterr().err


def test_compare_refuses_bad_artifacts(capsys, tmp_path):
    code, _, err = run_main(capsys, "compare", "--methods", "spectral", "--artifacts", "spectral")
    assert code == 2 and "METHOD=FILE" in err
    code, _, err = run_main(capsys, "compare", "--methods", "tova", "--artifacts",
                            f"spectral={tmp_path / 'a.safetensors'}")
    assert code == 2 and "not among --methods" in err
    code, _, err = run_main(capsys, "compare", "--methods", "spectral", "--artifacts",
                            f"spectral={tmp_path / 'missing.safetensors'}")
    assert code == 2 and "no file" in err
