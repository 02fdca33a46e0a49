"""Quality suite: long-context retrieval and language modelling of compressed caches.

    python -m velox.adapters.suite --quick --methods tova,kivi --out /tmp/suite
    python -m velox.adapters.suite --methods all --ratios 0.5,0.75 --out runs/a
    python -m velox.adapters.suite --merge runs/a/suite.json runs/b/suite.json --out runs/ab

Every cache is a real velox cache inside mlx-lm (``velox.adapters.mlxlm.make_cache``) that
compresses while the tokens stream through it, scored with the model's real queries.

Protocols:

* **Retrieval.** Each sample is a prompt of exactly ``length`` tokens: a context (chat header,
  task intro and a filler of shipped public-domain text with the task's needles) and a question
  (the question, the chat template's assistant header and an answer prefix). The context is
  prefilled in chunks of ``prefill_chunk`` through the compressing cache, which is then copied.
  Mode ``in`` (question compressed with the context): the question is fed through the same
  cache as one more chunk, so the cache compresses it too (query-aware selection sees it).
  Mode ``out`` (question kept out of compression, as prefill-compression libraries measure it):
  the copy's compressed context is frozen and the question and the answer are appended to it
  uncompressed. The answer is greedy, at most the task's token limit, and stops at the end of
  turn or once every expected value is in it (the score can then no longer change).
* **Tasks** (generated offline from ``seed``, RULER-style): ``passkey`` (one 5-digit key),
  ``multikey`` (four key/7-digit-value needles, one asked), ``multivalue`` (four values of one
  key, all asked), ``vartrack`` (a chain of four variable assignments from a 5-digit value, every
  name asked), ``cwe`` (a numbered word list; the ten words that appear 30 times among words that
  appear 3 times, all asked). Scored as RULER scores them: the share of expected strings found
  (case-insensitive) in the answer.
* **Streaming perplexity** (``stream``): ``t[:prefix-1]`` prefilled, then ``t[prefix-1:-1]`` fed
  in chunks of ``chunk``; each chunk is scored on the cache as it stands, then absorbed (eviction
  active while scoring). **Decode** (``decode``): the same with one token a step on a shorter
  span. **Continuation** (``continuation``): ``prefix`` tokens prefilled through the compressing
  cache, the next ``tokens`` scored in one forward on it. Each reports the mean NLL (and
  perplexity), KL(full || compressed) of the next-token distributions and the share of positions
  whose argmax equals the full cache's, against the full cache on the same tokens.
* **Intervals.** Binary scores: Wilson score interval. Fractional scores: percentile bootstrap
  over prompts. Token-level figures: block bootstrap over blocks of ``block`` consecutive
  positions (fewer where a span has under 20 blocks; perplexity's interval is the exponential
  of the NLL's).
* **Budgets.** ``--ratios r``: the kept-token budget is ``round((1 - r) * context)``, the context
  being the prompt length (retrieval), the streamed tokens (stream, decode) or the prefix
  (continuation); ``--budgets b``: a fixed token count. It maps onto each method's capacity
  parameter (``velox.adapters.cli.budget_params``). Methods without a budget (quantizers) run at
  their defaults and their spec's ``aggressive`` preset.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from velox.adapters.cli import _csv_list

__all__ = ["Protocol", "Sample", "QUICK", "DEFAULT", "TASKS", "MODES", "make_sample", "samples",
           "score", "wilson", "bootstrap_mean", "block_bootstrap", "configs", "evaluate_config",
           "run_suite", "merge", "markdown", "plot", "add_parser", "run", "main"]

TASKS = ("passkey", "multikey", "multivalue", "vartrack", "cwe")
MODES = ("in", "out")
MODE_NAMES = {"in": "question compressed with the context",
              "out": "question kept out of compression"}
FULL = "full"
NEEDLE_TASKS = ("passkey", "multikey", "multivalue")
_ANSWER_LIMITS = {"passkey": 8, "multikey": 14, "multivalue": 48, "vartrack": 40, "cwe": 48}


# --- protocol ------------------------------------------------------------------------

@dataclass(frozen=True)
class Protocol:
    """Sizes of every measurement; stored in the output so runs can be compared and merged."""

    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    prompts: int = 2
    tasks: tuple[str, ...] = TASKS
    modes: tuple[str, ...] = MODES
    stream_text: str = "pride"
    stream_tokens: int = 4096
    stream_prefix: int = 512
    stream_chunk: int = 64
    decode_tokens: int = 1024
    decode_span: int = 256
    cont_samples: int = 8
    cont_prefix: int = 2048
    cont_tokens: int = 64
    prefill_chunk: int = 512
    block: int = 16
    bootstrap: int = 1000
    confidence: float = 0.95
    seed: int = 0
    chat: bool = True

    def validate(self) -> Protocol:
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"tasks: unknown task {t!r}; allowed: {', '.join(TASKS)}")
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"modes: unknown mode {m!r}; allowed: {', '.join(MODES)}")
        for d in self.depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"depths must be in [0, 1], got {d}")
        for name in ("prompts", "stream_chunk", "decode_span", "cont_samples", "cont_tokens",
                     "prefill_chunk", "block", "bootstrap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.stream_prefix < self.stream_tokens:
            raise ValueError(f"stream_prefix must be in [1, {self.stream_tokens - 1}], "
                             f"got {self.stream_prefix}")
        if self.decode_span >= self.decode_tokens:
            raise ValueError(f"decode_span must be < decode_tokens={self.decode_tokens}, "
                             f"got {self.decode_span}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")
        return self


DEFAULT = Protocol()
QUICK = Protocol(lengths=(256,), depths=(0.5,), prompts=1, stream_tokens=128, stream_prefix=64,
                 stream_chunk=16, decode_tokens=96, decode_span=8, cont_samples=1,
                 cont_prefix=96, cont_tokens=16, prefill_chunk=64, block=4, bootstrap=200)


# --- intervals -----------------------------------------------------------------------

def _z(confidence: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n``."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    z = _z(confidence)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean(values: Sequence[float] | np.ndarray, *, reps: int = 1000,
                   confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of independent ``values``."""
    return block_bootstrap(values, block=1, reps=reps, confidence=confidence, seed=seed)


def block_bootstrap(values: Sequence[float] | np.ndarray, *, block: int, reps: int = 1000,
                    confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean, resampling blocks of ``block`` consecutive values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap needs at least one value")
    blocks = [x[i:i + block] for i in range(0, x.size, block)]
    sums = np.array([b.sum() for b in blocks])
    sizes = np.array([b.size for b in blocks])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(blocks), size=(reps, len(blocks)))
    means = sums[idx].sum(axis=1) / sizes[idx].sum(axis=1)
    a = (1 - confidence) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def _summary(scores: Sequence[float], confidence: float, reps: int, seed: int) -> dict[str, Any]:
    """Mean, interval and its kind for per-prompt scores (Wilson when all are 0 or 1)."""
    s = [float(v) for v in scores]
    n = len(s)
    if all(v in (0.0, 1.0) for v in s):
        lo, hi = wilson(int(sum(s)), n, confidence)
        kind = "wilson"
    else:
        lo, hi = bootstrap_mean(s, reps=reps, confidence=confidence, seed=seed)
        kind = "bootstrap"
    return {"mean": sum(s) / n, "lo": lo, "hi": hi, "n": n, "interval": kind}


# --- task generators -----------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """One retrieval prompt: its context, its question and the strings a right answer holds."""

    task: str
    length: int
    depth: float | None
    context: tuple[int, ...] = field(repr=False)
    question: tuple[int, ...] = field(repr=False)
    expected: tuple[str, ...]
    max_new_tokens: int
    needles_at: tuple[int, ...] = ()


def _words(text: str) -> list[str]:
    """Distinct lowercase alphabetic words (4-10 letters) of ``text``, sorted."""
    return sorted({w for w in re.findall(r"[a-z]+", text.lower()) if 4 <= len(w) <= 10})


def _chat_parts(tokenizer, chat: bool) -> tuple[str, str]:
    """Text before and after a user message in the chat template (empty without one)."""
    if not chat or not getattr(tokenizer, "chat_template", None):
        return "", "\n\n"
    mark = "\u0000MSG\u0000"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    head, _, tail = text.partition(mark)
    return head, tail


def _enc(tokenizer, text: str) -> list[int]:
    from velox.adapters.harness import _encode

    return _encode(tokenizer, text) if text else []


def _rand_digits(rng: np.random.Generator, n: int) -> str:
    return str(int(rng.integers(10 ** (n - 1), 10 ** n)))


def _insert(fill: list[int], pieces: list[tuple[float, list[int]]]) -> tuple[list[int], list[int]]:
    """Insert token pieces into ``fill`` at relative depths; returns tokens and piece starts."""
    cuts = sorted((round(d * len(fill)), i) for i, (d, _) in enumerate(pieces))
    out: list[int] = []
    starts = [0] * len(pieces)
    prev = 0
    for cut, i in cuts:
        out += fill[prev:cut]
        starts[i] = len(out)
        out += pieces[i][1]
        prev = cut
    return out + fill[prev:], starts


def _spec(task: str, rng: np.random.Generator, words: list[str], depth: float | None):
    """Task text: intro, needles ``[(depth, text)]``, question, answer prefix, expected, limit."""
    limit = _ANSWER_LIMITS.get(task, 0)
    if task == "passkey":
        key = _rand_digits(rng, 5)
        intro = ("There is an important piece of information hidden inside a lot of irrelevant "
                 "text. Find it and memorize it. I will quiz you about it.\n\n")
        needles = [(depth, f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n")]
        return intro, needles, "What is the pass key?", "The pass key is", (key,), limit
    if task in ("multikey", "multivalue"):
        intro = ("Some special magic numbers are hidden inside the following text. Make sure to "
                 "memorize them. I will quiz you about the numbers afterwards.\n\n")
        keys = [str(w) for w in rng.choice(words, size=4, replace=False)]
        vals = [_rand_digits(rng, 7) for _ in range(4)]
        if task == "multikey":
            others = [float(d) for d in rng.uniform(0, 1, size=3)]
            needles = [(d, f" One of the special magic numbers for {k} is: {v}. ")
                       for d, k, v in zip([depth, *others], keys, vals)]
            q = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
            prefix = f"The special magic number for {keys[0]} is"
            return intro, needles, q, prefix, (vals[0],), limit
        others = [float(d) for d in rng.uniform(0, 1, size=3)]
        needles = [(d, f" One of the special magic numbers for {keys[0]} is: {v}. ")
                   for d, v in zip([depth, *others], vals)]
        q = (f"What are all the special magic numbers for {keys[0]} mentioned in the provided "
             "text?")
        return intro, needles, q, f"The special magic numbers for {keys[0]} are", tuple(vals), limit
    if task == "vartrack":
        value = _rand_digits(rng, 5)
        names = ["".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), size=5)) for _ in range(5)]
        chain = [f" VAR {names[0]} = {value}. "] + [f" VAR {names[i]} = {names[i - 1]}. "
                                                      for i in range(1, 5)]
        at = np.sort(rng.uniform(0, 1, size=5))
        intro = ("Memorize and track the chain of variable assignments hidden in the following "
                 "text.\n\n")
        q = f"Find all variables that are assigned the value {value} in the text above."
        prefix = (f"According to the chain of variable assignments in the text above, 5 variables "
                  f"are assigned the value {value}, they are:")
        return intro, list(zip(at.tolist(), chain)), q, prefix, tuple(names), limit
    if task == "cwe":
        chosen = [str(w) for w in rng.choice(words, size=10 + 1000, replace=False)]
        return chosen, None, None, None, tuple(chosen[:10]), limit
    raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")


def make_sample(tokenizer, task: str, length: int, depth: float | None, rng: np.random.Generator,
                *, filler: Sequence[int], words: Sequence[str], chat: bool = True) -> Sample:
    """One prompt of exactly ``length`` tokens for ``task`` (randomness from ``rng`` only).

    Raises:
        ValueError: for an unknown task, or a length too short for the task's fixed text.
    """
    head, tail = _chat_parts(tokenizer, chat)
    words = list(words)
    spec = _spec(task, rng, words, depth)
    if task == "cwe":
        return _cwe_sample(tokenizer, length, rng, spec[0], head, tail, spec[4], spec[5])
    intro, needles, q, answer_prefix, expected, limit = spec
    context_head = _enc(tokenizer, head + intro)
    question = _enc(tokenizer, "\n\n" + q + tail + answer_prefix)
    pieces = [(d, _enc(tokenizer, t)) for d, t in needles]
    n_fill = length - len(context_head) - len(question) - sum(len(p) for _, p in pieces)
    if n_fill < 16:
        raise ValueError(f"length={length} is too short for task {task!r} "
                         f"(needs at least {length - n_fill + 16} tokens)")
    offset = int(rng.integers(0, max(1, len(filler) - n_fill)))
    fill = list(filler[offset:offset + n_fill])
    if len(fill) < n_fill:
        raise ValueError(f"the filler text is too short for a {length}-token prompt")
    body, starts = _insert(fill, pieces)
    context = context_head + body
    return Sample(task=task, length=length, depth=None if depth is None else float(depth),
                  context=tuple(context), question=tuple(question), expected=expected,
                  max_new_tokens=limit, needles_at=tuple(len(context_head) + s for s in starts))


def _cwe_sample(tokenizer, length, rng, chosen, head, tail, expected, limit) -> Sample:
    """RULER's common-words extraction: ten words ``freq`` times each among words that appear
    ``max(1, freq // 10)`` times, shuffled; ``freq`` is 30, or less on short prompts so that
    the common words take at most half the list."""
    intro = "Below is a numbered list of words. Memorize the ones that appear most often.\n"
    q = "What are the 10 most common words in the above list?"
    answer_prefix = "The top 10 words that appear most often in the list are:"
    context_head = _enc(tokenizer, head + intro)
    question = _enc(tokenizer, "\n" + q + tail + answer_prefix)
    budget = length - len(context_head) - len(question)
    common, rare = chosen[:10], chosen[10:]
    per_item = max(1, len(_enc(tokenizer, "".join(f"{i + 100}. {w}\n"
                                                   for i, w in enumerate(common)))) // 10)
    freq = int(min(30, max(2, budget // (2 * 10 * per_item))))
    rare_freq = max(1, freq // 10)
    seed = int(rng.integers(0, 2**31))
    best = None
    lo, hi = 0, len(rare)
    while lo <= hi:  # the longest list that fits
        n_rare = (lo + hi) // 2
        items = common * freq + rare[:n_rare] * rare_freq
        order = np.random.default_rng(seed).permutation(len(items))
        toks = _enc(tokenizer, "".join(f"{i + 1}. {items[j]}\n" for i, j in enumerate(order)))
        if len(toks) <= budget:
            best, lo = toks, n_rare + 1
        else:
            hi = n_rare - 1
    if best is None:
        raise ValueError(f"length={length} is too short for task 'cwe' ({freq} copies of 10 "
                         f"words need more than {budget} tokens)")
    pad = budget - len(best)
    body = (best + _enc(tokenizer, "\n") * pad)[:budget]
    return Sample(task="cwe", length=length, depth=None, context=tuple(context_head + body),
                  question=tuple(question), expected=tuple(expected), max_new_tokens=limit)


def samples(tokenizer, protocol: Protocol) -> list[Sample]:
    """Every retrieval sample of ``protocol``, in order; the same for every cache.

    Needle tasks run ``prompts`` prompts per (length, depth); ``vartrack`` and ``cwe`` place
    their items themselves and run ``prompts * len(depths)`` prompts per length.
    """
    from velox.adapters.harness import _encode, load_text

    filler = _encode(tokenizer, load_text(protocol.stream_text))
    words = _words(load_text("alice") + load_text("holmes"))
    out = []
    for task in protocol.tasks:
        for length in protocol.lengths:
            rng = np.random.default_rng([protocol.seed, TASKS.index(task), length])
            if task in NEEDLE_TASKS:
                cells = [(d, protocol.prompts) for d in protocol.depths]
            else:
                cells = [(None, protocol.prompts * len(protocol.depths))]
            for depth, count in cells:
                for _ in range(count):
                    out.append(make_sample(tokenizer, task, length, depth, rng, filler=filler,
                                           words=words, chat=protocol.chat))
    return out


def score(answer: str, expected: Sequence[str]) -> float:
    """RULER's string match: the share of ``expected`` strings found in ``answer`` (any case)."""
    if not expected:
        raise ValueError("expected must name at least one string")
    low = answer.lower()
    return sum(e.lower() in low for e in expected) / len(expected)


# --- caches --------------------------------------------------------------------------

class _Appended:
    """A compressed context, frozen, with later tokens appended uncompressed (mode ``out``).

    Wraps one layer's velox cache after its prefill: attention reads the compressed keys and
    values (``get_kv``) followed by every token fed since; the RoPE offset keeps counting from
    the compressed cache's absolute position.
    """

    def __init__(self, inner):
        import mlx.core as mx

        self.inner = inner
        self.keys, self.values = inner.method.get_kv(inner.velox_state)
        self._offset = inner.offset
        self._base = inner.nbytes
        self._mx = mx

    @property
    def offset(self) -> int:
        return self._offset

    def update_and_fetch(self, keys, values):
        mx = self._mx
        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self._offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        from mlx_lm.models import base

        if N == 1:
            return None
        if return_array:
            return base.create_causal_mask(N, offset=self.keys.shape[2])
        return "causal"

    @property
    def state(self):
        return [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return self._base  # the compressed context only: appended tokens are not counted

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False


def _appended(caches: list) -> list:
    from velox.adapters.mlxlm import VeloxCache

    return [_Appended(c) if isinstance(c, VeloxCache) else c for c in caches]


def _forward(model, tokens: Sequence[int], caches: list):
    import mlx.core as mx

    return model(mx.array([list(tokens)]), cache=caches)


def _answer(model, tokenizer, caches: list, question: Sequence[int], expected: Sequence[str],
            max_new_tokens: int) -> tuple[str, int]:
    """Feed the question in one forward, then decode greedily; returns the text and steps."""
    import mlx.core as mx

    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    logits = _forward(model, question, caches)[0, -1]
    out: list[int] = []
    steps = 0
    while True:
        tok = int(mx.argmax(logits).item())
        if tok in eos:
            break
        out.append(tok)
        text = tokenizer.decode(out)
        if len(out) >= max_new_tokens or score(text, expected) == 1.0:
            break
        logits = _forward(model, [tok], caches)[0, -1]
        steps += 1
    return tokenizer.decode(out), steps + 1


# --- one configuration ---------------------------------------------------------------

Factory = Callable[[int], list]  # context length -> a fresh prompt cache


def _retrieval(model, tokenizer, factory: Factory, protocol: Protocol, items: list[Sample],
               progress) -> list[dict[str, Any]]:
    from velox.adapters.harness import memory, prefill

    trials = []
    for s in items:
        caches = factory(s.length)
        prefill(model, s.context, caches, chunk=protocol.prefill_chunk)
        mem = memory(caches)
        row = {"task": s.task, "length": s.length, "depth": s.depth, "expected": list(s.expected),
               "kv_bytes": mem.kv_bytes, "fp16_bytes": mem.fp16_bytes}
        frozen = copy.deepcopy(caches) if len(protocol.modes) > 1 else caches
        for mode in protocol.modes:
            use = _appended(frozen) if mode == "out" else caches
            answer, steps = _answer(model, tokenizer, use, s.question, s.expected,
                                    s.max_new_tokens)
            row[mode] = {"answer": answer, "score": score(answer, s.expected), "steps": steps}
        trials.append(row)
        if progress:
            progress()
    return trials


def _scores(model, tokens: Sequence[int], caches: list, *, prefix: int, chunk: int,
            prefill_chunk: int, reference: dict | None) -> dict[str, np.ndarray]:
    """Per-position NLL, argmax and (with a reference) KL and top-1 agreement of a stream."""
    import mlx.core as mx

    from velox.adapters.harness import prefill

    toks = list(tokens)
    n = len(toks)
    prefill(model, toks[:prefix - 1], caches, chunk=prefill_chunk)
    nll, top, kl, lps = [], [], [], []
    pos = 0
    for i in range(prefix - 1, n - 1, chunk):
        inputs = toks[i:min(i + chunk, n - 1)]
        targets = mx.array(toks[i + 1:i + 1 + len(inputs)])
        logits = _forward(model, inputs, caches)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll.append(-mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0])
        top.append(mx.argmax(lp, axis=-1))
        if reference is not None:
            ref = mx.array(reference["logprobs"][pos:pos + len(inputs)])
            kl.append(mx.maximum(mx.sum(mx.exp(ref) * (ref - lp), axis=-1), 0.0))
        else:
            lps.append(lp)
        pos += len(inputs)
        mx.eval(nll[-1], top[-1], kl[-1] if kl else nll[-1], [c.state for c in caches])
        if lps:
            lps[-1] = np.array(lps[-1])
    out = {"nll": np.concatenate([np.array(x) for x in nll]),
           "argmax": np.concatenate([np.array(x) for x in top])}
    if reference is not None:
        out["kl"] = np.concatenate([np.array(x) for x in kl])
        out["top1"] = (out["argmax"] == reference["argmax"]).astype(np.float64)
    else:
        out["logprobs"] = np.concatenate(lps)
        out["kl"] = np.zeros(len(out["nll"]))
        out["top1"] = np.ones(len(out["nll"]))
    return out


def _lm_figures(per: dict[str, np.ndarray], protocol: Protocol, seed: int) -> dict[str, Any]:
    nll = per["nll"]
    block = min(protocol.block, max(1, nll.size // 20))  # at least 20 blocks
    kw = dict(block=block, reps=protocol.bootstrap, confidence=protocol.confidence, seed=seed)
    lo, hi = block_bootstrap(nll, **kw)
    out = {"tokens": int(nll.size), "block": block, "nll": float(nll.mean()), "nll_lo": lo,
           "nll_hi": hi,
           "ppl": math.exp(nll.mean()), "ppl_lo": math.exp(lo), "ppl_hi": math.exp(hi)}
    for k in ("kl", "top1"):
        lo, hi = block_bootstrap(per[k], **kw)
        out[k], out[k + "_lo"], out[k + "_hi"] = float(per[k].mean()), lo, hi
    return out


def _lm_streams(tokenizer, protocol: Protocol) -> dict[str, list[tuple[list[int], int, int]]]:
    """Token streams of the language-modelling measurements: (tokens, prefix, chunk) each."""
    from velox.adapters.harness import _encode, load_text, text_names

    main = _encode(tokenizer, load_text(protocol.stream_text))
    need = max(protocol.stream_tokens, protocol.decode_tokens)
    if len(main) < need:
        raise ValueError(f"the text {protocol.stream_text!r} has {len(main)} tokens; "
                         f"{need} were asked for")
    out = {"stream": [(main[:protocol.stream_tokens], protocol.stream_prefix,
                       protocol.stream_chunk)],
           "decode": [(main[:protocol.decode_tokens], protocol.decode_tokens - protocol.decode_span,
                       1)],
           "continuation": []}
    texts = [_encode(tokenizer, load_text(t)) for t in text_names()]
    rng = np.random.default_rng([protocol.seed, 99])
    width = protocol.cont_prefix + protocol.cont_tokens + 1
    for i in range(protocol.cont_samples):
        ids = texts[i % len(texts)]
        if len(ids) < width:
            raise ValueError(f"cont_prefix + cont_tokens = {width - 1} exceeds a shipped text")
        at = int(rng.integers(0, len(ids) - width + 1))
        out["continuation"].append((ids[at:at + width], protocol.cont_prefix + 1,
                                    protocol.cont_tokens))
    return out


def _lm(model, factory: Factory, protocol: Protocol, streams, references, progress):
    from velox.adapters.harness import memory

    results, per_ref = {}, {}
    for name, items in streams.items():
        pers = []
        mem = None
        for j, (toks, prefix, chunk) in enumerate(items):
            context = len(toks) - 1 if name != "continuation" else prefix - 1
            caches = factory(context)
            ref = None if references is None else references[name][j]
            per = _scores(model, toks, caches, prefix=prefix, chunk=chunk,
                          prefill_chunk=protocol.prefill_chunk, reference=ref)
            mem = memory(caches)
            pers.append(per)
            if progress:
                progress()
        joined = {k: np.concatenate([p[k] for p in pers]) for k in ("nll", "kl", "top1")}
        fig = _lm_figures(joined, protocol, protocol.seed)
        fig.update({"kv_bytes": mem.kv_bytes, "fp16_bytes": mem.fp16_bytes})
        results[name] = fig
        per_ref[name] = pers
    return results, per_ref


def _summarise(trials: list[dict], protocol: Protocol) -> dict[str, Any]:
    kw = dict(confidence=protocol.confidence, reps=protocol.bootstrap, seed=protocol.seed)
    out: dict[str, Any] = {}
    for mode in protocol.modes:
        per_task = {}
        for task in protocol.tasks:
            rows = [t for t in trials if t["task"] == task]
            if not rows:
                continue
            entry = _summary([t[mode]["score"] for t in rows], **kw)
            entry["by_length"] = {str(L): _summary([t[mode]["score"] for t in rows
                                                    if t["length"] == L], **kw)
                                  for L in protocol.lengths}
            if task in NEEDLE_TASKS:
                entry["by_depth"] = {str(d): _summary([t[mode]["score"] for t in rows
                                                       if t["depth"] == d], **kw)
                                     for d in protocol.depths}
            per_task[task] = entry
        if len(per_task) == 1:  # one task: its own interval
            per_task["mean"] = {k: v for k, v in next(iter(per_task.values())).items()
                                if k not in ("by_length", "by_depth")}
            out[mode] = per_task
            continue
        means = [t[mode]["score"] for t in trials]
        per_task["mean"] = {"mean": float(np.mean([v["mean"] for k, v in per_task.items()])),
                            "n": len(means)}
        # interval of the task-averaged score: bootstrap prompts within each task
        rng = np.random.default_rng(protocol.seed)
        groups = [np.array([t[mode]["score"] for t in trials if t["task"] == task])
                  for task in protocol.tasks if any(t["task"] == task for t in trials)]
        reps = np.mean([g[rng.integers(0, g.size, size=(protocol.bootstrap, g.size))].mean(axis=1)
                        for g in groups], axis=0)
        a = (1 - protocol.confidence) / 2
        per_task["mean"].update(lo=float(np.quantile(reps, a)), hi=float(np.quantile(reps, 1 - a)),
                                interval="bootstrap (prompts within tasks)")
        out[mode] = per_task
    L = max(protocol.lengths)
    longest = [t for t in trials if t["length"] == L]
    out["kv_bytes"] = int(np.mean([t["kv_bytes"] for t in longest]))
    out["fp16_bytes"] = int(np.mean([t["fp16_bytes"] for t in longest]))
    out["kv_bytes_length"] = L
    return out


def evaluate_config(model, tokenizer, factory: Factory, protocol: Protocol, *,
                    items: list[Sample] | None = None, streams=None, references=None,
                    progress=None) -> tuple[dict[str, Any], dict]:
    """Retrieval and language modelling of one cache configuration.

    Args:
        model, tokenizer: an mlx-lm model and its tokenizer.
        factory: context length -> a fresh prompt cache.
        protocol: the sizes.
        items: retrieval samples (default: :func:`samples`).
        streams: language-modelling streams (default: from the protocol).
        references: the full cache's per-position log-probabilities (``None``: this cache is
            the reference, its KL is 0 and its top-1 agreement 1).
        progress: called after every prompt or stream.
    Returns:
        The figures (JSON-ready) and the per-position data a reference needs.
    """
    protocol.validate()
    items = samples(tokenizer, protocol) if items is None else items
    streams = _lm_streams(tokenizer, protocol) if streams is None else streams
    t0 = time.perf_counter()
    trials = _retrieval(model, tokenizer, factory, protocol, items, progress) if items else []
    t1 = time.perf_counter()
    lm, per = _lm(model, factory, protocol, streams, references, progress)
    t2 = time.perf_counter()
    result = {"retrieval": _summarise(trials, protocol) if trials else None, "lm": lm,
              "trials": trials, "seconds": {"retrieval": t1 - t0, "lm": t2 - t1}}
    return result, per


# --- configurations ------------------------------------------------------------------

def _level_params(method: str, level: dict, given: dict, context: int) -> dict[str, Any]:
    from velox.adapters.cli import budget_params

    if "setting" in level:
        return {**given, **level["setting"]}
    budget = level["budget"] if "budget" in level else max(1, round((1 - level["ratio"]) * context))
    bp = budget_params(method, budget, given)
    if bp is None:
        raise ValueError(f"{method} cannot hold a budget of {budget} tokens")
    return {**given, **bp}


def configs(methods: Sequence[str], *, ratios: Sequence[float] = (), budgets: Sequence[int] = (),
            params: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The (method, level) pairs of a run; a level is a ratio, a token budget or a setting.

    Methods with a budget get one level per ratio and per budget; the others their default
    setting and their spec's aggressive preset (``velox.adapters.cli._bit_settings``).
    """
    from velox.adapters.cli import _bit_settings, _budget_given, _split_params, budget_params
    from velox.registry import get_method
    from velox.spec import validate_params

    for r in ratios:
        if not 0.0 < r < 1.0:
            raise ValueError(f"ratios must be in (0, 1) (the share of tokens removed), got {r}")
    for b in budgets:
        if b < 1:
            raise ValueError(f"budgets must be >= 1, got {b}")
    if not ratios and not budgets:
        raise ValueError("give --ratios or --budgets")
    methods = [m for m in methods if m != FULL]
    for m in methods:
        get_method(m)
    common, scoped = _split_params(list(params), methods)
    used: set[str] = set()
    out = []
    for m in methods:
        spec = get_method(m).spec
        given = {k: v for k, v in common.items() if k in spec.params}
        used |= set(given)
        given.update(scoped[m])
        taken = _budget_given(spec, given)
        if taken is not None:  # the run's levels set the budget (a probe's 4096 is no user's)
            raise ValueError(f"{m}: --param {taken}={given[taken]!r} sets the budget, which this run "
                             "sets itself at each level (--ratios, --budgets); drop it")
        if budget_params(m, 4096, given) is not None:
            levels = [{"ratio": float(r)} for r in ratios] + [{"budget": int(b)} for b in budgets]
        else:
            levels = [{"setting": s} for s in _bit_settings(m, given)]
            validate_params(spec, {**given, **levels[-1]["setting"]})
        for level in levels:
            out.append({"method": m, "level": level, "given": given})
    unused = sorted(set(common) - used)
    if unused:
        raise ValueError(f"--param {', '.join(unused)}: no method in the run has such a parameter")
    return out


def _level_label(level: dict) -> str:
    if "ratio" in level:
        return f"ratio {level['ratio']:g}"
    if "budget" in level:
        return f"{level['budget']} tokens"
    s = level["setting"]
    return ", ".join(f"{k}={v}" for k, v in s.items()) or "defaults"


def _factory(model, cfg: dict | None) -> Factory:
    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters.mlxlm import make_cache

    if cfg is None:
        return lambda context: make_prompt_cache(model)
    return lambda context: make_cache(model, cfg["method"],
                                      **_level_params(cfg["method"], cfg["level"], cfg["given"],
                                                      context))


def _work(protocol: Protocol) -> tuple[int, int]:
    """Tokens prefilled and the most decode steps of one configuration."""
    per_length = len(protocol.depths) * protocol.prompts
    n = per_length * len(protocol.lengths) * len(protocol.tasks)
    prefill = per_length * len(protocol.tasks) * sum(protocol.lengths) + protocol.stream_tokens \
        + protocol.decode_tokens \
        + protocol.cont_samples * (protocol.cont_prefix + protocol.cont_tokens)
    steps = per_length * len(protocol.lengths) * len(protocol.modes) * sum(
        _ANSWER_LIMITS[t] for t in protocol.tasks) + protocol.decode_span
    return prefill, steps


def run_suite(model, tokenizer, cfgs: list[dict], protocol: Protocol, *, log=None,
              model_name: str = "") -> dict[str, Any]:
    """The full cache, then every configuration of ``cfgs``; the JSON-ready result."""
    protocol.validate()
    say = log or (lambda msg: None)
    items = samples(tokenizer, protocol)
    streams = _lm_streams(tokenizer, protocol)
    start = time.perf_counter()
    t = time.perf_counter()
    full, refs = evaluate_config(model, tokenizer, _factory(model, None), protocol, items=items,
                                 streams=streams)
    full_s = time.perf_counter() - t
    refs = {k: [{"logprobs": p["logprobs"], "argmax": p["argmax"]} for p in v]
            for k, v in refs.items()}
    rows = [{"method": FULL, "level": {}, "label": FULL, "params": {}, **full,
             "wall_seconds": full_s}]
    say(f"full cache: {full_s:.1f} s; projected for {len(cfgs)} more configurations: "
        f"{_hms(full_s * 1.3 * len(cfgs))} (1.3x the full cache's time each)")
    spent = []
    for i, cfg in enumerate(cfgs):
        label = f"{cfg['method']} {_level_label(cfg['level'])}"
        t = time.perf_counter()
        try:
            res, _ = evaluate_config(model, tokenizer, _factory(model, cfg), protocol, items=items,
                                     streams=streams, references=refs)
            err = None
        except (ValueError, RuntimeError) as exc:
            res, err = {}, " ".join(str(exc).split())
        spent.append(time.perf_counter() - t)
        params = {}
        try:
            params = {str(L): _level_params(cfg["method"], cfg["level"], cfg["given"], L)
                      for L in _contexts(protocol)}
        except ValueError:
            pass
        rows.append({"method": cfg["method"], "level": cfg["level"],
                     "label": _level_label(cfg["level"]), "params": params, **res,
                     "error": err, "wall_seconds": spent[-1]})
        left = len(cfgs) - i - 1
        say(f"[{i + 1}/{len(cfgs)}] {label}: {spent[-1]:.1f} s"
            + (f" ({err})" if err else "") + (f"; about {_hms(np.mean(spent) * left)} left"
                                              if left else ""))
    return {"protocol": _protocol_dict(protocol), "model": model_name, "rows": rows,
            "wall_seconds": time.perf_counter() - start}


def _contexts(protocol: Protocol) -> list[int]:
    """Context lengths budgets are computed from, in the order measurements use them."""
    return sorted({*protocol.lengths, protocol.stream_tokens - 1, protocol.decode_tokens - 1,
                   protocol.cont_prefix})


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"


def _protocol_dict(protocol: Protocol) -> dict[str, Any]:
    d = asdict(protocol)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


# --- output --------------------------------------------------------------------------

def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs of the same protocol (split by ``--methods``).

    Raises:
        ValueError: if the protocols or models differ, or a configuration appears twice.
    """
    if not results:
        raise ValueError("merge needs at least one result")
    first = results[0]
    rows, seen = [], set()
    for r in results:
        if r["protocol"] != first["protocol"]:
            raise ValueError("merge: the runs used different protocols")
        if r.get("model") != first.get("model"):
            raise ValueError(f"merge: different models ({r.get('model')!r}, "
                             f"{first.get('model')!r})")
        for row in r["rows"]:
            key = (row["method"], json.dumps(row["level"], sort_keys=True))
            if key in seen:
                if row["method"] == FULL:
                    continue
                raise ValueError(f"merge: {row['method']} {row['label']} appears in two runs")
            seen.add(key)
            rows.append(row)
    out = {k: v for k, v in first.items() if k != "run"}
    out.update(rows=rows, wall_seconds=sum(r.get("wall_seconds", 0) for r in results),
               merged_from=[r.get("run") or {"merged_from": r.get("merged_from")}
                            for r in results])
    return out


def _ci(entry: dict | None, key: str = "mean", digits: int = 2) -> str:
    if not entry or entry.get(key) is None:
        return "-"
    lo, hi = (entry.get("lo"), entry.get("hi")) if key == "mean" else \
        (entry.get(key + "_lo"), entry.get(key + "_hi"))
    return f"{entry[key]:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def markdown(result: dict[str, Any]) -> str:
    """Tables of a result: retrieval per mode, passkey by length, language modelling."""
    p = result["protocol"]
    rows = result["rows"]
    lines = []
    for mode in p["modes"]:
        several = len(p["tasks"]) > 1
        head = ["method", "level", f"KV MiB @{max(p['lengths'])}", *p["tasks"]] + \
            (["mean"] if several else [])
        lines += [f"### Retrieval, mode `{mode}` ({MODE_NAMES[mode]})", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            ret = r.get("retrieval")
            if not ret:
                lines.append(f"| `{r['method']}` | {r['label']} | - | "
                             + " | ".join(["-"] * (len(head) - 3)) + " |")
                continue
            cells = [_ci(ret[mode].get(t)) for t in p["tasks"]] + \
                ([_ci(ret[mode]["mean"])] if several else [])
            lines.append(f"| `{r['method']}` | {r['label']} | {_mib(ret['kv_bytes'])} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    if "passkey" in p["tasks"] and len(p["lengths"]) > 1:
        head = ["method", "level"] + [f"{m} @{L}" for m in p["modes"] for L in p["lengths"]]
        lines += ["### Passkey by prompt length", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        for r in rows:
            ret = r.get("retrieval")
            cells = ["-" if not ret else _ci(ret[m]["passkey"]["by_length"][str(L)])
                     for m in p["modes"] for L in p["lengths"]]
            lines.append(f"| `{r['method']}` | {r['label']} | " + " | ".join(cells) + " |")
        lines.append("")
    head = ["method", "level", "KV MiB (stream)", "ratio vs fp16", "stream ppl", "stream top-1",
            "decode ppl", "decode KL", "decode top-1", "continuation NLL", "continuation KL",
            "continuation top-1", "error"]
    lines += ["### Language modelling", "", "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head)]
    for r in rows:
        lm = r.get("lm") or {}
        s, d, c = lm.get("stream"), lm.get("decode"), lm.get("continuation")
        ratio = "-" if not s else f"{s['fp16_bytes'] / s['kv_bytes']:.2f}x"
        lines.append("| " + " | ".join([
            f"`{r['method']}`", r["label"], _mib(s and s["kv_bytes"]), ratio,
            _ci(s, "ppl"), _ci(s, "top1"), _ci(d, "ppl"), _ci(d, "kl", 3), _ci(d, "top1"),
            _ci(c, "nll"), _ci(c, "kl", 3), _ci(c, "top1"), r.get("error") or ""]) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Quality against bytes held: retrieval per mode, stream perplexity, continuation KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["protocol"]
    rows = [r for r in result["rows"] if r.get("lm")]
    one = p["tasks"][0] if len(p["tasks"]) == 1 else None
    panels = [(f"{one or 'retrieval mean'}, mode {m} ({MODE_NAMES[m]})",
               lambda r, m=m: r["retrieval"] and r["retrieval"][m][one or "mean"], "retrieval")
              for m in p["modes"]]
    panels += [("stream perplexity", lambda r: _as_mean(r["lm"]["stream"], "ppl"), "stream"),
               ("continuation KL(full || compressed)",
                lambda r: _as_mean(r["lm"]["continuation"], "kl"), "continuation")]
    cols = 2 if len(panels) > 2 else len(panels)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols + 2.2, 4.8 * nrows), squeeze=False)
    axes = axes.ravel()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cmap = plt.cm.tab20
    for ax, (title, get, where) in zip(axes, panels):
        for i, m in enumerate(methods):
            pts = []
            for r in rows:
                if r["method"] != m:
                    continue
                e = get(r)
                if not e:
                    continue
                b = (r["retrieval"] if where == "retrieval" else r["lm"][where])["kv_bytes"]
                pts.append((b / 2**20, e["mean"], e["mean"] - e["lo"], e["hi"] - e["mean"]))
            if not pts:
                continue
            pts.sort()
            x, y, lo, hi = map(np.array, zip(*pts))
            style = dict(marker="*", markersize=12, color="k") if m == FULL else \
                dict(marker="os^vD"[(i // 20) % 5], markersize=5, color=cmap(i % 20))
            ax.errorbar(x, y, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], label=m, capsize=2,
                        linewidth=0.8, **style)
        ax.set_xscale("log")
        ax.set_xlabel("KV cache bytes held (MiB)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[len(panels):]:
        ax.axis("off")
    fig.legend(handles, labels, fontsize=7, loc="center right", ncol=1)
    fig.suptitle(f"{result.get('model', '')}: quality vs bytes ({int(p['confidence'] * 100)}% "
                 "intervals)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / (6.5 * cols + 2.2), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _as_mean(entry: dict, key: str) -> dict:
    return {"mean": entry[key], "lo": entry[key + "_lo"], "hi": entry[key + "_hi"]}


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        return _clean(x.item())
    return x


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """``suite.json``, ``suite.md`` and ``suite.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "suite.json", out / "suite.md", out / "suite.png"]
    paths[0].write_text(json.dumps(_clean(result), indent=1))
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths


# --- command -------------------------------------------------------------------------

def _floats(text: str) -> list[float]:
    return _csv_list(float, text)


def _ints(text: str) -> list[int]:
    return _csv_list(int, text)


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


_SIZE_FLAGS = {"lengths": _ints, "depths": _floats, "prompts": int, "tasks": _names,
               "modes": _names, "stream_tokens": int, "stream_prefix": int, "stream_chunk": int,
               "decode_tokens": int, "decode_span": int, "cont_samples": int, "cont_prefix": int,
               "cont_tokens": int, "prefill_chunk": int, "bootstrap": int, "seed": int}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to an argparse ``subparsers`` object; returns its parser."""
    e = subparsers.add_parser("eval", help="quality suite: retrieval and language modelling "
                              "with intervals")
    e.add_argument("--methods", default="all",
                   help="comma-separated method keys, or 'all' (default) for every registered one")
    e.add_argument("--ratios", type=_floats, default=None,
                   help="shares of the context removed, e.g. 0.5,0.75 (default 0.5,0.75)")
    e.add_argument("--ratio", type=float, action="append", dest="ratio_one", default=[],
                   help="one share removed (repeatable; adds to --ratios)")
    e.add_argument("--budgets", type=_ints, default=[], help="token budgets (fixed counts)")
    e.add_argument("--param", action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                   help="a parameter for every method that has it, or for one method")
    e.add_argument("--quick", action="store_true",
                   help="small sizes, a smoke run: about a CPU-minute per configuration on a "
                        "2-core x86 CPU (3.5 CPU-minutes for --methods tova: two ratios and the "
                        "full cache); with --methods all, 76 configurations (see --plan)")
    for name, kind in _SIZE_FLAGS.items():
        e.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"override the protocol's {name} (default {getattr(DEFAULT, name)})")
    e.add_argument("--no-chat", action="store_true", help="do not use the chat template")
    e.add_argument("--model", help="an mlx-lm model folder (default: the embedded SmolLM2)")
    e.add_argument("--out", help="folder for suite.json, suite.md and suite.png")
    e.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge suite.json files of one protocol into --out (runs nothing)")
    e.add_argument("--plan", action="store_true",
                   help="print the configurations and the work per configuration; run nothing")
    e.set_defaults(handler=run)
    return e


def protocol_from(args) -> Protocol:
    """The protocol an ``eval`` command line asks for."""
    base = QUICK if args.quick else DEFAULT
    over = {}
    for name in _SIZE_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            over[name] = tuple(v) if isinstance(v, list) else v
    if getattr(args, "no_chat", False):
        over["chat"] = False
    return replace(base, **over).validate()


def run(args) -> int:
    """Run ``velox eval`` from parsed arguments; returns the exit status."""
    if args.merge:
        if not args.out:
            raise ValueError("--merge needs --out")
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        result = merge(parts)
        for p in write(result, Path(args.out).expanduser()):
            print(f"wrote {p}")
        return 0
    protocol = protocol_from(args)
    from velox.registry import method_keys

    methods = list(method_keys()) if args.methods == "all" else _names(args.methods)
    ratios = list(args.ratios if args.ratios is not None else
                  ([] if args.budgets or args.ratio_one else [0.5, 0.75])) + list(args.ratio_one)
    cfgs = configs(methods, ratios=ratios, budgets=args.budgets, params=args.param)
    prefill_tokens, steps = _work(protocol)
    print(f"velox eval: {len(cfgs)} configurations and the full cache; per configuration "
          f"{prefill_tokens} prefilled tokens and at most ~{steps} decode steps"
          + (" (--quick: about a CPU-minute each on a 2-core x86 CPU)" if args.quick else ""),
          file=sys.stderr)
    if args.plan:
        for c in cfgs:
            print(f"{c['method']}\t{_level_label(c['level'])}")
        return 0
    from velox.adapters.smollm2 import load_model

    wall, cpu = time.perf_counter(), time.process_time()
    model, tokenizer = load_model(args.model)
    name = args.model or "SmolLM2-135M-Instruct (embedded GGUF, fp32)"
    result = run_suite(model, tokenizer, cfgs, protocol, model_name=name,
                       log=lambda m: print("velox eval: " + m, file=sys.stderr, flush=True))
    result["run"] = _run_info(ratios, args, time.perf_counter() - wall, time.process_time() - cpu)
    sys.stdout.write(markdown(result))
    if args.out:
        for p in write(result, Path(args.out).expanduser()):
            print(f"wrote {p}")
    return 0


def _run_info(ratios, args, wall: float, cpu: float) -> dict[str, Any]:
    import mlx.core as mx

    from velox import _blas

    return {"command": "velox eval " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "ratios": ratios, "budgets": args.budgets, "params": args.param,
            "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
            "machine": {"platform": platform.platform(), "processor": platform.machine(),
                        "cpus": os.cpu_count(), "device": str(mx.default_device()),
                        "openblas": _blas.loaded is not None, "openblas_reason": _blas.reason,
                        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None},
            "versions": {"mlx": mx.__version__, "python": platform.python_version()}}


def main(argv: list[str] | None = None) -> int:
    """``python -m velox.adapters.suite ...``: the ``eval`` subcommand on its own."""
    parser = argparse.ArgumentParser(prog="velox")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"velox: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
