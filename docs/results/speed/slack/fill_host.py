"""Host time to build one layer's decode step (update + attention, not evaluated), median us:
mlx-lm's KVCache (update_and_fetch + SDPA) against a velox TOVA cache in deferred mode with
slack 0 (the compiled fused step) and slack 63 (fill steps between selections; the growing
steps before the first selection show as "deferred"). One layer of Llama-3.2-1B's attention
(8 kv / 32 query heads, head_dim 64), a 2000-token prompt, budget 512, float32, on whatever
device MLX defaults to. Three rounds; each entry is (steps, median us).

    python docs/results/speed/slack/fill_host.py
"""
import time
import velox  # noqa: F401  (first: OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from velox.adapters import mlxlm as A

b, h, hq, d, budget = 1, 8, 32, 64, 512
rng = np.random.default_rng(0)
def arr(*s):
    return mx.array(rng.standard_normal(s).astype(np.float32))
q, k, v = arr(b, hq, 1, d), arr(b, h, 1, d), arr(b, h, 1, d)
A.install_query_capture()

def velox_cache(slack):
    c = A.VeloxCache("tova", dict(budget=budget, slack=slack), mode="deferred")
    pk, pv = arr(b, h, 2000, d), arr(b, h, 2000, d)
    c.update_and_fetch(pk, pv); c.attention(arr(b, hq, 2000, d), pk, pv, scale=d ** -0.5, mask="causal")
    mx.eval(c.velox_state)
    return c

def run_velox(c, n):
    ts = {}
    for i in range(n):
        t0 = time.perf_counter()
        kk, vv = c.update_and_fetch(k, v)
        o = c.attention(q, kk, vv, scale=d ** -0.5, mask=None)
        ts.setdefault(c.last_step, []).append(time.perf_counter() - t0)
        mx.eval(o)
    return {kind: (len(x), round(1e6 * float(np.median(x)), 1)) for kind, x in ts.items()}

def run_kv(n):
    c = KVCache()
    c.update_and_fetch(arr(b, h, 2000, d), arr(b, h, 2000, d)); mx.eval(c.keys)
    t = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        kk, vv = c.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=d ** -0.5)
        t += time.perf_counter() - t0
        mx.eval(o)
    return round(t / n * 1e6, 1)

c0, c1 = velox_cache(0), velox_cache(63)
for _ in range(3):
    print("kvcache", run_kv(200), "| tova fused", run_velox(c0, 200), "| tova s63", run_velox(c1, 200))
