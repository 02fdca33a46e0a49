"""The quality suite (velox.adapters.suite): generators, scoring, intervals, caches, outputs."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from velox.adapters import suite  # noqa: E402


class CharTokenizer:
    """Printable ASCII and newline, one token each, plus an end-of-turn token (97 ids)."""

    eos_token_ids = {96}
    chat_template = None

    def encode(self, text):
        return [ord(c) - 32 if 32 <= ord(c) < 127 else (95 if c == "\n" else 0) for c in text]

    def decode(self, ids):
        return "".join(chr(i + 32) if i < 95 else ("\n" if i == 95 else "") for i in ids)


TOK = CharTokenizer()
# sizes for the tiny model: one token per character, so prompts are longer in tokens
TINY = replace(suite.QUICK, lengths=(1400,), depths=(0.3, 0.8), prompts=1, stream_tokens=160,
               stream_prefix=64, stream_chunk=16, decode_tokens=120, decode_span=8,
               cont_samples=2, cont_prefix=96, cont_tokens=16, prefill_chunk=256, chat=False)


# --- generators and scoring ---------------------------------------------------------

def test_samples_are_deterministic_and_exact():
    a = suite.samples(TOK, TINY)
    b = suite.samples(TOK, TINY)
    assert [(s.context, s.question, s.expected) for s in a] == \
        [(s.context, s.question, s.expected) for s in b]
    other = suite.samples(TOK, replace(TINY, seed=1))
    assert [s.expected for s in other] != [s.expected for s in a]
    assert [s.task for s in a] == ["passkey"] * 2 + ["multikey"] * 2 + ["multivalue"] * 2 + \
        ["vartrack"] * 2 + ["cwe"] * 2
    for s in a:
        assert len(s.context) + len(s.question) == s.length == 1400


def test_samples_do_not_depend_on_the_other_tasks():
    alone = suite.samples(TOK, replace(TINY, tasks=("multivalue",)))
    together = [s for s in suite.samples(TOK, TINY) if s.task == "multivalue"]
    assert [s.context for s in alone] == [s.context for s in together]


def test_needles_hold_the_answers():
    for s in suite.samples(TOK, TINY):
        context = TOK.decode(s.context)
        question = TOK.decode(s.question)
        if s.task == "passkey":
            (key,) = s.expected
            at = s.needles_at[0]
            assert TOK.decode(s.context[at:]).startswith(f"\n\nThe pass key is {key}.")
        elif s.task == "multikey":
            (value,) = s.expected
            key = question.split("magic number for ")[1].split(" ")[0]
            assert f"magic numbers for {key} is: {value}." in context
            assert context.count("special magic numbers for") == 4
        elif s.task == "multivalue":
            key = question.split("magic numbers for ")[1].split(" ")[0]
            for v in s.expected:
                assert f"magic numbers for {key} is: {v}." in context
        elif s.task == "vartrack":
            first, *rest = s.expected
            value = question.split("the value ")[1].split(" ")[0]
            assert f"VAR {first} = {value}." in context
            for prev, name in zip(s.expected, rest):
                assert f"VAR {name} = {prev}." in context
        else:
            words = [line.split(". ", 1)[1] for line in context.splitlines()
                     if ". " in line and line.split(". ", 1)[0].isdigit()]
            counts = {w: words.count(w) for w in set(words)}
            common = min(counts[w] for w in s.expected)
            assert all(n < common for w, n in counts.items() if w not in s.expected)


def test_needle_depth_orders_positions():
    a, b = [s for s in suite.samples(TOK, TINY) if s.task == "passkey"]
    assert (a.depth, b.depth) == (0.3, 0.8)
    assert 0.2 < a.needles_at[0] / len(a.context) < 0.45 < 0.7 < b.needles_at[0] / len(b.context)


def test_score_is_ruler_string_match():
    assert suite.score("The pass key is 12345.", ["12345"]) == 1.0
    assert suite.score(" 1234", ["12345"]) == 0.0
    assert suite.score("ABC, def and 99", ["abc", "DEF", "ghi", "100"]) == 0.5
    assert suite.score("", ["x"]) == 0.0
    with pytest.raises(ValueError, match="expected"):
        suite.score("x", [])


def test_too_short_prompt_is_a_value_error():
    with pytest.raises(ValueError, match="length=100 is too short"):
        suite.samples(TOK, replace(TINY, lengths=(100,)))


# --- intervals ----------------------------------------------------------------------

def test_wilson_on_known_counts():
    lo, hi = suite.wilson(5, 10)
    assert lo == pytest.approx(0.23659, abs=1e-4) and hi == pytest.approx(0.76341, abs=1e-4)
    assert suite.wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-4)
    assert suite.wilson(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-4)
    # Newcombe (1998), Stat. Med. 17:857, table II: 81/263 -> 0.2553 to 0.3662
    assert suite.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    lo, hi = suite.wilson(81, 100, confidence=0.9)  # z = 1.6449
    assert lo == pytest.approx(0.7376, abs=1e-4) and hi == pytest.approx(0.8660, abs=1e-4)
    with pytest.raises(ValueError):
        suite.wilson(3, 2)


def test_bootstrap_intervals():
    assert suite.bootstrap_mean([0.5] * 7) == (0.5, 0.5)
    x = np.random.default_rng(0).normal(2.0, 1.0, size=400)
    lo, hi = suite.block_bootstrap(x, block=8, reps=2000)
    se = 1.0 / math.sqrt(400)
    assert lo < x.mean() < hi
    assert 2 * 1.96 * se * 0.7 < hi - lo < 2 * 1.96 * se * 1.4
    with pytest.raises(ValueError):
        suite.bootstrap_mean([])


def test_summary_picks_the_interval():
    s = suite._summary([1.0, 1.0, 0.0, 1.0], 0.95, 200, 0)
    assert s["interval"] == "wilson" and (s["lo"], s["hi"]) == suite.wilson(3, 4)
    s = suite._summary([1.0, 0.5, 0.25], 0.95, 200, 0)
    assert s["interval"] == "bootstrap" and s["lo"] <= s["mean"] <= s["hi"]


# --- budgets ------------------------------------------------------------------------

def test_ratio_maps_onto_capacity_parameters():
    cfgs = suite.configs(["tova", "streaming_llm", "kivi"], ratios=[0.75])
    levels = {(c["method"], json.dumps(c["level"], sort_keys=True)) for c in cfgs}
    assert ("tova", '{"ratio": 0.75}') in levels and ("streaming_llm", '{"ratio": 0.75}') in levels
    kivi = [c["level"] for c in cfgs if c["method"] == "kivi"]
    assert kivi[0] == {"setting": {}} and kivi[1]["setting"]  # defaults and the aggressive preset
    tova = next(c for c in cfgs if c["method"] == "tova")
    assert suite._level_params("tova", tova["level"], {}, 1000) == {"budget": 250}
    sl = next(c for c in cfgs if c["method"] == "streaming_llm")
    assert suite._level_params("streaming_llm", sl["level"], {}, 1000) == {"window_size": 246}
    with pytest.raises(ValueError, match="ratios must be in"):
        suite.configs(["tova"], ratios=[1.5])
    with pytest.raises(ValueError, match="no method in the run"):
        suite.configs(["tova"], ratios=[0.5], params=["bits=2"])


# --- caches on the tiny model -------------------------------------------------------

@pytest.fixture(scope="module")
def full_result(tiny_llama):
    return suite.evaluate_config(tiny_llama, TOK, suite._factory(tiny_llama, None), TINY)


def _refs(per):
    return {k: [{"logprobs": p["logprobs"], "argmax": p["argmax"]} for p in v]
            for k, v in per.items()}


@pytest.mark.slow  # runs with --run-slow
def test_full_cache_matches_itself(tiny_llama, full_result):
    res, per = full_result
    again, _ = suite.evaluate_config(tiny_llama, TOK, suite._factory(tiny_llama, None), TINY,
                                     references=_refs(per))
    for name in ("stream", "decode", "continuation"):
        assert again["lm"][name]["kl"] == pytest.approx(0.0, abs=1e-6)
        assert again["lm"][name]["top1"] == 1.0
        assert again["lm"][name]["nll"] == pytest.approx(res["lm"][name]["nll"], rel=1e-6)
    for a, b in zip(res["trials"], again["trials"]):
        assert a["in"]["answer"] == b["in"]["answer"] == a["out"]["answer"]


def test_uncompressing_velox_cache_matches_full(tiny_llama, full_result):
    """TOVA with a budget above every context keeps everything: both modes equal the full
    cache, so the frozen-context wrapper (mode out) keeps positions right."""
    res, per = full_result
    cfg = {"method": "tova", "level": {"budget": 4096}, "given": {}}
    got, _ = suite.evaluate_config(tiny_llama, TOK, suite._factory(tiny_llama, cfg), TINY,
                                   references=_refs(per))
    for name in ("stream", "decode", "continuation"):
        assert got["lm"][name]["kl"] < 1e-4
        assert got["lm"][name]["top1"] == 1.0
    for a, b in zip(res["trials"], got["trials"]):
        assert b["in"]["answer"] == a["in"]["answer"]
        assert b["out"]["answer"] == a["in"]["answer"]


def test_question_kept_out_of_compression(tiny_llama):
    from velox.adapters.harness import prefill
    from velox.adapters.mlxlm import make_cache

    s = suite.samples(TOK, replace(TINY, tasks=("passkey",)))[0]
    caches = make_cache(tiny_llama, "tova", budget=64)
    prefill(tiny_llama, s.context, caches, chunk=256)
    out = suite._appended(caches)
    suite._answer(tiny_llama, TOK, out, s.question, s.expected, 3)
    assert caches[0].size() == 64  # the context was compressed
    assert out[0].keys.shape[2] >= 64 + len(s.question)  # the question was appended whole
    assert out[0].offset == len(s.context) + out[0].keys.shape[2] - 64
    suite._answer(tiny_llama, TOK, caches, s.question, s.expected, 3)
    assert caches[0].size() == 64  # mode in: the question was compressed too


@pytest.mark.slow  # runs with --run-slow
def test_compression_changes_the_figures(tiny_llama, full_result):
    res, per = full_result
    cfg = {"method": "streaming_llm", "level": {"ratio": 0.9}, "given": {}}
    got, _ = suite.evaluate_config(tiny_llama, TOK, suite._factory(tiny_llama, cfg), TINY,
                                   references=_refs(per))
    assert got["lm"]["stream"]["kl"] > 1e-3
    assert got["lm"]["stream"]["kv_bytes"] < res["lm"]["stream"]["kv_bytes"]
    assert got["retrieval"]["kv_bytes"] < res["retrieval"]["kv_bytes"]


# --- end to end ---------------------------------------------------------------------

@pytest.mark.slow  # runs with --run-slow
def test_quick_run_writes_files_and_merges(tiny_llama, tmp_path):
    proto = replace(TINY, tasks=("passkey", "cwe"), depths=(0.5,), cont_samples=1)
    a = suite.run_suite(tiny_llama, TOK, suite.configs(["tova"], ratios=[0.5]), proto)
    b = suite.run_suite(tiny_llama, TOK, suite.configs(["kivi"], ratios=[0.5]), proto)
    paths = suite.write(a, tmp_path / "a")
    assert [p.name for p in paths] == ["suite.json", "suite.md", "suite.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    data = json.loads(paths[0].read_text())
    assert [r["method"] for r in data["rows"]] == ["full", "tova"]
    assert data["protocol"]["lengths"] == [1400]
    row = data["rows"][1]
    assert row["error"] is None and row["params"]["1400"] == {"budget": 700}
    pk = row["retrieval"]["in"]["passkey"]
    assert 0 <= pk["lo"] <= pk["mean"] <= pk["hi"] <= 1
    md = paths[1].read_text()
    assert "mode `out`" in md and "| `tova` | ratio 0.5 |" in md
    merged = suite.merge([data, json.loads(json.dumps(suite._clean(b)))])
    aggressive = b["rows"][2]["label"]
    assert aggressive != "defaults"
    assert [(r["method"], r["label"]) for r in merged["rows"]] == \
        [("full", "full"), ("tova", "ratio 0.5"), ("kivi", "defaults"), ("kivi", aggressive)]
    suite.write(merged, tmp_path / "m")
    with pytest.raises(ValueError, match="appears in two runs"):
        suite.merge([data, data])
    with pytest.raises(ValueError, match="different protocols"):
        suite.merge([data, {**data, "protocol": {**data["protocol"], "seed": 9}}])


def test_command_line_merge_and_errors(tmp_path, capsys):
    assert suite.main(["--quick", "--methods", "tova", "--ratios", "2", "--plan"]) == 2
    assert "ratios must be in" in capsys.readouterr().err
    assert suite.main(["--quick", "--methods", "tova,kivi", "--ratio", "0.75", "--plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "tova\tratio 0.75" and len(out) == 3


@pytest.mark.model
def test_quick_run_on_smollm2(tmp_path):
    import time

    t0 = time.perf_counter()
    assert suite.main(["--quick", "--methods", "tova", "--ratios", "0.5", "--tasks", "passkey",
                       "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "suite.json").read_text())
    full, tova = data["rows"]
    assert full["retrieval"]["in"]["passkey"]["mean"] == 1.0  # the prompt is answerable
    assert tova["lm"]["stream"]["kl"] > 0 and full["lm"]["stream"]["kl"] == 0
    assert time.perf_counter() - t0 < 600
