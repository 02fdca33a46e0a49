"""Perplexity of SmolLM2 with tova@256 and knorm@256 at several slack values (token by token).

    python docs/results/slots/perplexity_slack.py docs/results/slots/ppl.json
"""
import json, sys
from velox.adapters import harness
from velox.adapters.mlxlm import make_cache
from velox.adapters.smollm2 import load_default_model
model, tok = load_default_model(progress=False)
tokens = harness.text_tokens(tok, harness.load_text("holmes"), 1024 + 192)
out = {}
for key in ("tova", "knorm"):
    for slack in (0, 16, 64):
        p = harness.perplexity(model, tokens, lambda: make_cache(model, key, budget=256, slack=slack),
                               prefix=1024, chunk=1, prefill_chunk=1024)
        out[f"{key} slack={slack}"] = round(p.ppl, 3)
        print(key, slack, round(p.ppl, 3), round(p.seconds, 1), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
