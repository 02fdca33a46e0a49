"""Decode tok/s of the adapter with and without an evaluation of each layer's new state (the
"-noeval" caches patch ``mx.async_eval`` out of ``velox.adapters.mlxlm``), against mlx-lm's
full cache, interleaved; run at commit ea4c9ff, which still evaluated each layer's state:

    python docs/results/speed/split/eval_per_layer.py 32768
"""
import sys, time, types
sys.path.insert(0, "benchmarks")
import decode_speed as ds
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from velox.adapters import mlxlm
from velox.adapters.mlxlm import make_cache

real = mlxlm.mx
quiet = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
quiet.async_eval = lambda *a, **k: None

model, _ = ds.build_model("llama-1b-random", None, 0)
ctx = int(sys.argv[1])
for b in (1, 32):
    prompt = mx.random.randint(0, 128256, (b, ctx))
    caches = {}
    for name in ("full", "tova", "tova-noeval", "streaming_llm", "streaming_llm-noeval"):
        key = name.split("-")[0]
        c = (make_prompt_cache(model) if key == "full" else
             make_cache(model, key, budget=2048) if key == "tova" else make_cache(model, key, window_size=2044))
        for i in range(0, ctx, 2048):
            model(prompt[:, i:i + 2048], cache=c); mx.eval([x.state for x in c] if key == "full" else [a for x in c for a in mlxlm._arrays(x._state)])
        caches[name] = c
        mx.clear_cache()
    y = mx.zeros((b, 1), mx.int32)
    res = {n: [] for n in caches}
    for rnd in range(4):
        for name, c in caches.items():
            mlxlm.mx = quiet if name.endswith("noeval") else real
            for _ in range(3):
                out = model(y, cache=c); mx.eval(mx.argmax(out[:, -1], -1))
            t = time.perf_counter()
            for _ in range(24):
                out = model(y, cache=c); z = mx.argmax(out[:, -1], -1)[:, None]; mx.async_eval(z)
            mx.eval(z)
            dt = (time.perf_counter() - t) / 24
            if rnd: res[name].append(b / dt)
    mlxlm.mx = real
    full = sorted(res["full"])[1]
    print(f"batch {b} ctx {ctx}: " + ", ".join(f"{n} {sorted(v)[1]:.0f} tok/s ({sorted(v)[1]/full:.2f}x)" for n, v in res.items()), flush=True)
    del caches; mx.clear_cache()
