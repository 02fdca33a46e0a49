"""Quality harness: perplexity, passkey retrieval, greedy agreement, memory and decode speed.

Every measurement takes a ``cache_factory``: a callable returning a fresh prompt cache for the
model, e.g. ``lambda: make_cache(model, "tova", budget=256)`` or ``lambda:
make_prompt_cache(model)`` for the full-cache baseline. The cache really evicts or quantizes
while tokens stream through it; nothing is recomputed from a full cache.

Protocols (shared by the functions below and by ``velox compare``):

* **Prefill.** A prompt is fed in chunks of ``prefill_chunk`` tokens (one forward each). Only
  the cache states are evaluated, so the language-model head is not computed for prefill.
* **Perplexity** (:func:`perplexity`). Tokens ``t[:prefix-1]`` are prefilled; then
  ``t[prefix-1:-1]`` are fed in chunks of ``chunk`` tokens. Each chunk attends to the cache as
  it stands (stored tokens plus the chunk, causally), its logits score the next tokens, and
  then the cache absorbs the chunk (eviction or quantization happens here, so decode-time
  compression is exercised). Every token of ``t[prefix:]`` is scored exactly once; the result
  is the mean negative log-likelihood (nats) and its exponential.
* **Agreement** (:func:`agreement`). The prompt minus its last token is prefilled and the cache
  copied. The full cache's greedy continuation ``g`` of ``new_tokens`` tokens is the reference.
  Free run: the compressed cache decodes greedily one token per step; the token match rate is
  position-wise over all ``new_tokens`` positions, and the first divergence is the first
  position where the tokens differ (``new_tokens`` if none). Teacher-forced run (on the copy):
  the compressed cache is fed ``g`` one token per step; KL(full || compressed) of the
  next-token distributions is averaged over the positions, and ``top1`` is the share of
  positions where the compressed argmax equals ``g``.
* **Speed and memory.** Decode tokens/s is timed on the free run: single-token greedy steps after
  the prefill, the first step excluded (warm-up, compilation). Memory is ``cache_nbytes`` (bytes
  the cache really holds) after the run, beside a full cache of the tokens seen in the same
  dtype and in fp16 (:class:`Memory`).
* **Passkey** (:func:`passkey`). A five-digit key is hidden at a relative ``depth`` of filler
  made of a shipped public-domain text, with the question at the end; the prompt is ``length``
  tokens. Like ``mlx_lm.generate``, ``prompt[:-1]`` is prefilled and decoding starts from the
  last prompt token; the greedy answer (at most ``max_new_tokens`` tokens) is correct when its
  first number equals the key.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import mlx.core as mx
import numpy as np

import velox
from velox.adapters.cache import VeloxCache, _dims, cache_nbytes

__all__ = [
    "Memory", "Perplexity", "Continuation", "Agreement", "PasskeyTrial", "Passkey", "Evaluation",
    "text_names", "load_text", "text_tokens", "memory", "prefill", "perplexity",
    "greedy_continuation", "agreement", "speed", "passkey_prompt", "score_answer", "passkey",
    "evaluate",
]

CacheFactory = Callable[[], list]
Progress = Callable[[int], Any] | None

# --- texts ---------------------------------------------------------------------------

def text_names() -> tuple[str, ...]:
    """Names of the shipped evaluation texts (``adapters/data/<name>.txt``)."""
    folder = resources.files("velox.adapters") / "data"
    return tuple(sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".txt")))


def load_text(name: str) -> str:
    """The shipped public-domain text ``name`` (see ``adapters/data/SOURCES.md``).

    Raises:
        ValueError: if no text has that name.
    """
    path = resources.files("velox.adapters") / "data" / f"{name}.txt"
    if not path.is_file():
        raise ValueError(f"unknown text {name!r}; shipped: {', '.join(text_names())}")
    return path.read_text(encoding="utf-8")


def _encode(tokenizer, text: str) -> list[int]:
    """Token ids of a long text, without the tokenizer's max-length warning."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return list(tokenizer.encode(text))
    finally:
        log.setLevel(level)


def text_tokens(tokenizer, text: str, n: int, *, offset: int = 0) -> list[int]:
    """Tokens ``offset .. offset + n`` of ``text``; ``ValueError`` when it is too short."""
    ids = _encode(tokenizer, text)
    if offset + n > len(ids):
        raise ValueError(f"the text has {len(ids)} tokens; {offset + n} were asked for")
    return ids[offset:offset + n]


# --- results -------------------------------------------------------------------------

@dataclass(frozen=True)
class Memory:
    """Bytes a prompt cache really holds, and what full caches of the tokens seen would need.

    ``full_bytes`` is a full cache of the tokens seen in the cache's own dtype (keys and
    values, every layer, no preallocated slots); ``fp16_bytes`` the same in fp16. ``stored``
    is the most tokens any layer keeps.
    """

    kv_bytes: int
    fp16_bytes: int
    tokens: int
    full_bytes: int = 0
    stored: int = 0
    dtype: str = ""

    @property
    def ratio(self) -> float:
        """fp16 bytes of the tokens seen over the bytes held (higher is smaller)."""
        return self.fp16_bytes / self.kv_bytes if self.kv_bytes else math.inf

    @property
    def full_ratio(self) -> float:
        """Bytes of a full cache of the same dtype over the bytes held (higher is smaller)."""
        return self.full_bytes / self.kv_bytes if self.kv_bytes else math.inf


@dataclass(frozen=True)
class Perplexity:
    """Mean NLL (nats/token) and perplexity over ``tokens`` scored tokens."""

    nll: float
    ppl: float
    tokens: int
    prefix: int
    chunk: int
    memory: Memory
    seconds: float


@dataclass(frozen=True)
class Continuation:
    """A greedy continuation: tokens, log-probabilities ``[n, vocab]`` and decode timing."""

    tokens: tuple[int, ...]
    logprobs: mx.array = field(repr=False)
    decode_tok_s: float
    memory: Memory


@dataclass(frozen=True)
class Agreement:
    """Greedy agreement of a compressed cache with the full cache's continuation."""

    match_rate: float
    first_divergence: int
    kl: float
    top1: float
    new_tokens: int
    decode_tok_s: float
    memory: Memory
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class PasskeyTrial:
    """One passkey prompt and the model's answer."""

    length: int
    depth: float
    key: str
    answer: str
    correct: bool
    needle_at: int


@dataclass(frozen=True)
class Passkey:
    """Passkey accuracy per ``(length, depth)`` and overall."""

    trials: tuple[PasskeyTrial, ...]

    @property
    def accuracy(self) -> float:
        return sum(t.correct for t in self.trials) / len(self.trials) if self.trials else math.nan

    @property
    def by_cell(self) -> dict[tuple[int, float], float]:
        cells: dict[tuple[int, float], list[bool]] = {}
        for t in self.trials:
            cells.setdefault((t.length, t.depth), []).append(t.correct)
        return {k: sum(v) / len(v) for k, v in cells.items()}


@dataclass(frozen=True)
class Evaluation:
    """Perplexity, agreement (with speed and memory) and passkey of one cache configuration.

    ``seconds`` is the wall time of the whole evaluation; ``phase_seconds`` splits it into
    ``perplexity``, ``agreement`` and ``passkey``.
    """

    perplexity: Perplexity
    agreement: Agreement
    passkey: Passkey | None
    reference: Continuation | None
    seconds: float
    phase_seconds: dict[str, float] = field(default_factory=dict)


# --- cache plumbing ------------------------------------------------------------------

def memory(caches: list) -> Memory:
    """Real bytes held by ``caches``, the bytes full caches of the tokens seen would need (in
    the caches' dtype and in fp16), and the tokens seen and stored."""
    fp16 = 0
    full = 0
    tokens = 0
    stored = 0
    dtypes = set()
    for c in caches:
        if isinstance(c, VeloxCache):
            if c.velox_state is None:
                continue
            b, h, d, dtype = _dims(c)
            n, kept = c.offset, c.size()
        elif getattr(c, "keys", None) is not None and hasattr(c.keys, "shape"):
            b, h, _, d = c.keys.shape
            dtype = c.keys.dtype
            n = kept = int(c.offset)
        else:
            continue
        fp16 += velox.fp16_bytes(n, b, h, d)
        full += n * b * h * d * 2 * dtype.size
        dtypes.add(str(dtype).split(".")[-1])
        tokens = max(tokens, int(n))
        stored = max(stored, int(kept))
    return Memory(kv_bytes=cache_nbytes(caches), fp16_bytes=fp16, tokens=tokens,
                  full_bytes=full, stored=stored, dtype="/".join(sorted(dtypes)))


def _eval_caches(caches: list) -> None:
    mx.eval([c.state for c in caches])


def _forward(model, tokens: Sequence[int], caches: list) -> mx.array:
    return model(mx.array([list(tokens)]), cache=caches)


def prefill(model, tokens: Sequence[int], caches: list, *, chunk: int = 512,
            progress: Progress = None) -> None:
    """Feed ``tokens`` into ``caches`` in chunks of ``chunk`` (no logits are computed)."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    for i in range(0, len(tokens), chunk):
        part = tokens[i:i + chunk]
        _forward(model, part, caches)
        _eval_caches(caches)
        if progress:
            progress(len(part))


def _step(model, token: int, caches: list) -> mx.array:
    """One single-token decode step; log-probabilities ``[vocab]`` (float32)."""
    logits = _forward(model, [token], caches)[0, -1].astype(mx.float32)
    return logits - mx.logsumexp(logits, keepdims=True)


# --- perplexity ----------------------------------------------------------------------

def _stream(model, tokens: Sequence[int], caches: list, *, prefix: int, chunk: int,
            prefill_chunk: int, progress: Progress) -> tuple[float, int]:
    """The perplexity protocol on ``caches``; returns (NLL sum, tokens scored)."""
    n = len(tokens)
    if not 1 <= prefix < n:
        raise ValueError(f"prefix must be in [1, {n - 1}] for {n} tokens, got {prefix}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    prefill(model, tokens[:prefix - 1], caches, chunk=prefill_chunk, progress=progress)
    total = mx.array(0.0)
    for i in range(prefix - 1, n - 1, chunk):
        inputs = tokens[i:min(i + chunk, n - 1)]
        targets = mx.array(tokens[i + 1:i + 1 + len(inputs)])
        logits = _forward(model, inputs, caches)[0].astype(mx.float32)
        nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(
            logits, targets[:, None], axis=-1)[:, 0]
        total = total + nll.sum()
        mx.eval(total, [c.state for c in caches])
        if progress:
            progress(len(inputs))
    return float(total.item()), n - prefix


def perplexity(model, tokens: Sequence[int], cache_factory: CacheFactory, *, prefix: int = 256,
               chunk: int = 64, prefill_chunk: int = 512,
               progress: Progress = None) -> Perplexity:
    """Perplexity of ``tokens`` while the cache compresses them as they stream through it.

    Protocol: ``t[:prefix-1]`` is prefilled in chunks of ``prefill_chunk``; then
    ``t[prefix-1:-1]`` is fed in chunks of ``chunk`` tokens, each scored with the cache as it
    stands (stored tokens + the chunk, causal) and then absorbed by it. Every token of
    ``t[prefix:]`` is scored once.

    Args:
        model: an mlx-lm model.
        tokens: token ids of the text.
        cache_factory: returns a fresh prompt cache.
        prefix: tokens of context before the first scored token.
        chunk: tokens per scored chunk (1 is token-by-token decoding).
        prefill_chunk: tokens per prefill forward.
        progress: called with the number of tokens after each forward.
    Returns:
        NLL (nats/token), perplexity, tokens scored and the cache's memory at the end.
    """
    caches = cache_factory()
    start = time.perf_counter()
    nll_sum, scored = _stream(model, list(tokens), caches, prefix=prefix, chunk=chunk,
                              prefill_chunk=prefill_chunk, progress=progress)
    nll = nll_sum / scored
    return Perplexity(nll=nll, ppl=math.exp(nll), tokens=scored, prefix=prefix, chunk=chunk,
                      memory=memory(caches), seconds=time.perf_counter() - start)


# --- agreement and speed -------------------------------------------------------------

def _run(model, caches: list, first: int, new_tokens: int, *, forced: Sequence[int] | None,
         progress: Progress) -> tuple[list[int], mx.array, float]:
    """``new_tokens`` single-token steps starting with input ``first``.

    Free run (``forced=None``): each step feeds the previous greedy token. Teacher-forced: step
    ``i > 0`` feeds ``forced[i - 1]``. Returns the greedy tokens, the log-probabilities
    ``[new_tokens, vocab]`` and the decode speed over steps after the first.
    """
    tokens: list[int] = []
    logprobs = []
    x = first
    t0 = None
    for i in range(new_tokens):
        if i == 1:
            t0 = time.perf_counter()
        lp = _step(model, x, caches)
        nxt = int(mx.argmax(lp).item())  # evaluates this step
        tokens.append(nxt)
        logprobs.append(lp)
        x = nxt if forced is None else (forced[i] if i < len(forced) else nxt)
        if progress:
            progress(1)
    _eval_caches(caches)
    elapsed = time.perf_counter() - t0 if t0 is not None else 0.0
    tok_s = (new_tokens - 1) / elapsed if elapsed > 0 else math.nan
    return tokens, mx.stack(logprobs), tok_s


def greedy_continuation(model, caches: list, first: int, new_tokens: int, *,
                        progress: Progress = None) -> Continuation:
    """Greedy free run of ``new_tokens`` steps from ``caches``, fed ``first`` first.

    Args:
        model: an mlx-lm model.
        caches: a prompt cache that has seen the prompt minus its last token (consumed).
        first: the prompt's last token (the first decode input).
        new_tokens: tokens to generate (single-token steps).
        progress: called with 1 after each step.
    Returns:
        Tokens, log-probabilities, decode tokens/s (first step excluded) and memory after.
    """
    tokens, lps, tok_s = _run(model, caches, first, new_tokens, forced=None, progress=progress)
    mx.eval(lps)
    return Continuation(tokens=tuple(tokens), logprobs=lps, decode_tok_s=tok_s,
                        memory=memory(caches))


def _compare(model, caches: list, first: int, reference: Continuation, *,
             progress: Progress) -> Agreement:
    """Free and teacher-forced runs of ``caches`` against ``reference``."""
    snapshot = copy.deepcopy(caches)
    free = greedy_continuation(model, caches, first, len(reference.tokens), progress=progress)
    return _forced(model, snapshot, first, reference, free=free, progress=progress)


def _forced(model, caches: list, first: int, reference: Continuation, *, free: Continuation,
            progress: Progress) -> Agreement:
    """Teacher-forced run of ``caches`` on ``reference``; scores it with the free run."""
    n = len(reference.tokens)
    _, forced_lps, _ = _run(model, caches, first, n, forced=reference.tokens, progress=progress)
    ref = np.array(reference.tokens)
    got = np.array(free.tokens)
    diverged = np.nonzero(ref != got)[0]
    p = mx.exp(reference.logprobs)
    kl = mx.sum(p * (reference.logprobs - forced_lps), axis=-1)
    top1 = mx.argmax(forced_lps, axis=-1)
    mx.eval(kl, top1)
    return Agreement(
        match_rate=float((ref == got).mean()),
        first_divergence=int(diverged[0]) if diverged.size else n,
        kl=float(np.maximum(np.array(kl), 0.0).mean()),
        top1=float((np.array(top1) == ref).mean()),
        new_tokens=n, decode_tok_s=free.decode_tok_s, memory=free.memory, tokens=free.tokens)


def _full_factory(model) -> CacheFactory:
    from mlx_lm.models.cache import make_prompt_cache

    return lambda: make_prompt_cache(model)


def agreement(model, prompt_tokens: Sequence[int], cache_factory: CacheFactory, *,
              new_tokens: int = 32, reference: Continuation | None = None,
              prefill_chunk: int = 512, progress: Progress = None) -> Agreement:
    """Greedy agreement of the compressed cache with the full cache on one prompt.

    Protocol: prefill ``prompt[:-1]``, copy the cache, then (free run) decode ``new_tokens``
    greedy tokens and compare them position-wise with the full cache's, and (teacher-forced,
    on the copy) feed the full cache's tokens and average KL(full || compressed) of the
    next-token distributions.

    Args:
        model: an mlx-lm model.
        prompt_tokens: the prompt's token ids (at least 2).
        cache_factory: returns a fresh prompt cache.
        new_tokens: length of the continuation compared.
        reference: the full cache's continuation (computed with ``make_prompt_cache`` when
            ``None``; pass it to reuse it across configurations).
        prefill_chunk: tokens per prefill forward.
        progress: called with token counts as work proceeds.
    Returns:
        Match rate, first divergence, mean KL, teacher-forced top-1 agreement, decode tokens/s
        and memory after the free run.
    """
    prompt = list(prompt_tokens)
    if len(prompt) < 2:
        raise ValueError("agreement needs a prompt of at least 2 tokens")
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2, got {new_tokens}")
    if reference is None:
        caches = _full_factory(model)()
        prefill(model, prompt[:-1], caches, chunk=prefill_chunk, progress=progress)
        reference = greedy_continuation(model, caches, prompt[-1], new_tokens, progress=progress)
    caches = cache_factory()
    prefill(model, prompt[:-1], caches, chunk=prefill_chunk, progress=progress)
    return _compare(model, caches, prompt[-1], reference, progress=progress)


def speed(model, prompt_tokens: Sequence[int], cache_factory: CacheFactory, *, steps: int = 32,
          prefill_chunk: int = 512) -> Continuation:
    """Decode tokens/s: ``steps`` greedy single-token steps after prefilling the prompt.

    The first step is excluded from the timing (warm-up); memory is read after the last step.
    """
    prompt = list(prompt_tokens)
    caches = cache_factory()
    prefill(model, prompt[:-1], caches, chunk=prefill_chunk)
    return greedy_continuation(model, caches, prompt[-1], steps)


# --- passkey -------------------------------------------------------------------------

PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of "
                 "irrelevant text. Find it and memorize it. I will quiz you about the "
                 "important information there.\n\n")
PASSKEY_NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? Answer with the number only. The pass key is"


def passkey_prompt(tokenizer, *, length: int, depth: float, key: str,
                   filler: Sequence[int], offset: int = 0) -> tuple[list[int], int]:
    """A passkey prompt of exactly ``length`` tokens.

    The filler is ``filler[offset:]`` (tokens of a real text); the needle sentence sits after
    ``round(depth * filler_len)`` filler tokens; the question closes the prompt.

    Returns:
        The prompt's tokens and the index of the needle's first token.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    intro = list(tokenizer.encode(PASSKEY_INTRO))
    needle = list(tokenizer.encode(PASSKEY_NEEDLE.format(key=key)))
    question = list(tokenizer.encode(PASSKEY_QUESTION))
    n_fill = length - len(intro) - len(needle) - len(question)
    if n_fill < 0:
        raise ValueError(f"a passkey prompt needs at least {length - n_fill} tokens, got {length}")
    fill = list(filler[offset:offset + n_fill])
    if len(fill) < n_fill:
        raise ValueError(f"the filler text is too short for a {length}-token prompt")
    cut = round(depth * n_fill)
    tokens = intro + fill[:cut] + needle + fill[cut:] + question
    return tokens, len(intro) + cut


def score_answer(answer: str, key: str) -> bool:
    """Whether the first number in ``answer`` is ``key``."""
    found = re.search(r"\d+", answer)
    return found is not None and found.group(0) == key


def _answer(model, tokenizer, prompt: list[int], caches: list, *, max_new_tokens: int,
            prefill_chunk: int, progress: Progress) -> str:
    """Greedy answer: prefill ``prompt[:-1]``, then decode from its last token; stops once a
    number has been written."""
    prefill(model, prompt[:-1], caches, chunk=prefill_chunk, progress=progress)
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    out: list[int] = []
    x = prompt[-1]
    for _ in range(max_new_tokens):
        tok = int(mx.argmax(_forward(model, [x], caches)[0, -1]).item())
        if progress:
            progress(1)
        if tok in eos:
            break
        out.append(tok)
        if re.search(r"\d\D", tokenizer.decode(out)):
            break
        x = tok
    return tokenizer.decode(out)


def passkey(model, tokenizer, cache_factory: CacheFactory, *, lengths: Sequence[int] = (512,),
            depths: Sequence[float] = (0.25, 0.75), trials: int = 1, seed: int = 0,
            text: str = "pride", max_new_tokens: int = 8, prefill_chunk: int = 512,
            progress: Progress = None) -> Passkey:
    """Passkey retrieval accuracy per (length, depth) and overall.

    For each length, depth and trial: a random five-digit key and a random filler window of
    the shipped ``text`` (both from ``seed``, the same for every cache), a prompt of exactly
    ``length`` tokens (:func:`passkey_prompt`), prefill, and a greedy answer scored by
    :func:`score_answer`.

    Args:
        model, tokenizer: an mlx-lm model and its tokenizer.
        cache_factory: returns a fresh prompt cache (one per trial).
        lengths: prompt lengths in tokens.
        depths: relative positions of the needle in the filler (0 = start, 1 = end).
        trials: prompts per (length, depth).
        seed: draws the keys and filler windows.
        text: shipped filler text (:func:`text_names`).
        max_new_tokens: answer length limit.
        prefill_chunk: tokens per prefill forward.
        progress: called with token counts as work proceeds.
    Returns:
        Every trial (key, answer, correctness); ``accuracy`` and ``by_cell`` summarise them.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    filler = _encode(tokenizer, load_text(text))
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                key = str(int(rng.integers(10000, 100000)))
                offset = int(rng.integers(0, max(1, len(filler) - length)))
                prompt, at = passkey_prompt(tokenizer, length=length, depth=depth, key=key,
                                            filler=filler, offset=offset)
                answer = _answer(model, tokenizer, prompt, cache_factory(),
                                 max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
                                 progress=progress)
                out.append(PasskeyTrial(length=length, depth=float(depth), key=key,
                                        answer=answer, correct=score_answer(answer, key),
                                        needle_at=at))
    return Passkey(trials=tuple(out))


# --- everything on one run -----------------------------------------------------------

def evaluate(model, tokenizer, tokens: Sequence[int], cache_factory: CacheFactory, *,
             prefix: int = 256, chunk: int = 64, prefill_chunk: int = 512,
             new_tokens: int = 16, reference: Continuation | None = None,
             passkey_lengths: Sequence[int] = (512,), passkey_depths: Sequence[float] = (0.25, 0.75),
             passkey_trials: int = 1, passkey_text: str = "pride", seed: int = 0,
             progress: Progress = None) -> Evaluation:
    """Perplexity, agreement, speed, memory and passkey of one configuration.

    The perplexity stream (:func:`perplexity`) is the agreement's prompt: after it the cache
    has seen ``tokens[:-1]``; the continuation after ``tokens`` is compared with
    ``reference`` as in :func:`agreement`, and speed and memory come from its free run.
    With ``reference=None`` the cache's own free run becomes the reference (returned in
    ``Evaluation.reference``; pass the full cache's to compare others with it). Passkey
    prompts run on fresh caches (skipped when ``passkey_lengths`` is empty).
    """
    start = time.perf_counter()
    toks = list(tokens)
    caches = cache_factory()
    t0 = time.perf_counter()
    nll_sum, scored = _stream(model, toks, caches, prefix=prefix, chunk=chunk,
                              prefill_chunk=prefill_chunk, progress=progress)
    nll = nll_sum / scored
    ppl = Perplexity(nll=nll, ppl=math.exp(nll), tokens=scored, prefix=prefix, chunk=chunk,
                     memory=memory(caches), seconds=time.perf_counter() - t0)
    t1 = time.perf_counter()
    own = None
    if reference is None:  # this cache's free run is the reference; the forced run checks it
        snapshot = copy.deepcopy(caches)
        own = greedy_continuation(model, caches, toks[-1], new_tokens, progress=progress)
        agree = _forced(model, snapshot, toks[-1], own, free=own, progress=progress)
    else:
        agree = _compare(model, caches, toks[-1], reference, progress=progress)
    t2 = time.perf_counter()
    keys = None
    if passkey_lengths:
        keys = passkey(model, tokenizer, cache_factory, lengths=passkey_lengths,
                       depths=passkey_depths, trials=passkey_trials, seed=seed,
                       text=passkey_text, prefill_chunk=prefill_chunk, progress=progress)
    end = time.perf_counter()
    return Evaluation(perplexity=ppl, agreement=agree, passkey=keys, reference=own,
                      seconds=end - start, phase_seconds={"perplexity": t1 - t0,
                                                          "agreement": t2 - t1,
                                                          "passkey": end - t2})
