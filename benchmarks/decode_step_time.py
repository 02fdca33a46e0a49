"""Per-step decode time and host (graph-building) time of whole-model decode steps.

    python benchmarks/decode_step_time.py CONTEXT BATCH "full rotating tova h2o:noasync=1 ..."

Builds the Llama-3.2-1B-shaped random model of ``decode_speed.py`` (bfloat16 on a GPU; on a
CPU float32 with a small MLP and vocabulary, for a quick check only), prefills ``CONTEXT``
random tokens into each cache (chunks of 2048), then times 16 greedy decode steps per cache
in three interleaved rounds: ``step`` is the median wall time of a step (evaluated),
``host-build`` the median time of building its graph (the model call before ``mx.eval``).
Caches: ``full`` (mlx-lm's KVCache), ``rotating`` (RotatingKVCache(2048, keep 4)) and velox
methods through ``make_cache`` at budget 2048 (streaming_llm: window 2044), with
``method:key=value,...`` parameters; the flags ``noasync=1`` (``mx.async_eval`` a no-op
while that cache runs: the adapter's evaluations of prefill and append-mode states and
mlx-lm's own; a decode step's state is evaluated with the step's logits in any case),
``nocompile=1`` (``compile=False``) and ``mlxb=1`` (the ``mlx`` backend instead of ``auto``)
change how the adapter runs, not the method.
"""
import sys, time, statistics
import velox, velox.adapters.mlxlm as A
import mlx.core as mx
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.models.cache import make_prompt_cache, RotatingKVCache
sys.path.insert(0, "benchmarks")
from decode_speed import LLAMA_1B
ctx = int(sys.argv[1]); batch = int(sys.argv[2]); names = sys.argv[3].split()
dt = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
mx.random.seed(0)
args = dict(LLAMA_1B)
if dt == mx.float32: args.update(intermediate_size=256, vocab_size=512)
model = Model(ModelArgs(**args)); model.set_dtype(dt); mx.eval(model.parameters())
toks = mx.random.randint(0, 512, (batch, ctx))
real_async = mx.async_eval
def caches_for(name):
    if name == "full": return make_prompt_cache(model)
    if name == "rotating": return [RotatingKVCache(max_size=2048, keep=4) for _ in range(16)]
    meth, _, rest = name.partition(":")
    p = {k: int(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)} if rest else {}
    p.pop("noasync", None); p.pop("nocompile", None); bk = "mlx" if p.pop("mlxb", None) else "auto"
    if meth == "streaming_llm": p.setdefault("window_size", 2044)
    else: p.setdefault("budget", 2048)
    return A.make_cache(model, meth, backend=bk, compile="nocompile" not in name, **p)
results = {}
runs = []
for name in names:
    c = caches_for(name)
    for i in range(0, ctx, 2048):
        model(toks[:, i:i+2048], cache=c); mx.eval([x.state for x in c])
    runs.append((name, c))
for rnd in range(3):
    for name, c in runs:
        mx.async_eval = (lambda *a, **k: None) if "noasync" in name else real_async
        y = toks[:, -1:]
        y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y); mx.synchronize()
        builds = []; t0 = time.perf_counter()
        for s in range(16):
            tb = time.perf_counter()
            y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1)
            builds.append(time.perf_counter() - tb)
            mx.eval(y)
        mx.synchronize(); tot = (time.perf_counter() - t0) / 16
        results.setdefault(name, []).append((tot, statistics.median(builds)))
mx.async_eval = real_async
full = statistics.median(t for t, _ in results[names[0]])
for name in names:
    tot = statistics.median(t for t, _ in results[name]); b = statistics.median(b for _, b in results[name])
    print(f"ctx {ctx} batch {batch} {name:28s} step {1e3*tot:7.2f} ms  host-build {1e3*b:6.2f} ms  x{names[0]} {full/tot:5.2f}  last={getattr(runs[names.index(name)][1][0],'last_step','-')}", flush=True)
