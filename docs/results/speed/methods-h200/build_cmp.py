"""Graph-building time of a decode step (the model call, before any evaluation) per cache,
interleaved in one process (8 rounds of 20 steps each): a narrow 16-layer Llama with
Llama-3.2-1B's attention shapes, 2200-token prompt, budget 2048, on the CPU.

    python docs/results/speed/methods-h200/build_cmp.py "full rotating tova:slack=63"
"""
import sys, time, statistics, gc
import velox, velox.adapters.mlxlm as A
import mlx.core as mx
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.models.cache import make_prompt_cache, RotatingKVCache
sys.path.insert(0, "benchmarks")
from decode_speed import LLAMA_1B
args = dict(LLAMA_1B); args.update(hidden_size=128, intermediate_size=128, vocab_size=512, num_attention_heads=8, num_key_value_heads=2)
mx.random.seed(0)
model = Model(ModelArgs(**args)); mx.eval(model.parameters())
ctx = 2200; toks = mx.random.randint(0, 512, (1, ctx))
names = sys.argv[1].split(); budget = 2048
def caches_for(name):
    if name == "full": return make_prompt_cache(model)
    if name == "rotating": return [RotatingKVCache(max_size=budget, keep=4) for _ in range(16)]
    meth, _, rest = name.partition(":")
    p = {k: int(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)} if rest else {}
    if meth == "streaming_llm": p.setdefault("window_size", budget - 4)
    else: p.setdefault("budget", budget)
    return A.make_cache(model, meth, **p)
runs = []
for name in names:
    c = caches_for(name)
    for i in range(0, ctx, 2048):
        model(toks[:, i:i+2048], cache=c); mx.eval([x.state for x in c])
    y = toks[:, -1:]
    for _ in range(80):
        y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y)
    runs.append([name, c, y])
res = {n: [] for n in names}
gc.disable()
for rnd in range(8):
    for r in runs:
        name, c, y = r
        for _ in range(20):
            t = time.perf_counter(); y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); res[name].append(time.perf_counter() - t); mx.eval(y)
        r[2] = y
full = statistics.median(res[names[0]])
for n in names:
    m = statistics.median(res[n]); print(f"{n:26s} build {1e3*m:5.2f} ms  x{names[0]} {m/full:4.2f}  last {getattr(runs[names.index(n)][1][0], 'last_step', '-')}")
