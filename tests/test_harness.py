"""The quality harness on tiny random mlx-lm models and scripted stand-ins: perplexity protocol,
agreement, memory accounting, passkey prompts, scoring and depth semantics, shipped texts."""

from __future__ import annotations

import math
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from velox.adapters import harness
from velox.adapters.mlxlm import make_cache

TOKENS = [int(x) for x in np.random.default_rng(3).integers(1, 97, size=72)]


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def full(model):
    return lambda: make_prompt_cache(model)


# --- perplexity ----------------------------------------------------------------------

def test_full_cache_perplexity_is_the_plain_forward_nll(model):
    prefix = 20
    logits = model(mx.array([TOKENS]))[0].astype(mx.float32)
    targets = mx.array(TOKENS[prefix:])
    lp = logits[prefix - 1:-1] - mx.logsumexp(logits[prefix - 1:-1], axis=-1, keepdims=True)
    want = -mx.take_along_axis(lp, targets[:, None], axis=-1).mean().item()
    for chunk in (1, 7, 64):
        got = harness.perplexity(model, TOKENS, full(model), prefix=prefix, chunk=chunk,
                                 prefill_chunk=8)
        assert got.tokens == len(TOKENS) - prefix
        assert got.nll == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert got.ppl == pytest.approx(math.exp(got.nll))


@pytest.mark.parametrize("method,params", [("tova", dict(budget=500)), ("h2o", dict(budget=500)),
                                           ("streaming_llm", dict(window_size=500))])
def test_budget_above_the_text_equals_the_full_cache_exactly(model, method, params):
    want = harness.perplexity(model, TOKENS, full(model), prefix=16, chunk=8)
    got = harness.perplexity(model, TOKENS, lambda: make_cache(model, method, **params),
                             prefix=16, chunk=8)
    assert got.nll == want.nll and got.tokens == want.tokens


def test_a_tiny_budget_changes_perplexity_and_the_cache_really_evicts(model):
    want = harness.perplexity(model, TOKENS, full(model), prefix=16, chunk=8)
    got = harness.perplexity(model, TOKENS, lambda: make_cache(model, "tova", budget=10, n_sink=2),
                             prefix=16, chunk=8)
    assert abs(got.nll - want.nll) > 1e-3
    # 3 layers x 2 kv heads x [10 kept tokens x (k + v) x head_dim 32 x 4 bytes (fp32)
    # + 10 int32 positions + one int32 next_pos]
    assert got.memory.kv_bytes == 3 * 2 * (10 * 2 * 32 * 4 + 10 * 4 + 4)
    assert got.memory.tokens == len(TOKENS) - 1  # the last token is never fed
    assert got.memory.fp16_bytes == 3 * 2 * 32 * 2 * 2 * (len(TOKENS) - 1)
    assert got.memory.ratio == got.memory.fp16_bytes / got.memory.kv_bytes > 3


def test_chunking_matters_for_an_evicting_cache(model):
    """Each chunk is scored with the cache as it stands, then absorbed (decode-time eviction)."""
    one = harness.perplexity(model, TOKENS, lambda: make_cache(model, "tova", budget=12, n_sink=2),
                             prefix=16, chunk=1)
    big = harness.perplexity(model, TOKENS, lambda: make_cache(model, "tova", budget=12, n_sink=2),
                             prefix=16, chunk=32)
    assert one.nll != big.nll


def test_perplexity_rejects_bad_settings(model):
    with pytest.raises(ValueError, match="prefix"):
        harness.perplexity(model, TOKENS, full(model), prefix=len(TOKENS))
    with pytest.raises(ValueError, match="chunk"):
        harness.perplexity(model, TOKENS, full(model), prefix=4, chunk=0)


# --- agreement, speed, memory --------------------------------------------------------

def test_full_cache_agrees_with_itself(model):
    a = harness.agreement(model, TOKENS[:40], full(model), new_tokens=10, prefill_chunk=16)
    assert a.match_rate == 1.0 and a.first_divergence == 10 and a.top1 == 1.0
    assert a.kl == 0.0
    assert a.new_tokens == 10 and a.decode_tok_s > 0


def test_budget_above_the_prompt_agrees_exactly(model):
    ref = harness.speed(model, TOKENS[:40], full(model), steps=10)
    a = harness.agreement(model, TOKENS[:40], lambda: make_cache(model, "h2o", budget=200),
                          new_tokens=10, reference=ref)
    assert a.match_rate == 1.0 and a.kl == 0.0 and a.tokens == ref.tokens


def test_compression_disagrees_and_scores_are_consistent(model):
    ref = harness.speed(model, TOKENS[:48], full(model), steps=12)
    a = harness.agreement(model, TOKENS[:48], lambda: make_cache(model, "streaming_llm",
                                                                   n_sink=1, window_size=6),
                          new_tokens=12, reference=ref)
    assert a.kl > 1e-4
    got, want = np.array(a.tokens), np.array(ref.tokens)
    assert a.match_rate == pytest.approx((got == want).mean())
    assert a.first_divergence < 12 and a.match_rate < 1.0
    assert (got[:a.first_divergence] == want[:a.first_divergence]).all()
    assert got[a.first_divergence] != want[a.first_divergence]
    # a hand-written teacher-forced loop reproduces the mean KL
    caches_f = make_prompt_cache(model)
    caches_c = make_cache(model, "streaming_llm", n_sink=1, window_size=6)
    harness.prefill(model, TOKENS[:47], caches_f)
    harness.prefill(model, TOKENS[:47], caches_c)
    kls = []
    for x in [TOKENS[47], *ref.tokens[:-1]]:
        pf = nn.log_softmax(model(mx.array([[x]]), cache=caches_f)[0, -1])
        pc = nn.log_softmax(model(mx.array([[x]]), cache=caches_c)[0, -1])
        kls.append(mx.sum(mx.exp(pf) * (pf - pc)).item())
    assert a.kl == pytest.approx(float(np.mean(kls)), rel=1e-4, abs=1e-6)


def test_memory_of_plain_and_velox_caches(model):
    caches = make_prompt_cache(model)
    harness.prefill(model, TOKENS[:30], caches, chunk=512)
    m = harness.memory(caches)
    # KVCache preallocates 256 slots per layer: the bytes held, not the tokens seen
    assert m.kv_bytes == 3 * 2 * 256 * 32 * 2 * 4
    assert m.fp16_bytes == 3 * 2 * 30 * 32 * 2 * 2 and m.tokens == 30
    assert m.full_bytes == 2 * m.fp16_bytes and m.dtype == "float32" and m.stored == 30
    assert m.full_ratio == m.full_bytes / m.kv_bytes < 1  # preallocated slots cost bytes
    caches = make_cache(model, "kivi", residual_length=8)
    harness.prefill(model, TOKENS[:70], caches, chunk=16)
    m = harness.memory(caches)
    assert 0 < m.kv_bytes < m.full_bytes == 2 * m.fp16_bytes  # less than the fp32 cache
    assert m.full_ratio > 1 and m.tokens == m.stored == 70 and m.dtype == "float32"
    caches = make_cache(model, "tova", budget=24)
    harness.prefill(model, TOKENS[:70], caches, chunk=16)
    m = harness.memory(caches)
    assert m.stored == 24 and m.tokens == 70 and m.full_bytes == 3 * 2 * 70 * 32 * 2 * 4


def test_evaluate_runs_every_measurement(model):
    tok = CharTokenizer()
    base = harness.evaluate(model, tok, TOKENS[:60], full(model), prefix=20, chunk=8,
                            new_tokens=6, passkey_lengths=())
    assert base.reference is not None and base.agreement.match_rate == 1.0
    assert base.agreement.kl == 0.0 and base.passkey is None
    same = harness.evaluate(model, tok, TOKENS[:60], lambda: make_cache(model, "tova", budget=300),
                            prefix=20, chunk=8, new_tokens=6, reference=base.reference,
                            passkey_lengths=())
    assert same.perplexity.nll == base.perplexity.nll
    assert same.agreement.match_rate == 1.0 and same.agreement.kl == 0.0
    assert set(same.phase_seconds) == {"perplexity", "agreement", "passkey"}


# --- passkey -------------------------------------------------------------------------

class CharTokenizer:
    """One token per character (ids are code points below 128)."""

    eos_token_ids = {0}

    def encode(self, text: str) -> list[int]:
        return [min(ord(c), 127) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


class Seen:
    """A stand-in cache that remembers every token fed to it."""

    def __init__(self):
        self.tokens: list[int] = []

    @property
    def state(self):
        return []


class Retriever:
    """Answers the passkey when the needle is among the last ``window`` tokens fed."""

    def __init__(self, window: int | None = None):
        self.window = window

    def __call__(self, inputs, cache):
        seen = cache[0]
        seen.tokens.extend(np.array(inputs[0]).tolist())
        visible = seen.tokens if self.window is None else seen.tokens[-self.window:]
        text = "".join(chr(i) for i in visible)
        found = re.search(r"The pass key is (\d{5})\.", text)
        answer = " " + (found.group(1) if found else "none") + "."
        written = text.split(harness.PASSKEY_QUESTION.strip())[-1] if harness.PASSKEY_QUESTION.strip() in text else ""
        nxt = answer[len(written)] if len(written) < len(answer) else "\0"
        logits = mx.zeros((1, inputs.shape[1], 128))
        return logits.at[0, -1, ord(nxt)].add(1.0)


def test_passkey_prompt_places_the_needle_at_the_depth():
    tok = CharTokenizer()
    filler = tok.encode(harness.load_text("alice"))
    for depth in (0.0, 0.3, 1.0):
        ids, at = harness.passkey_prompt(tok, length=900, depth=depth, key="31415", filler=filler,
                                         offset=100)
        text = tok.decode(ids)
        assert len(ids) == 900
        assert text.startswith(harness.PASSKEY_INTRO) and text.endswith(harness.PASSKEY_QUESTION)
        needle = harness.PASSKEY_NEEDLE.format(key="31415")
        assert text[at:at + len(needle)] == needle and text.count("31415") == 2
        n_fill = 900 - len(harness.PASSKEY_INTRO) - len(needle) - len(harness.PASSKEY_QUESTION)
        assert at - len(harness.PASSKEY_INTRO) == round(depth * n_fill)
        body = text[len(harness.PASSKEY_INTRO):at] + text[at + len(needle):-len(harness.PASSKEY_QUESTION)]
        assert body == tok.decode(filler[100:100 + n_fill])  # real text, in order
    with pytest.raises(ValueError, match="at least"):
        harness.passkey_prompt(tok, length=50, depth=0.5, key="31415", filler=filler)


@pytest.mark.parametrize("answer,ok", [(" 52586.", True), ("52586", True), (" 52586 is it", True),
                                       (" the pass key.", False), (" 5258.", False),
                                       (" 525861", False), (" 12 then 52586", False), ("", False)])
def test_score_answer(answer, ok):
    assert harness.score_answer(answer, "52586") is ok


def test_passkey_scores_answers_per_cell():
    tok = CharTokenizer()
    perfect = harness.passkey(Retriever(), tok, lambda: [Seen()], lengths=[600, 800],
                              depths=[0.1, 0.9], trials=2, seed=5, text="holmes")
    assert len(perfect.trials) == 8 and perfect.accuracy == 1.0
    assert all(t.answer.strip(" .") == t.key for t in perfect.trials)
    assert len({t.key for t in perfect.trials}) > 1
    # a model that only sees its last 220 tokens finds needles near the question only
    forgetful = harness.passkey(Retriever(window=220), tok, lambda: [Seen()], lengths=[600, 800],
                                depths=[0.1, 0.9], trials=2, seed=5, text="holmes")
    assert forgetful.by_cell == {(600, 0.1): 0.0, (600, 0.9): 1.0, (800, 0.1): 0.0, (800, 0.9): 1.0}
    assert forgetful.accuracy == 0.5
    # the same seed draws the same keys
    assert [t.key for t in forgetful.trials] == [t.key for t in perfect.trials]


# --- texts ---------------------------------------------------------------------------

def test_shipped_texts_are_long_real_prose():
    names = harness.text_names()
    assert set(names) >= {"alice", "holmes", "pride"}
    words = 0
    for name in names:
        text = harness.load_text(name)
        assert "Project Gutenberg" not in text and "\r" not in text
        words += len(text.split())
    assert words > 25_000
    assert "Down the Rabbit-Hole" in harness.load_text("alice")
    assert "It is a truth universally acknowledged" in harness.load_text("pride")
    with pytest.raises(ValueError, match="unknown text"):
        harness.load_text("nope")
    with pytest.raises(ValueError, match="tokens"):
        harness.text_tokens(CharTokenizer(), "short", 10)
