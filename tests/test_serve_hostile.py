"""``velox serve`` under hostile and careless requests: every field of a completion request is
checked against the model before mlx-lm sees it (a 4xx with a JSON error naming the field),
over-long prompts and huge ``max_tokens`` are refused, a client that disconnects stops its
generation, a server whose caches cannot run exits at start-up, a dead generation thread
fails the health checks, and after all of it the server still answers correctly.

The checks themselves run in-process first (no model, fast); then one real ``velox serve``
subprocess on SmolLM2 takes every kind of bad request."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer

import pytest

from tests._helpers import free_port, stop_process

from velox.adapters import serve
from velox.adapters.serve import Limits, RequestError, check_request

VOCAB = 1000
LIMITS = Limits(vocab_size=VOCAB, max_prompt_tokens=64, max_tokens_cap=500, context=512,
                method="tova", model_id="smollm2",
                model_names=frozenset({"default_model", "smollm2", "/models/smol"}))
CHAT = [{"role": "user", "content": "hi"}]


# --- the checks, in-process ------------------------------------------------------------------

@pytest.mark.parametrize("body, status, param", [
    ([1, 2], 400, None),
    ("text", 400, None),
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, 400,
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400,
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}]}, 400,
     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]}, 400,
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": CHAT, "tools": "all"}, 400, "tools"),
    ({"messages": CHAT, "logit_bias": {"1000": 1}}, 400, "logit_bias"),
    ({"messages": CHAT, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ({"messages": CHAT, "logit_bias": {"ten": 1}}, 400, "logit_bias"),
    ({"messages": CHAT, "logit_bias": {"5": 1e9}}, 400, "logit_bias"),
    ({"messages": CHAT, "logit_bias": {"5": "up"}}, 400, "logit_bias"),
    ({"messages": CHAT, "logit_bias": [5]}, 400, "logit_bias"),
    ({"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 501}, 400, "max_tokens"),
    ({"messages": CHAT, "max_tokens": "10"}, 400, "max_tokens"),
    ({"messages": CHAT, "max_tokens": True}, 400, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 2.5}, 400, "max_tokens"),
    ({"messages": CHAT, "max_completion_tokens": 10**12}, 400, "max_completion_tokens"),
    ({"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ({"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ({"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ({"messages": CHAT, "top_k": VOCAB}, 400, "top_k"),
    ({"messages": CHAT, "top_k": -1}, 400, "top_k"),
    ({"messages": CHAT, "min_p": 2}, 400, "min_p"),
    ({"messages": CHAT, "xtc_threshold": 0.7}, 400, "xtc_threshold"),
    ({"messages": CHAT, "repetition_penalty": -0.5}, 400, "repetition_penalty"),
    ({"messages": CHAT, "repetition_context_size": -1}, 400, "repetition_context_size"),
    ({"messages": CHAT, "repetition_context_size": 10**9}, 400, "repetition_context_size"),
    ({"messages": CHAT, "presence_penalty": 9}, 400, "presence_penalty"),
    ({"messages": CHAT, "logprobs": "yes"}, 400, "logprobs"),
    ({"messages": CHAT, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"messages": CHAT, "n": 3}, 400, "n"),
    ({"messages": CHAT, "stop": ""}, 400, "stop"),
    ({"messages": CHAT, "stop": [1, 2]}, 400, "stop[0]"),
    ({"messages": CHAT, "stop": ["a"] * 17}, 400, "stop"),
    ({"messages": CHAT, "stream": "true"}, 400, "stream"),
    ({"messages": CHAT, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    ({"messages": CHAT, "seed": -1}, 400, "seed"),
    ({"messages": CHAT, "seed": 2**64}, 400, "seed"),
    ({"messages": CHAT, "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs"),
    ({"messages": CHAT, "chat_template_kwargs": ["x"]}, 400, "chat_template_kwargs"),
    ({"messages": CHAT, "method": "snapkv"}, 400, "method"),
    ({"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
    ({"messages": CHAT, "model": "/etc"}, 404, "model"),
    ({"messages": CHAT, "draft_model": "other"}, 404, "draft_model"),
    ({"messages": CHAT, "adapters": "/tmp/x"}, 404, "adapters"),
    ({"messages": CHAT, "num_draft_tokens": -1}, 400, "num_draft_tokens"),
    # a stop word no tokenizer takes would raise in the generation thread, outside any try
    ({"messages": CHAT, "stop": ["\ud800"]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "a\udfff"}]}, 400, "messages"),
])
def test_a_bad_chat_request_is_refused_naming_the_field(body, status, param):
    with pytest.raises(RequestError) as info:
        check_request(body, "chat", LIMITS)
    err = info.value
    assert (err.status, err.param) == (status, param)
    doc = err.body()["error"]
    assert doc["param"] == param and (param is None or doc["message"].startswith(param))


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "logit_bias": {"4096": -100}}, "logit_bias"),
])
def test_a_bad_text_request_is_refused_naming_the_field(body, param):
    with pytest.raises(RequestError) as info:
        check_request(body, "text", LIMITS)
    assert (info.value.status, info.value.param) == (400, param)


def test_a_good_request_is_passed_on_with_nulls_dropped_and_floats_made_floats():
    body = {"messages": CHAT, "max_tokens": None, "temperature": 1, "xtc_probability": 0,
            "logit_bias": {" 7": -100, "999": 5}, "stream": True, "stream_options": {},
            "stop": ["\n\n"], "seed": 3, "model": "smollm2", "method": "tova", "n": 1,
            "top_k": VOCAB - 1, "max_completion_tokens": 500}
    out = check_request(body, "chat", LIMITS)
    assert "max_tokens" not in out and out["messages"] == CHAT
    # any name of the served model reaches mlx-lm as its own key (another name would load)
    assert out["model"] == out["draft_model"] == "default_model"
    assert type(out["temperature"]) is float and type(out["xtc_probability"]) is float
    assert out["logit_bias"] == {"7": -100.0, "999": 5.0}
    assert out["stream_options"] == {"include_usage": False}
    assert body["stream_options"] == {} and body["max_tokens"] is None  # the input is untouched
    assert check_request({"prompt": "x", "model": "/models/smol"}, "text", LIMITS) == {
        "prompt": "x", "model": "default_model", "draft_model": "default_model"}
    # without a draft model num_draft_tokens does nothing; with one, it is bounded by the
    # caches' rollback depth
    check_request({"messages": CHAT, "num_draft_tokens": 9}, "chat", LIMITS)
    drafting = dataclasses.replace(LIMITS, draft_model="d", max_draft_tokens=3)
    check_request({"messages": CHAT, "num_draft_tokens": 3, "draft_model": "d"}, "chat",
                  drafting)
    with pytest.raises(RequestError, match="num_draft_tokens"):
        check_request({"messages": CHAT, "num_draft_tokens": 4}, "chat", drafting)


def _bare_generator(limits):
    """The velox generation class without its thread: only ``_tokenize`` is called."""
    cls = serve._generator_class()
    gen = cls.__new__(cls)
    gen.limits = limits
    return gen


class _Tokenizer:
    def encode(self, text):
        return [ord(c) % VOCAB for c in text]


def _text_request(prompt):
    from mlx_lm.server import CompletionRequest

    return CompletionRequest("text", prompt, [], None, None)


def test_a_prompt_over_the_limit_is_refused_with_413_or_truncated_when_asked():
    gen = _bare_generator(LIMITS)
    prompt, segments, _, _, _ = gen._tokenize(_Tokenizer(), _text_request("a" * 64), None)
    assert len(prompt) == 64 and segments == [prompt]
    with pytest.raises(RequestError) as info:
        gen._tokenize(_Tokenizer(), _text_request("a" * 65), None)
    assert (info.value.status, info.value.param) == (413, "prompt")
    assert "65 tokens" in info.value.message and "at most 64" in info.value.message
    gen.limits = dataclasses.replace(LIMITS, truncate_prompt=True)
    text = "".join(chr(97 + i % 26) for i in range(100))
    prompt, segments, types_, _, _ = gen._tokenize(_Tokenizer(), _text_request(text), None)
    assert prompt == _Tokenizer().encode(text)[-64:] and segments == [prompt]
    assert types_ == ["assistant"]


# --- the handler in-process: a dead generation thread ----------------------------------------

def _dead_generator():
    """velox's generation class with a real mlx-lm generation loop, killed by a malformed
    item on its request queue (as any exception in the loop would kill it)."""
    cli = types.SimpleNamespace(allowed_origins=["*"], max_tokens=16, prompt_cache_size=2)
    provider = types.SimpleNamespace(cli_args=cli, model=None, is_batchable=False,
                                     processor=None, load_default=lambda: None,
                                     reset=lambda: None)
    gen = serve._generator_class()(provider, serve.VeloxPromptCache())
    gen.limits = LIMITS
    assert gen.ready.wait(10) and gen.startup_error is None
    gen.requests.put("not a request")
    gen.join()
    return gen


@pytest.fixture
def dead_server():
    gen = _dead_generator()
    handler = serve._handler_class()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **k: handler(
        gen, *a, system_fingerprint="test", **k))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _fetch(url, body=None, *, timeout=30, raw=None, headers=None):
    """(status, parsed JSON body) of a GET (``body`` None) or POST."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_dead_generation_thread_fails_health_stats_and_requests(dead_server):
    status, doc = _fetch(dead_server + "/health")
    assert status == 503 and doc["status"] == "unavailable"
    assert "ValueError" in doc["error"]  # why the thread stopped
    status, doc = _fetch(dead_server + serve.STATS_PATH)
    assert status == 503 and doc["healthy"] is False and "ValueError" in doc["generation_error"]
    status, doc = _fetch(dead_server + "/v1/chat/completions", {"messages": CHAT})
    assert status == 503 and "generation thread has stopped" in doc["error"]["message"]


def test_models_and_unknown_paths_answer_json_without_a_hugging_face_cache(dead_server,
                                                                           monkeypatch,
                                                                           tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "none"))
    status, doc = _fetch(dead_server + "/v1/models")
    assert status == 200 and doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == ["smollm2"]
    assert _fetch(dead_server + "/v1/models/smollm2") == (200, doc["data"][0])
    status, doc = _fetch(dead_server + "/v1/models/gpt-4o")
    assert status == 404 and doc["error"]["param"] == "model"
    assert _fetch(dead_server + "/nowhere")[0] == 404
    assert _fetch(dead_server + "/v1/nowhere", {"messages": CHAT})[0] == 404


# --- a real server -----------------------------------------------------------------------------

BUDGET = 16
EOS_OFF = {"0": -100, "1": -100, "2": -100}  # SmolLM2's special tokens: generate to the end
NORMAL = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
          "max_tokens": 8, "temperature": 0.0}


def _start(flags, port):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "velox.adapters.cli", "serve", "--model", "smollm2",
         "--port", str(port), *flags],
        # outside the checkout, as tests/test_serve.py does
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tempfile.gettempdir())


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = _start(["--method", "tova", "--budget", str(BUDGET), "--log-level", "WARNING",
                   "--prefill-step-size", "512"], port)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if _fetch(url + "/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.time() > deadline:
                stop_process(proc)
                raise RuntimeError("the server did not start:\n" + proc.stderr.read().decode())
            time.sleep(0.3)
        status, first = _fetch(url + "/v1/chat/completions", NORMAL, timeout=120)
        assert status == 200
        yield types.SimpleNamespace(url=url, port=port, proc=proc, first=first)
    finally:
        stop_process(proc)


def _raw(port, data: bytes, *, timeout=30) -> tuple[int, dict]:
    """Send ``data`` as it is; return the status and the JSON body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _post_head(path, length, extra=""):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{length}{extra}\r\n").encode()


def _stats(server):
    return _fetch(server.url + serve.STATS_PATH, timeout=30)[1]


@pytest.mark.model
def test_malformed_bodies_are_refused(server):
    path = "/v1/chat/completions"
    for body in (b'{"messages": [', b"\xff\xfe{}", b'{"messages": NaN}', b"[1, 2]", b"null"):
        status, doc = _raw(server.port, _post_head(path, f"Content-Length: {len(body)}\r\n")
                           + body)
        assert status == 400 and doc["error"]["message"], body
    assert _raw(server.port, _post_head(path, ""))[0] == 411
    assert _raw(server.port, _post_head(path, "Content-Length: -5\r\n"))[0] == 400
    assert _raw(server.port, _post_head(path, "Content-Length: abc\r\n"))[0] == 400
    status, doc = _raw(server.port, _post_head(path, "Content-Length: 10000000000\r\n"))
    assert status == 413 and "--max-body-bytes" in doc["error"]["message"]


@pytest.mark.model
@pytest.mark.parametrize("extra, status, param", [
    ({"logit_bias": {"49152": 100}}, 400, "logit_bias"),  # past the vocabulary: crashed mlx-lm
    ({"logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": 10**9}, 400, "max_tokens"),
    ({"max_tokens": "8"}, 400, "max_tokens"),
    ({"temperature": "0"}, 400, "temperature"),
    ({"top_k": 49152}, 400, "top_k"),  # mlx-lm's sampler raises in the generation thread
    ({"xtc_probability": 0.5, "xtc_threshold": 0.9, "temperature": 1.0}, 400, "xtc_threshold"),
    ({"stop": ""}, 400, "stop"),
    ({"chat_template_kwargs": {"return_dict": True}}, 400, "chat_template_kwargs"),
    ({"stop": ["\ud800"]}, 400, "stop"),
    ({"messages": [{"role": "user"}, 7]}, 400, "messages[1]"),
    ({"method": "snapkv"}, 400, "method"),
    ({"model": "some/other-model"}, 404, "model"),
])
def test_bad_fields_are_refused_naming_the_field(server, extra, status, param):
    got, doc = _fetch(server.url + "/v1/chat/completions", {**NORMAL, **extra})
    assert got == status and doc["error"]["param"] == param, doc


@pytest.mark.model
def test_the_cap_on_max_tokens_defaults_to_the_context_length(server):
    status, doc = _fetch(server.url + "/v1/completions",
                         {"prompt": "Once", "max_tokens": 8193})
    assert status == 400 and "cap of 8192" in doc["error"]["message"]
    assert _stats(server)["limits"]["max_tokens_cap"] == 8192


@pytest.mark.model
def test_a_prompt_longer_than_the_context_is_refused_before_prefill(server):
    long = "the cat sat on the mat " * 2000  # about 12k tokens; the model's context is 8k
    for path, body in (("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": long}], "max_tokens": 4}),
                       ("/v1/completions", {"prompt": long, "max_tokens": 4})):
        t0 = time.perf_counter()
        status, doc = _fetch(server.url + path, body, timeout=60)
        took = time.perf_counter() - t0
        assert status == 413, doc
        assert doc["error"]["param"] in ("messages", "prompt")
        assert "at most 8192" in doc["error"]["message"]
        assert took < 15  # refused after the chat template, without a prefill


def _open_stream(port, body):
    """A client socket that has sent ``body`` to /v1/chat/completions."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(_post_head("/v1/chat/completions", f"Content-Length: {len(data)}\r\n") + data)
    return s


def _cancelled(server, before_ids, timeout=20):
    """The record of the one new request, once it is no longer running."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        recs = [r for r in _stats(server)["requests"]["recent"] if r["id"] not in before_ids]
        if recs and recs[-1]["state"] != "running":
            return recs[-1]
        time.sleep(0.1)
    raise AssertionError(f"the request is still running after {timeout} s: {recs}")


def _record(server, rid):
    return [r for r in _stats(server)["requests"]["recent"] if r["id"] == rid][0]


def _wait_tokens(server, before_ids, n, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        recs = [r for r in _stats(server)["requests"]["recent"] if r["id"] not in before_ids]
        if recs and recs[-1]["tokens_generated"] >= n:
            return recs[-1]
        time.sleep(0.1)
    raise AssertionError(f"no {n} tokens generated in {timeout} s")


@pytest.mark.model
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_stops_its_generation(server, stream):
    before = {r["id"] for r in _stats(server)["requests"]["recent"]}
    body = {"messages": [{"role": "user", "content": "Count from one to ten thousand."}],
            "max_tokens": 8000, "temperature": 0.0, "stream": stream, "logit_bias": EOS_OFF}
    s = _open_stream(server.port, body)
    _wait_tokens(server, before, 4)
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.0 200")
    s.close()
    closed = time.perf_counter()
    rec = _cancelled(server, before)
    noticed = time.perf_counter() - closed
    assert rec["state"] == "cancelled" and rec["tokens_generated"] < 8000
    time.sleep(1.0)
    mid = _record(server, rec["id"])
    time.sleep(1.0)  # the generation thread has dropped it: no more tokens come
    again = _record(server, rec["id"])
    assert again["tokens_generated"] == mid["tokens_generated"]
    assert again["last_token_after_cancel_s"] < 2.0, again
    # the server is free: a new request is answered at once
    t0 = time.perf_counter()
    status, _ = _fetch(server.url + "/v1/chat/completions", {**NORMAL, "max_tokens": 2},
                       timeout=60)
    print(f"stream={stream}: noticed the disconnect after {noticed:.2f} s; "
          f"{again['generated_after_cancel']} tokens after it, the last "
          f"{again['last_token_after_cancel_s']:.2f} s after; next request "
          f"{time.perf_counter() - t0:.2f} s")
    assert status == 200 and time.perf_counter() - t0 < 30
    assert _stats(server)["requests"]["active"] == 0


@pytest.mark.model
def test_careless_but_valid_fields_are_served(server):
    # stream_options without include_usage (mlx-lm read it as a key: the stream broke off
    # before [DONE]), nulls for optional fields, ints for float fields, an empty stop list
    body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0,
            "stream": True, "stream_options": {}, "top_p": None, "seed": None,
            "xtc_probability": 0, "stop": [], "logit_bias": {"0": -100}}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        lines = [line.strip() for line in r if line.strip()]
    assert lines[-1] == b"data: [DONE]"


@pytest.mark.model
def test_models_and_health_of_the_real_server(server):
    status, doc = _fetch(server.url + "/v1/models")
    assert status == 200 and [m["id"] for m in doc["data"]] == ["smollm2"]
    assert _fetch(server.url + "/health") == (200, {"status": "ok"})
    status, doc = _fetch(server.url + serve.STATS_PATH)
    assert status == 200 and doc["healthy"] and doc["limits"]["vocab_size"] == 49152


@pytest.mark.model
def test_the_served_method_by_name_and_the_model_by_its_id_are_accepted(server):
    status, doc = _fetch(server.url + "/v1/chat/completions",
                         {**NORMAL, "method": "tova", "model": "smollm2"}, timeout=120)
    assert status == 200
    assert doc["choices"][0]["message"] == server.first["choices"][0]["message"]


@pytest.mark.model
def test_after_all_of_it_the_server_answers_as_before(server):
    assert server.proc.poll() is None
    status, doc = _fetch(server.url + "/v1/chat/completions", NORMAL, timeout=120)
    assert status == 200
    assert doc["choices"][0]["message"] == server.first["choices"][0]["message"]
    st = _stats(server)
    assert st["healthy"] and st["requests"]["failed"] == 0 and st["requests"]["active"] == 0


# --- start-up ------------------------------------------------------------------------------------

@pytest.mark.model
@pytest.mark.parametrize("flags, message", [
    (["--backend", "cuda"], "backend 'cuda' is not available"),
    # (found once the model has loaded, as its INFO line says: quiet that)
    (["--max-tokens", "100", "--max-tokens-cap", "50", "--log-level", "WARNING"],
     "--max-tokens 100"),
])
def test_a_server_that_could_not_serve_exits_2_at_start_up(flags, message):
    from velox.backend import device_supports

    if "cuda" in flags and device_supports("cuda"):
        pytest.skip("this machine runs the cuda backend")
    proc = _start(["--method", "tova", "--budget", "16", *flags], free_port())
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            stop_process(proc)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2, err.decode()
    assert len(lines) == 1 and lines[0].startswith("velox: error: ") and message in lines[0]
