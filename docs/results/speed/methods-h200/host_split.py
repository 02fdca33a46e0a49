"""Where a pipelined decode step's time goes, per cache: ``build`` (the model call that builds
the step's graph), ``encode`` (``mx.async_eval`` of it: MLX encodes and submits the step on the
calling thread) and ``wait`` (``mx.eval`` of the previous token); medians over 63 steps, three
interleaved rounds, after 80 untimed steps past the prefill. Llama-3.2-1B-shaped random model
(bfloat16 on a GPU; on a CPU a narrow one, for a quick check). Run from the project root.
A step whose ``wait`` is near 0 is bound by the host: the device waits for the next step.
python docs/results/speed/methods-h200/host_split.py CTX BATCH "full rotating tova:slack=63 ..." [steps]"""
import sys, time, statistics, collections
import velox, velox.adapters.mlxlm as A
import mlx.core as mx
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.models.cache import make_prompt_cache, RotatingKVCache
sys.path.insert(0, "benchmarks")
from decode_speed import LLAMA_1B
ctx = int(sys.argv[1]); batch = int(sys.argv[2]); names = sys.argv[3].split()
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 64
gpu = mx.default_device() == mx.gpu
dt = mx.bfloat16 if gpu else mx.float32
mx.random.seed(0)
args = dict(LLAMA_1B)
if not gpu: args.update(hidden_size=256, intermediate_size=256, vocab_size=512)
model = Model(ModelArgs(**args)); model.set_dtype(dt); mx.eval(model.parameters())
toks = mx.random.randint(0, 512, (batch, ctx))
def caches_for(name):
    if name == "full": return make_prompt_cache(model)
    if name == "rotating": return [RotatingKVCache(max_size=2048, keep=4) for _ in range(16)]
    meth, _, rest = name.partition(":")
    p = {k: int(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)} if rest else {}
    if meth == "streaming_llm": p.setdefault("window_size", 2044)
    elif meth not in ("kivi",): p.setdefault("budget", 2048)
    return A.make_cache(model, meth, **p)
runs = []
for name in names:
    c = caches_for(name)
    for i in range(0, ctx, 2048):
        model(toks[:, i:i+2048], cache=c); mx.eval([x.state for x in c])
    y = toks[:, -1:]
    for _ in range(80):  # past the post-prefill phase
        y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y)
    runs.append((name, c, y))
res = collections.defaultdict(list)
for rnd in range(3):
    for j, (name, c, y) in enumerate(runs):
        kinds = collections.Counter()
        mx.synchronize()
        t0 = time.perf_counter()
        tb = time.perf_counter(); nxt = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); b0 = time.perf_counter() - tb
        mx.async_eval(nxt)
        B, E, W = [], [], []
        for _ in range(steps - 1):
            t1 = time.perf_counter()
            y2 = mx.argmax(model(nxt, cache=c)[:, -1:], axis=-1)
            t2 = time.perf_counter(); mx.async_eval(y2)
            t3 = time.perf_counter(); mx.eval(nxt)
            t4 = time.perf_counter()
            B.append(t2 - t1); E.append(t3 - t2); W.append(t4 - t3)
            kinds[getattr(c[0], "last_step", "-")] += 1
            y, nxt = nxt, y2
        mx.eval(nxt); mx.synchronize()
        tot = (time.perf_counter() - t0) / steps
        runs[j] = (name, c, nxt)
        res[name].append((tot, statistics.median(B), statistics.median(E), statistics.median(W), dict(kinds)))
full = statistics.median(r[0] for r in res[names[0]])
for name in names:
    r = res[name]; med = lambda i: statistics.median(x[i] for x in r)
    print(f"ctx {ctx} b{batch} {name:26s} step {1e3*med(0):6.2f} ms  build {1e3*med(1):5.2f}  encode {1e3*med(2):5.2f}  wait {1e3*med(3):5.2f}  x{names[0]} {full/med(0):4.2f}  {r[-1][4]}", flush=True)
