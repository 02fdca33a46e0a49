"""Decode tok/s at 32k prompts, batch 1 and 32: mlx-lm's full cache against TOVA, H2O and
StreamingLLM at budget 2048, interleaved rounds of 24 steps (the first round a warm-up),
with each round's ratio to the full cache. A short form of benchmarks/decode_speed.py for
a GPU session with little time left:

    python docs/results/speed/split/decode_32k.py
"""
import sys, time
sys.path.insert(0, "benchmarks")
import decode_speed as ds
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from velox.adapters import mlxlm
from velox.adapters.mlxlm import make_cache

model, _ = ds.build_model("llama-1b-random", None, 0)
ctx = 32768
for b in (1, 32):
    prompt = mx.random.randint(0, 128256, (b, ctx))
    caches = {}
    for name in ("full", "tova", "h2o", "streaming_llm"):
        c = (make_prompt_cache(model) if name == "full" else
             make_cache(model, name, window_size=2044) if name == "streaming_llm" else make_cache(model, name, budget=2048))
        t = time.perf_counter()
        for i in range(0, ctx, 2048):
            model(prompt[:, i:i + 2048], cache=c); mx.eval([x.state for x in c])
        caches[name] = c
        mx.clear_cache()
    y = mx.zeros((b, 1), mx.int32)
    res = {n: [] for n in caches}
    for rnd in range(5):
        for name, c in caches.items():
            for _ in range(3):
                out = model(y, cache=c); mx.eval(mx.argmax(out[:, -1], -1))
            t = time.perf_counter()
            for _ in range(24):
                out = model(y, cache=c); z = mx.argmax(out[:, -1], -1)[:, None]; mx.async_eval(z)
            mx.eval(z)
            if rnd: res[name].append(b * 24 / (time.perf_counter() - t))
    med = {n: sorted(v)[len(v) // 2] for n, v in res.items()}
    print(f"batch {b} ctx {ctx} (tok/s, median of 4 rounds; per-round ratio to full):", flush=True)
    for n, v in res.items():
        print(f"  {n:14s} {med[n]:8.0f}  {med[n] / med['full']:.2f}x  rounds " + " ".join(f"{x / f:.2f}" for x, f in zip(v, res['full'])), flush=True)
    del caches; mx.clear_cache()
