"""Speculative decoding with velox caches on SmolLM2-135M-Instruct (fp32, CPU, greedy).

For each cache (mlx-lm's plain ``KVCache`` as the baseline, then velox methods made with
``rollback=k``), a prompt is decoded without a draft and with each draft and each
``num_draft_tokens`` k, through ``mlx_lm.stream_generate``. Reported per run: generated
tokens per second (decode only: the first token's time, which includes the prefill, is left
out), the share of tokens that came from accepted drafts, and whether the tokens equal the
run without a draft (they must: greedy speculative decoding is exact, and velox caches trim
exactly within their rollback depth).

Drafts (``--drafts``):

* ``lookup``: prompt lookup, the token that followed the latest earlier occurrence of the
  last three tokens (no weights; the cheap draft of a task that repeats its prompt).
* ``layers-N``: the model's own first N decoder layers, then its final norm and tied head
  (a self-speculative draft that skips the upper layers: cheaper than the model, but on
  SmolLM2 it seldom agrees with it, so it is not run by default).
* ``biased``: the whole model with its logit of one token +100 after every even input token
  (as in docs/design/serving.md 2.3): as expensive as the model, so it shows the cost of
  verify calls and the journal rather than a speedup.

    python benchmarks/speculative.py --out docs/results/serving

speculative.json in ``--out`` holds every run (the tokens too); the table printed is the one in
docs/results/serving/speculative.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import velox  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from velox.adapters.mlxlm import make_cache
from velox.adapters.smollm2 import load_default_model

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
        "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
        "was the winter of despair, we had everything before us, we had nothing before us.")
QUESTION = "Retell this passage in your own words, in a few sentences:\n\n" + TEXT

# (label, method, parameters): None is mlx-lm's plain KVCache
CACHES = [
    ("full (KVCache)", None, {}),
    ("tova budget=64", "tova", dict(budget=64)),
    ("tova budget=64 append cap=16", "tova", dict(budget=64, decode="append", decode_cap=16)),
    ("kivi 4-bit residual=32", "kivi", dict(bits=4, residual_length=32)),
]


class LayerDraft:
    """The model's first ``n`` decoder layers, its final norm and its tied output head."""

    def __init__(self, model, n: int):
        self.model, self.n = model, n
        self.layers = model.model.layers[:n]

    def __call__(self, inputs, cache=None):
        m = self.model.model
        h = m.embed_tokens(inputs)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return m.embed_tokens.as_linear(m.norm(h))


class LookupDraft:
    """Prompt lookup: the token that followed the latest earlier occurrence of the last ``n``
    tokens seen (prompt and generated), else the one that followed the last token, else token
    0. It reads no weights; a plain ``KVCache`` of width one keeps its position, so mlx-lm's
    trims of the draft cache apply to it."""

    def __init__(self, vocab: int, n: int = 3):
        self.vocab, self.n, self.seen = vocab, n, []
        self.layers = [None]

    def _next(self) -> int:
        seen = self.seen
        for n in range(min(self.n, len(seen) - 1), 0, -1):
            tail = seen[-n:]
            for i in range(len(seen) - n - 1, -1, -1):
                if seen[i:i + n] == tail:
                    return seen[i + n]
        return 0

    def __call__(self, inputs, cache=None):
        s = inputs.shape[1]
        self.seen = self.seen[:cache[0].offset]
        cache[0].update_and_fetch(mx.zeros((1, 1, s, 1)), mx.zeros((1, 1, s, 1)))
        out = []
        for t in inputs[0].tolist():
            self.seen.append(t)
            out.append(self._next())
        return mx.where(mx.arange(self.vocab) == mx.array(out)[:, None], 1.0, 0.0)[None]


class BiasedDraft:
    """The model with its logit of ``token`` +100 after every even input token."""

    def __init__(self, model, token: int = 11):
        self.model, self.token = model, token
        self.layers = model.layers

    def __call__(self, inputs, cache=None):
        logits = self.model(inputs, cache=cache)
        bias = (inputs[..., None] % 2 == 0) & (mx.arange(logits.shape[-1]) == self.token)
        return logits + 100.0 * bias


def caches_for(model, method, params, rollback):
    if method is None:
        return [KVCache() for _ in model.layers]
    return make_cache(model, method, rollback=rollback, **params)


def run(model, tok, prompt, caches, *, tokens, step, draft=None, k=0):
    kw = {} if draft is None else dict(draft_model=draft, num_draft_tokens=k)
    out, t0, first = [], time.perf_counter(), None
    for r in stream_generate(model, tok, prompt, max_tokens=tokens, prompt_cache=caches,
                             prefill_step_size=step, **kw):
        out.append(r)
        if first is None:
            first = time.perf_counter()
    t1 = time.perf_counter()
    ids = [r.token for r in out]
    return dict(tokens=ids, from_draft=sum(r.from_draft for r in out),
                decode_tps=(len(ids) - 1) / (t1 - first), seconds=t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/serving"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--step", type=int, default=512, help="prefill_step_size (both paths)")
    ap.add_argument("--draft-layers", type=int, default=10)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--drafts", nargs="+", default=["lookup", "biased"],
                    choices=["lookup", "layers", "biased"])
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per setting (best kept)")
    args = ap.parse_args()
    model, tok = load_default_model()
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text)
    drafts = {"lookup": ("lookup", LookupDraft(model.args.vocab_size)),
              "layers": (f"layers-{args.draft_layers}", LayerDraft(model, args.draft_layers)),
              "biased": ("biased", BiasedDraft(model))}
    rows = []
    print(f"prompt {len(prompt)} tokens, max_tokens {args.tokens}, prefill_step_size {args.step}, "
          f"best of {args.repeats}")
    print(f"{'cache':30} {'draft':10} {'k':>2} {'tok/s':>7} {'x':>5} {'drafted':>8} equal")
    for label, method, params in CACHES:
        settings = [(None, None, 0)] + [(*drafts[name], k) for name in args.drafts for k in args.k]
        base = None
        for dname, draft, k in settings:
            best = None
            for _ in range(args.repeats):
                caches = caches_for(model, method, params, k)
                if draft is not None:
                    n = len(draft.layers)
                    caches = caches + [KVCache() for _ in range(n)]
                res = run(model, tok, prompt, caches, tokens=args.tokens, step=args.step,
                          draft=draft, k=k)
                if best is None or res["decode_tps"] > best["decode_tps"]:
                    best = res
            if base is None:
                base = best
            row = dict(cache=label, method=method, params=params, draft=dname, k=k,
                       decode_tps=best["decode_tps"], speedup=best["decode_tps"] / base["decode_tps"],
                       from_draft=best["from_draft"], generated=len(best["tokens"]),
                       equal=best["tokens"] == base["tokens"], tokens=best["tokens"])
            rows.append(row)
            print(f"{label:30} {dname or '-':10} {k or '-':>2} {row['decode_tps']:7.1f} "
                  f"{row['speedup']:5.2f} {row['from_draft']:3d}/{row['generated']:<4d} "
                  f"{'yes' if row['equal'] else 'NO'}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                machine=platform.machine(), cpus=os.cpu_count(), prompt_tokens=len(prompt),
                tokens=args.tokens, prefill_step_size=args.step, repeats=args.repeats,
                draft_layers=args.draft_layers, mlx=mx.__version__)
    (args.out / "speculative.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
