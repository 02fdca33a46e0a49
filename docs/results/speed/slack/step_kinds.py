"""Median time to build and to evaluate a decode step, by the kind of step the first layer's
cache took (mlx-lm's full cache: "mlx"; velox: "fused", "fill", "deferred"), for mlx-lm's
full cache, TOVA at slack 0 and TOVA at slack 63; sync loop, steps 70 to 149 after the prompt.

    python docs/results/speed/slack/step_kinds.py MODEL BATCH CONTEXT BUDGET
"""
import sys, time
import velox  # noqa: F401
import mlx.core as mx
sys.path.insert(0, "benchmarks")
from decode_speed import build_model
from velox.adapters.mlxlm import make_cache, install_query_capture
from mlx_lm.models.cache import make_prompt_cache

name = sys.argv[1] if len(sys.argv) > 1 else "tiny-random"
b = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
budget = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
model, info = build_model(name, None, 0)
install_query_capture()
prompt = mx.random.randint(0, 1000, (b, ctx))
for label, kw in (("full", None), ("tova", dict(budget=budget)), ("tova s63", dict(budget=budget, slack=63))):
    caches = make_prompt_cache(model) if kw is None else make_cache(model, "tova", **kw)
    for i in range(0, ctx - 1, 2048):
        model(prompt[:, i:min(i + 2048, ctx - 1)], cache=caches)
        mx.eval([c.state for c in caches] if kw is None else [c.velox_state for c in caches])
    y = prompt[:, -1:]
    times = {}
    for t in range(150):
        t0 = time.perf_counter()
        logits = model(y, cache=caches)
        y = mx.argmax(logits[:, -1:], axis=-1)
        t1 = time.perf_counter()
        mx.eval(y)
        dt = (t1 - t0, time.perf_counter() - t1)
        kind = getattr(caches[0], "last_step", "mlx")
        if t >= 70:
            times.setdefault(kind, []).append(dt)
    med = lambda v: round(1e3 * sorted(v)[len(v) // 2], 3)
    print(label, {k: (len(v), "build", med([x[0] for x in v]), "eval", med([x[1] for x in v])) for k, v in times.items()}, flush=True)
