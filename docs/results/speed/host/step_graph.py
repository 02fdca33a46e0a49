"""What a decode step's graph holds and what it costs, beside a minimal compiled ring.

    python docs/results/speed/host/step_graph.py CONTEXT "full probe rotating streaming_llm tova tova:mlxb=1 ..."

The Llama-3.2-1B-shaped random model of ``benchmarks/decode_speed.py`` (bfloat16 on a GPU; on a
CPU float32, 4 layers, a small MLP and vocabulary), prefilled with CONTEXT random tokens into
each cache: mlx-lm's ``KVCache`` (``full``) and ``RotatingKVCache(2048)`` (``rotating``), velox
methods through ``make_cache`` (budget 2048; ``:mlxb=1`` the ``mlx`` backend), and ``probe``: a
ring of 2,048 slots written by ``mx.slice_update`` at an index computed from the offset, the
whole model's step compiled once (the least a bounded cache's step can be). For each cache it
prints the primitives of one decode step's graph by kind (``mx.export_to_dot``; "non-view" leaves
out reshapes, broadcasts and the like, which launch nothing), then the step's time in a
pipelined loop as ``generate_step`` runs it (the model call, ``async_eval`` of the next token,
reading the previous one), split into the host's build and ``async_eval``, interleaved over
three rounds, and ``mlx_lm.generate.generate_step`` itself. JSON under ``$OUT`` (default /tmp).
"""
import sys, io, re, time, statistics, collections, json, os
sys.path.insert(0, "benchmarks")
import velox  # noqa: F401  (OpenBLAS before mlx)
import velox.adapters.mlxlm as A
import mlx.core as mx
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.models.cache import make_prompt_cache, RotatingKVCache
from mlx_lm.generate import generate_step
from decode_speed import LLAMA_1B
OUT = os.environ.get("OUT", "/tmp")
ctx = int(sys.argv[1]); names = sys.argv[2].split()
gpu = mx.default_device() == mx.gpu
dt = mx.bfloat16 if gpu else mx.float32
mx.random.seed(0)
args = dict(LLAMA_1B)
if not gpu: args.update(intermediate_size=256, vocab_size=512, num_hidden_layers=4)
model = Model(ModelArgs(**args)); model.set_dtype(dt); mx.eval(model.parameters())
L = len(model.layers)
toks = mx.random.randint(0, 512, (1, ctx))
W = 2048

class RingShell:
    def __init__(self, k, v, off): self.k, self.v, self._off = k, v, off
    @property
    def offset(self): return self._off
    def update_and_fetch(self, k, v):
        slot = 4 + (self._off - 4) % (W - 4)
        self.k = mx.slice_update(self.k, k, slot.reshape(1), axes=(2,))
        self.v = mx.slice_update(self.v, v, slot.reshape(1), axes=(2,))
        return self.k, self.v
    def make_mask(self, *a, **k): return None

class Probe:
    """A ring of W slots stepped by one compiled whole-model function."""
    def __init__(self):
        self.fn = mx.compile(self._step)
    def _step(self, tok, off, ks, vs):
        sh = [RingShell(k, v, off) for k, v in zip(ks, vs)]
        logits = model(tok, cache=sh)
        return logits, [s.k for s in sh], [s.v for s in sh]
    def prefill(self):
        c = [RotatingKVCache(max_size=W, keep=4) for _ in range(L)]
        for i in range(0, ctx - 1, 2048):
            model(toks[:, i:min(i + 2048, ctx - 1)], cache=c); mx.eval([x.state for x in c])
        # the ring's layout: sinks in slots 0-3, position p >= 4 in slot 4 + (p - 4) % (W - 4);
        # mlx-lm's rotating cache holds them in temporal order after a prefill (timing only:
        # which rows sit where does not change the step's cost)
        self.ks, self.vs = [], []
        for x in c:
            k, v = x.keys[..., :W, :], x.values[..., :W, :]
            n = x.offset
            idx = mx.array([4 + (p - 4) % (W - 4) for p in range(n - (W - 4), n)])
            kk, vv = mx.zeros_like(k), mx.zeros_like(v)
            kk[..., :4, :], vv[..., :4, :] = k[..., :4, :], v[..., :4, :]
            kk[..., idx, :], vv[..., idx, :] = k[..., 4:W, :], v[..., 4:W, :]
            self.ks.append(kk)
            self.vs.append(vv)
        mx.eval(self.ks, self.vs)
        self.off = ctx - 1
    def __call__(self, tok):
        logits, self.ks, self.vs = self.fn(tok, mx.array(self.off, dtype=mx.int32), self.ks, self.vs)
        self.off += 1
        return logits

def caches_for(name):
    if name == "full": return make_prompt_cache(model)
    if name == "rotating": return [RotatingKVCache(max_size=W, keep=4) for _ in range(L)]
    meth, _, rest = name.partition(":")
    p = {k: int(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)} if rest else {}
    bk = "mlx" if p.pop("mlxb", None) else "auto"
    if meth == "streaming_llm": p.setdefault("window_size", W - 4)
    else: p.setdefault("budget", W)
    return A.make_cache(model, meth, backend=bk, **p)

runs = {}
for name in names:
    if name == "probe":
        pr = Probe(); pr.prefill(); runs[name] = pr; continue
    c = caches_for(name)
    for i in range(0, ctx - 1, 2048):
        model(toks[:, i:min(i + 2048, ctx - 1)], cache=c); mx.eval([x.state for x in c])
    runs[name] = c
print("prefilled", flush=True)

def call(name, y):
    r = runs[name]
    return r(y) if name == "probe" else model(y, cache=r)

# graph node counts of one step (lazy), per kind
report = {}
for name in names:
    y = toks[:, -1:]
    for s in range(3):
        y = mx.argmax(call(name, y)[:, -1:], axis=-1); mx.eval(y)
    out = call(name, y)
    f = io.StringIO(); mx.export_to_dot(f, out); txt = f.getvalue()
    nodes = re.findall(r'label ="([A-Za-z_0-9]+)', txt) or re.findall(r'label\s*=\s*"([^"]+)"', txt)
    cnt = collections.Counter(nodes)
    mx.eval(out)
    views = {"Broadcast", "Reshape", "Transpose", "ExpandDims", "Squeeze", "Flatten", "Unflatten", "Slice", "Depends", "AsStrided", "View"}
    kern = sum(v for k, v in cnt.items() if k not in views and not k.startswith("Parameter"))
    report[name] = dict(nodes=sum(cnt.values()), nonview=kern, kinds=dict(cnt.most_common()))
    print(f"{name:20s} nodes {sum(cnt.values())} non-view {kern} last={getattr(runs[name][0], 'last_step', '-') if name != 'probe' else 'probe'}", flush=True)
    print("    ", dict(cnt.most_common(50)), flush=True)

# timing: pipelined loop as generate_step (model call, argmax, async_eval next, item previous), interleaved
def block(name, steps=64):
    y = toks[:, -1:]
    y = mx.argmax(call(name, y)[:, -1:], axis=-1); mx.eval(y)
    builds = []; encs = []
    t0 = time.perf_counter()
    for s in range(steps):
        tb = time.perf_counter()
        ny = mx.argmax(call(name, y)[:, -1:], axis=-1)
        te = time.perf_counter()
        mx.async_eval(ny)
        tw = time.perf_counter()
        builds.append(te - tb); encs.append(tw - te)
        y.item() if s else None
        y = ny
    y.item(); mx.synchronize()
    return (time.perf_counter() - t0) / steps, statistics.median(builds), statistics.median(encs)

res = collections.defaultdict(list)
for rnd in range(3):
    for name in names:
        res[name].append(block(name))
full = statistics.median(t for t, _, _ in res[names[0]])
for name in names:
    t = statistics.median(x[0] for x in res[name]); b = statistics.median(x[1] for x in res[name]); e = statistics.median(x[2] for x in res[name])
    report[name].update(step_ms=1e3 * t, build_ms=1e3 * b, encode_ms=1e3 * e, x_first=full / t)
    print(f"{name:20s} step {1e3*t:6.3f} ms  build {1e3*b:6.3f}  async_eval {1e3*e:6.3f}  x{names[0]} {full/t:5.2f}", flush=True)

# generate_step itself for the mlx-lm-protocol caches
for rnd in range(2):
    for name in names:
        if name == "probe": continue
        n = 64; t0 = time.perf_counter()
        for i, (tok, _) in zip(range(n), generate_step(toks[0, -1:], model, prompt_cache=runs[name], max_tokens=n)):
            pass
        dtm = (time.perf_counter() - t0) / n
        report[name].setdefault("generate_step_ms", []).append(1e3 * dtm)
        print(f"generate_step {name:20s} {1e3*dtm:6.3f} ms/token", flush=True)
json.dump(report, open(f"{OUT}/prof_a.json", "w"), indent=1)
