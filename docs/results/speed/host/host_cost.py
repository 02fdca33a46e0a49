"""Host cost on the GPU machine (README, "the host"): the per-launch cost of an
``mx.fast.cuda_kernel`` by the size of its source (a trivial kernel padded with a comment), a
trivial op and SDPA for reference; then a model step (Llama-3.2-1B's shape, vocabulary 4096,
batch 1, a 4096-token prompt) per cache: the Python build, the evaluation and the whole step,
and a profile of the build.

    python docs/results/speed/host/host_cost.py full rotating tova streaming_llm h2o kivi
"""
import sys, time, statistics, os, cProfile, pstats, io
import mlx.core as mx
sys.path.insert(0, "benchmarks")

def med(f, reps=20):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)

x = mx.zeros((256,), mx.float32); mx.eval(x)
print("== A: per-call host cost (us) of 64 chained launches")
for pad in ((0, 4000, 16000, 64000) if mx.default_device() == mx.gpu else ()):
    k = mx.fast.cuda_kernel(name=f"probe{pad}", input_names=["x"], output_names=["y"],
                            source="y[threadIdx.x] = x[threadIdx.x] + 1.0f;\n//" + "a" * pad)
    def build():
        y = x
        for _ in range(64):
            y = k(inputs=[y], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(256,)],
                  output_dtypes=[mx.float32])[0]
        return y
    ys = build(); mx.eval(ys); mx.synchronize()
    b = med(build)
    def both():
        mx.eval(build()); mx.synchronize()
    t = med(both)
    print(f"pad {pad:6d}: build {1e6*b/64:6.2f} us/call, build+eval+sync {1e6*t/64:6.2f} us/launch")
def build_add():
    y = x
    for _ in range(64):
        y = y + 1.0
    return y
print(f"add: build {1e6*med(build_add)/64:6.2f}, all {1e6*med(lambda: (mx.eval(build_add()), mx.synchronize()))/64:6.2f}")
q = mx.zeros((1, 32, 1, 64), mx.bfloat16); kk = mx.zeros((1, 8, 2048, 64), mx.bfloat16); mx.eval(q, kk)
def build_sdpa():
    y = q
    for _ in range(64):
        y = mx.fast.scaled_dot_product_attention(y, kk, kk, scale=0.125)
    return y
if mx.default_device() == mx.gpu: print(f"sdpa: build {1e6*med(build_sdpa)/64:6.2f}, all {1e6*med(lambda: (mx.eval(build_sdpa()), mx.synchronize()))/64:6.2f}")

print("== B: model step host cost")
import velox.adapters.mlxlm as A
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.models.cache import make_prompt_cache, RotatingKVCache
from decode_speed import LLAMA_1B
args = dict(LLAMA_1B); args.update(vocab_size=4096)
model = Model(ModelArgs(**args)); model.set_dtype(mx.bfloat16); mx.eval(model.parameters())
ctx = int(os.environ.get("CTX", "4096"))
toks = mx.random.randint(0, 4096, (1, ctx))
A.install_query_capture()
def mk(name):
    if name == "full": return make_prompt_cache(model)
    if name == "rotating": return [RotatingKVCache(max_size=2048, keep=4) for _ in model.layers]
    if name == "kivi": return A.make_cache(model, "kivi", bits=4)
    if name == "streaming_llm": return A.make_cache(model, name, n_sink=4, window_size=2044)
    return A.make_cache(model, name, budget=2048)
caches = {}
for name in sys.argv[1:]:
    c = mk(name)
    for i in range(0, ctx, 2048):
        model(toks[:, i:i + 2048], cache=c); mx.eval([s for x in c for s in x.state])
    caches[name] = [c, toks[:, -1:]]
    print(name, "prefilled", flush=True)
res = {n: ([], [], []) for n in caches}
for rnd in range(4):
    for name, cy in caches.items():
        c, y = cy
        for s in range(12):
            t0 = time.perf_counter()
            out = model(y, cache=c)
            y = mx.argmax(out[:, -1:], axis=-1)
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            mx.synchronize()
            t3 = time.perf_counter()
            if s >= 2:
                res[name][0].append(t1 - t0); res[name][1].append(t2 - t1); res[name][2].append(t3 - t0)
        cy[1] = y
for name, (b, e, t) in res.items():
    print(f"{name:14s} build {1e3*statistics.median(b):6.3f} ms  eval {1e3*statistics.median(e):6.3f} ms  step {1e3*statistics.median(t):6.3f} ms  ({1/statistics.median(t):6.1f} tok/s)  last_step={getattr(caches[name][0][0],'last_step','-')}")
for name, cy in caches.items():
    c, y = cy
    pr = cProfile.Profile(); pr.enable()
    for _ in range(5):
        y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y)
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print("---", name); print("\n".join(s.getvalue().splitlines()[4:32]))
