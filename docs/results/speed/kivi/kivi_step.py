"""KIVI's decode step on a GPU: whole-model steps and per-layer pieces.

    CTX=32768 python docs/results/speed/kivi/kivi_step.py

A: the Llama-3.2-1B-shaped random model of benchmarks/decode_speed.py, batch B (1), a CTX-token
prompt, 16 decode steps x 3 interleaved rounds per cache: mlx-lm's full cache, KIVI (bits 4)
through attend_update (the decode kernels' two launches), and KIVI as attend then update
("kivi-old": the attention kernels, then the MLX update); median step time and host build
time. B: per layer (16 layers' worth per evaluation), the pieces on a KIVI state of that
context beside SDPA over CTX bfloat16 rows. Run at the commits named in
docs/results/speed/README.md ("KIVI's decode step").
"""
import sys, time, statistics, os
import velox, velox.adapters.mlxlm as A
import mlx.core as mx
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.models.cache import make_prompt_cache
sys.path.insert(0, "benchmarks")
from decode_speed import LLAMA_1B
from velox.methods import kivi
from velox.kernels import kivi as kk, codec as ck
ctx = int(os.environ.get("CTX", 8192)); batch = int(os.environ.get("B", 1))
dt = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
mx.random.seed(0)
args = dict(LLAMA_1B)
if dt == mx.float32: args.update(intermediate_size=256, vocab_size=512)
model = Model(ModelArgs(**args)); model.set_dtype(dt); mx.eval(model.parameters())
toks = mx.random.randint(0, 512, (batch, ctx))
def caches_for(name):
    if name == "full": return make_prompt_cache(model)
    meth, _, rest = name.partition(":")
    meth = meth.replace("-old", "")
    p = dict(kv.split("=") for kv in rest.split(",") if kv)
    p = {k: (int(v) if v.isdigit() else v) for k, v in p.items()}
    return A.make_cache(model, meth, **p)
names = os.environ.get("NAMES", "full kivi:bits=4 kivi-old:bits=4").split()
M = kivi.method
new_au = M.attend_update
def old_au(s, q, k, v, *, scale, mask=None):
    return M.attend(s, q, k, v, scale=scale, mask=mask), M.update(s, k, v, queries=q)
runs = []
for name in names:
    c = caches_for(name)
    for i in range(0, ctx, 2048):
        model(toks[:, i:i+2048], cache=c); mx.eval([x.state for x in c])
    runs.append((name, c))
res = {}
for rnd in range(3):
    for name, c in runs:
        M.attend_update = old_au if "old" in name else new_au
        y = toks[:, -1:]
        y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1); mx.eval(y); mx.synchronize()
        builds = []; t0 = time.perf_counter()
        for s in range(16):
            tb = time.perf_counter()
            y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1)
            builds.append(time.perf_counter() - tb)
            mx.eval(y)
        mx.synchronize(); tot = (time.perf_counter() - t0) / 16
        res.setdefault(name, []).append((tot, statistics.median(builds)))
M.attend_update = new_au
for name in names:
    tot = statistics.median(t for t, _ in res[name]); b = statistics.median(b for _, b in res[name])
    print(f"A ctx {ctx} b {batch} {name:36s} step {1e3*tot:7.2f} ms host {1e3*b:6.2f} ms x {statistics.median(t for t,_ in res[names[0]])/tot:.2f}", flush=True)
# per-layer pieces on a kivi state of this context
st = runs[1][1][0].velox_state
print("state", st.key_codes.shape, st.residual_keys.shape, st.residual_keys.dtype, st.key_scales.dtype, flush=True)
H, G, D = 8, 4, 64
q = mx.random.normal((batch, H * G, 1, D)).astype(dt); kn = mx.random.normal((batch, H, 1, D)).astype(dt); vn = kn + 1
mx.eval(q, kn, vn)
def per_layer(fn, reps=20):
    for _ in range(3): mx.eval(fn())
    r = []
    for _ in range(5):
        mx.synchronize(); t = time.perf_counter()
        for _ in range(reps): mx.eval(fn())
        mx.synchronize(); r.append((time.perf_counter() - t) / reps / 16 * 1e6)
    return statistics.median(r)
def host(fn, reps=20):
    r = []
    for _ in range(reps):
        t = time.perf_counter(); o = fn(); r.append((time.perf_counter() - t) / 16 * 1e6); mx.eval(o)
    return statistics.median(r)
sts = [runs[1][1][i].velox_state for i in range(16)]
Kf = [mx.random.normal((batch, H, ctx, D)).astype(dt) for _ in range(4)]; mx.eval(Kf)
pieces = {
  "kivi attend (kernels)": lambda: [kivi.attend(s, q, kn, vn, scale=0.125) for s in sts],
  "kivi update": lambda: [kivi.update(s, kn, vn) for s in sts],
  "attend_update (new)": lambda: [new_au(s, q, kn, vn, scale=0.125) for s in sts],
  "attend then update (old)": lambda: [old_au(s, q, kn, vn, scale=0.125) for s in sts],
  "kivi attend+update": lambda: [(kivi.attend(s, q, kn, vn, scale=0.125), kivi.update(s, kn, vn)) for s in sts],
  "_params only": lambda: [ck._params(64, 0, 0.125) for s in sts],
  "sdpa full ctx": lambda: [mx.fast.scaled_dot_product_attention(q, Kf[i % 4], Kf[(i + 1) % 4], scale=0.125) for i in range(16)],
  "trivial op": lambda: [q + 1 for _ in range(16)],
}
for rnd in range(2):
    for k, fn in pieces.items():
        print(f"B r{rnd} {k:28s} gpu+host {per_layer(fn):8.1f} us/layer  host-build {host(fn):7.1f} us/layer", flush=True)
