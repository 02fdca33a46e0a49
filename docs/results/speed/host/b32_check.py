"""Batch 32, a 4096-token prompt, Llama-3.2-1B's shape: which step each cache takes (the
kernels its compiled step launches) and its sync step time (README, "the host").

    python docs/results/speed/host/b32_check.py
"""
import sys, time, statistics
import mlx.core as mx
sys.path.insert(0, "benchmarks")
import velox.adapters.mlxlm as A
import velox.kernels.evict as ev
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.models.cache import make_prompt_cache
from decode_speed import LLAMA_1B
args = dict(LLAMA_1B); args.update(vocab_size=4096)
model = Model(ModelArgs(**args)); model.set_dtype(mx.bfloat16); mx.eval(model.parameters())
b, ctx = 32, 4096
toks = mx.random.randint(0, 4096, (b, ctx))
A.install_query_capture()
for name in ("full", "tova", "streaming_llm"):
    c = make_prompt_cache(model) if name == "full" else (A.make_cache(model, name, n_sink=4, window_size=2044) if name == "streaming_llm" else A.make_cache(model, name, budget=2048))
    for i in range(0, ctx, 2048):
        model(toks[:, i:i + 2048], cache=c); mx.eval([s for x in c for s in x.state])
    y = toks[:, -1:]
    for _ in range(3):
        y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y)
    seen = []
    real = ev._run_kernel
    ev._run_kernel = lambda variant, *a: (seen.append(variant[0]), real(variant, *a))[1]
    A._COMPILED.clear()
    y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y)
    y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y)
    ev._run_kernel = real
    ts = []
    for s in range(20):
        t = time.perf_counter(); y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y); ts.append(time.perf_counter() - t)
    print(name, "last_step", getattr(c[0], "last_step", "-"), "kernels traced", seen[:6], len(seen), f"step {1e3*statistics.median(ts):.2f} ms")
    del c
