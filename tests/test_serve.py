"""``velox serve``: flags, the depth-aware prompt cache, and the server itself on the embedded
SmolLM2 (a subprocess on a free localhost port, greedy, concurrent requests)."""

import json
import os
import subprocess
import tempfile
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests._helpers import free_port, stop_process

from velox.adapters import cli, serve
from velox.adapters.serve import VeloxPromptCache, can_trim

BUDGET = 16


# --- flags -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--method", "nosuch"], "unknown method 'nosuch'"),
    (["--method", "tova", "--param", "nosuch=1"], "unknown parameter(s) nosuch"),
    (["--method", "tova", "--param", "n_sink=-1"], "n_sink=-1 is out of range"),
    (["--method", "tova", "--budget", "0"], "expected a positive integer"),
    (["--method", "tova", "--param", "budget"], "--param expects key=value"),
    (["--method", "full", "--budget", "8"], "takes no --budget"),
    (["--method", "tova", "--decode-cap", "4"], "--decode-cap applies to --decode append"),
    (["--method", "tova", "--draft-model", "x"], "--draft-model needs --rollback"),
    (["--method", "tova", "--kv-bits", "4"], "--kv-bits does not apply"),
    (["--method", "tova", "--budget", "8", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--method", "tova", "--max-tokens-cap", "0"], "expected a positive integer"),
    (["--method", "tova", "--max-prompt-tokens", "x"], "expected an integer"),
    (["--method", "full", "--observe-steps"], "takes no --observe-steps"),
])
def test_bad_flags_exit_2_with_a_message(capsys, argv, message):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split())
    import mlx_lm.server as server
    assert server.LRUPromptCache.__name__ == "LRUPromptCache"  # nothing left installed


def test_flags_are_parsed_and_the_rest_left_to_mlx_lm():
    cfg, rest, want_help = serve.parse_args(
        ["--method", "streaming_llm", "--budget", "24", "--port", "9", "--decode", "append",
         "--decode-cap", "4", "--decode-concurrency", "2", "--max-tokens", "64",
         "--max-tokens-cap", "128", "--max-prompt-tokens", "1000", "--truncate-prompt"])
    assert not want_help
    assert rest == ["--port", "9", "--decode-concurrency", "2", "--max-tokens", "64"]
    assert (cfg.max_tokens_cap, cfg.max_prompt_tokens, cfg.truncate_prompt) == (128, 1000, True)
    assert cfg.max_body_bytes == serve.MAX_BODY_BYTES
    assert cfg.method == "streaming_llm" and cfg.capacity() == 24
    assert cfg.cache_kwargs()["decode"] == "append" and cfg.cache_kwargs()["decode_cap"] == 4
    assert cfg.model == "smollm2"


def test_help_lists_velox_and_mlx_lm_options(capsys):
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--method", "--budget", "--param", "--rollback", "--decode", "smollm2",
                 "--max-prompt-tokens", "--truncate-prompt", "--max-tokens-cap",
                 "--max-body-bytes", "--decode-concurrency", "--prompt-cache-bytes",
                 "/velox/stats"):
        assert flag in out


# --- the prompt cache ----------------------------------------------------------------------

class _Layer:
    """A layer cache that can undo its newest ``depth`` tokens (``depth=None``: has no
    ``can_trim``, like mlx-lm's caches; then trimmable at any depth)."""

    def __init__(self, offset, depth):
        self.offset, self.depth, self.trimmed = offset, depth, []
        if depth is not None:
            self.can_trim = lambda n: n <= self.depth

    def size(self):
        return self.offset

    @property
    def nbytes(self):
        return 4 * self.offset

    def is_trimmable(self):
        return True

    def trim(self, n):
        self.trimmed.append(n)
        self.offset -= n
        return n


def test_prompt_cache_trims_a_longer_entry_only_within_every_layers_depth():
    pc = VeloxPromptCache()
    pc.insert_cache("m", [1, 2, 3], [_Layer(3, 0), _Layer(3, 0)], cache_type="user")
    pc.insert_cache("m", [1, 2, 3, 4, 5, 6], [_Layer(6, 1), _Layer(6, 5)])
    assert len(pc) == 2  # the new entry cannot trim 3 tokens back: the prefix stays
    cache, rest = pc.fetch_nearest_cache("m", [1, 2, 3, 4, 9])  # needs a trim of 2: too deep
    assert rest == [4, 9] and [c.offset for c in cache] == [3, 3]
    pc.insert_cache("m", [1, 2, 3, 4, 5], [_Layer(5, 2), _Layer(5, 2)])
    cache, rest = pc.fetch_nearest_cache("m", [1, 2, 3, 4, 7, 8])  # trim 1 of [1..5]
    assert rest == [7, 8] and [c.offset for c in cache] == [4, 4]
    assert [c.trimmed for c in cache] == [[1], [1]]
    assert pc.fetches == {"exact": 0, "trimmed": 1, "prefix": 1, "none": 0, "cached_tokens": 7}
    assert pc.fetch_nearest_cache("m", [8, 8]) == (None, [8, 8])
    # A cache that can trim any amount stands for its prefixes, as in mlx-lm.
    pc.insert_cache("m", [1, 2, 3, 4, 5, 6, 7], [_Layer(7, None)])
    assert len(pc) == 1 and pc.nbytes == 28


def test_a_velox_cache_without_rollback_is_never_trimmed(smollm2):
    from velox.adapters.mlxlm import make_cache

    model, _ = smollm2
    caches = make_cache(model, "tova", budget=8)
    assert not can_trim(caches, 1) and can_trim(caches, 0)


# --- the server ----------------------------------------------------------------------------

PROMPTS = [  # (question, max_tokens, stream)
    ("What is the capital of France?", 10, False),
    ("Write one sentence about the sea, the wind and the old lighthouse on the hill.", 14, True),
    ("Name a color.", 6, True),
    ("List three animals that live in cold places and say why each one can survive there.", 18,
     False),
]


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _chat(url, question, max_tokens, stream):
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": stream}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not stream:
            out = json.loads(r.read())
            return out["choices"][0]["message"]["content"], out["usage"]
        text = []
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
        return "".join(text), None


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "velox.adapters.cli", "serve", "--model", "smollm2", "--method",
         "tova", "--budget", str(BUDGET), "--port", str(port), "--log-level", "WARNING",
         "--prefill-step-size", "512"],
        # run outside the checkout: ``-m`` puts the working directory first on sys.path, where
        # the source tree's ``velox`` lacks the installed package's ``velox.kernels``
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                if _get(url + serve.STATS_PATH)["model_loaded"]:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the server did not start:\n" + proc.stdout.read().decode())
            time.sleep(0.3)
        yield url
    finally:
        stop_process(proc)


def _alone(model, tok, question, max_tokens):
    """The request run alone in this process: greedy, the server's caches and prefill step."""
    from mlx_lm import stream_generate

    from velox.adapters.mlxlm import cache_nbytes, make_cache

    prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                     add_generation_prompt=True)
    caches = make_cache(model, "tova", budget=BUDGET)
    text = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=max_tokens,
                                                   prompt_cache=caches, prefill_step_size=512))
    return text, cache_nbytes(caches), len(prompt)


def test_concurrent_requests_answer_as_each_alone_with_the_cache_at_its_budget(server, smollm2):
    from velox.adapters.mlxlm import VeloxCache

    model, tok = smollm2
    expected = [_alone(model, tok, q, m) for q, m, _ in PROMPTS]
    answers = [None] * len(PROMPTS)

    def ask(i):
        answers[i] = _chat(server, *PROMPTS[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for (text, _), (want, _, _) in zip(answers, expected):
        assert text and text == want
    # the same question again, alone: it reuses its stored prompt (all but the last token)
    text, usage = _chat(server, *PROMPTS[0])
    assert text == expected[0][0]
    assert usage["prompt_tokens_details"]["cached_tokens"] == expected[0][2] - 1
    # a follow-up turn continues from the stored conversation
    turn = [{"role": "user", "content": PROMPTS[0][0]}, {"role": "assistant", "content": text},
            {"role": "user", "content": "And of Italy?"}]
    body = {"messages": turn, "max_tokens": 6, "temperature": 0.0}
    req = urllib.request.Request(server + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    assert out["choices"][0]["message"]["content"]

    st = _get(server + serve.STATS_PATH)
    assert st["config"]["method"] == "tova" and st["config"]["capacity"] == BUDGET
    assert st["batchable"] == hasattr(VeloxCache, "merge")  # mlx-lm batches when caches merge
    assert st["caches_made"] >= 1 + len(PROMPTS)  # the hook built every new request's cache
    full = {nbytes for _, nbytes, _ in expected}
    assert len(full) == 1  # every reference held its budget: the bytes of BUDGET tokens
    stored = st["stored"]
    assert len(stored) >= 2 * len(PROMPTS)  # each request's prompt and whole conversation
    for rec in stored:
        assert rec["stored_max"] == rec["stored_min"] == BUDGET and rec["nbytes"] in full
        assert rec["offset"] in (rec["tokens"], rec["tokens"] - 1)
    assert st["prompt_cache"]["fetches"]["prefix"] >= 2
    assert st["memory"]["rss_bytes"] > 0
    # steady caches decode in the whole model's compiled step, batched requests too
    steps = st["decode_steps"]
    assert steps["compiled"] > 0 and steps["layer_by_layer"] >= 0, steps


def test_observe_steps_reports_what_every_cache_update_did(tiny_llama):
    """``--observe-steps``: the caches the server builds report each layer update's StepInfo,
    summed in /velox/stats' ``observed_steps`` (here the hook and the collector, in process)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    cfg, _, _ = serve.parse_args(["--method", "tova", "--budget", "16", "--observe-steps"])
    assert cfg.observe_steps and cfg.describe()["observe_steps"]
    before = serve._STATS.observed()
    caches = serve.velox_caches(tiny_llama, cfg)()
    prompt = mx.array([(7 * i + 3) % 97 for i in range(40)])
    for _, _ in zip(generate_step(prompt, tiny_llama, prompt_cache=caches), range(10)):
        pass
    after = serve._STATS.observed()
    layers = len(caches)
    assert after["updates"] - before["updates"] >= layers * 10
    # every token beyond the budget was dropped once, in every layer and kv head
    heads = caches[0].velox_state.keys.shape[1]
    dropped = sum(c.offset - 16 for c in caches) * heads
    assert after["tokens_evicted"] - before["tokens_evicted"] == dropped
    assert after["max_key_error"] == 0.0  # TOVA holds its rows exactly
    assert serve.ServeConfig().cache_kwargs().get("observe") is None  # off by default
