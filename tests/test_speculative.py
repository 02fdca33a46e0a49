"""Speculative decoding with velox caches on the embedded SmolLM2 (fp32, CPU, greedy):
``stream_generate(..., draft_model=, num_draft_tokens=k)`` with velox caches of ``rollback=k``
for the model gives exactly the tokens of plain greedy decoding with the same velox caches,
with a draft that is rejected now and then; caches that cannot trim exactly are refused."""

import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache

from velox.adapters.mlxlm import make_cache

from tests._helpers import OracleDraft

pytestmark = [pytest.mark.model, pytest.mark.unchecked]

QUESTION = "Write one sentence about the sea, the wind and a small boat."
PROMPT = 28  # prompt tokens
TOKENS = 12
STEP = 16  # prefill chunks of 16 and 11 tokens: never 2 to rollback + 1 tokens
WRONG = {2, 3, 7, 10}  # generated tokens the draft gets wrong

CONFIGS = {
    "tova": dict(method="tova", budget=12),
    "tova-append": dict(method="tova", budget=12, decode="append", decode_cap=4),
    "h2o": dict(method="h2o", budget=12, grace=4),
    "streaming_llm": dict(method="streaming_llm", window_size=10),
    "kivi": dict(method="kivi", residual_length=4),  # groups of 32: a flush at 36 tokens
    "snapkv": dict(method="snapkv", budget=12, obs_window=4),
}


@pytest.fixture(scope="module")
def setup(smollm2):
    model, tok = smollm2
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                   add_generation_prompt=True, tokenize=False)
    return model, tok, tok.encode(text)[-PROMPT:]


def run(setup, caches, **kw):
    model, tok, prompt = setup
    kw.setdefault("max_tokens", TOKENS)
    out = list(stream_generate(model, tok, prompt, prompt_cache=caches, prefill_step_size=STEP,
                               **kw))
    return [r.token for r in out], sum(r.from_draft for r in out)


def velox(model, name, **kw):
    cfg = dict(CONFIGS[name])
    return make_cache(model, cfg.pop("method"), **cfg, **kw)


@pytest.fixture(scope="module")
def reference(setup):
    """Greedy tokens of each configuration without a draft (rollback=0, today's caches)."""
    out = {name: run(setup, velox(setup[0], name))[0] for name in CONFIGS}
    assert all(len(t) == TOKENS for t in out.values())  # no end of sequence before TOKENS
    return out


def draft(setup, tokens):
    return OracleDraft(tokens, PROMPT, setup[0].args.vocab_size, WRONG)


# k=1 and k=3 for TOVA in both decode modes; k=3 alone for the other methods by default
# (``pytest --run-slow`` runs k=1 for them too)
CASES = [pytest.param(name, k, marks=() if k == 3 or name.startswith("tova") else pytest.mark.slow)
         for name in CONFIGS for k in (1, 3)]


@pytest.mark.parametrize("name,k", CASES)
def test_speculative_equals_plain_greedy(setup, reference, name, k):
    model = setup[0]
    caches = velox(model, name, rollback=k)
    want = reference[name]
    tokens, drafted = run(setup, caches + [KVCache()], draft_model=draft(setup, want),
                          num_draft_tokens=k)
    assert tokens == want
    assert drafted == drafts_accepted(k)
    assert all(c.offset == caches[0].offset for c in caches)


def drafts_accepted(k: int) -> int:
    """The generated tokens that come from accepted drafts, as mlx-lm's rounds go: a round
    proposes up to ``k`` tokens, yields those up to the first wrong one, then one token of the
    model's."""
    n = accepted = 0
    while n < TOKENS:
        ok = 0
        while ok < min(TOKENS - n, k) and n + ok not in WRONG:
            ok += 1
        accepted, n = accepted + ok, n + ok + 1
    return accepted


@pytest.mark.slow  # runs with --run-slow
def test_a_velox_draft_cache_with_enough_depth(smollm2, setup, reference):
    """A real draft (the model itself, with velox caches of its own; its logit of one token
    +100 after every even input token, so it is rejected now and then)."""
    model = setup[0]

    def biased(inputs, cache=None):
        logits = model(inputs, cache=cache)
        return logits + 100.0 * ((inputs[..., None] % 2 == 0) & (mx.arange(logits.shape[-1]) == 11))

    caches = velox(model, "tova", rollback=2)
    draft_caches = make_cache(model, "tova", budget=64, rollback=1)  # (nothing evicted)
    tokens, drafted = run(setup, caches + draft_caches, draft_model=biased, num_draft_tokens=2,
                          max_tokens=8)
    assert tokens == reference["tova"][:8] and 0 < drafted < len(tokens)


def test_too_shallow_caches_are_refused(setup, reference):
    model = setup[0]
    oracle = draft(setup, reference["tova"])
    with pytest.raises(ValueError, match=r"num_draft_tokens=3 .* rollback=1 .* rollback=3"):
        run(setup, velox(model, "tova", rollback=1) + [KVCache()], draft_model=oracle,
            num_draft_tokens=3)
    with pytest.raises(ValueError, match=r"rollback=0 steps: make them with make_cache\(\.\.\., rollback=2\)"):
        run(setup, velox(model, "tova") + [KVCache()], draft_model=oracle, num_draft_tokens=2)
    with pytest.raises(ValueError, match="draft cache keeps rollback=0"):
        run(setup, velox(model, "tova", rollback=3) + make_cache(model, "tova", budget=12),
            draft_model=lambda x, cache=None: model(x, cache=cache), num_draft_tokens=3)


def test_proxy_mode_is_refused(setup, reference):
    model = setup[0]
    caches = velox(model, "tova", rollback=2, real_queries=False)
    with pytest.raises(ValueError, match="needs deferred mode"):
        run(setup, caches + [KVCache()], draft_model=draft(setup, reference["tova"]),
            num_draft_tokens=2)
