"""Single ops on the GPU at batch 32 (8 kv / 32 query heads, head_dim 64, bfloat16, 2112-row
buffers), each evaluated and synchronized alone: the ways to write one row into a cache
buffer, and mlx.fast.scaled_dot_product_attention over 2100 rows as a contiguous array, a
prefix view of a 2112-row buffer and of a 2304-row one (a multiple of 256); us per op.

    python docs/results/speed/slack/micro.py
"""
import time
import velox  # noqa
import mlx.core as mx
from velox import evict

def t(f, n=50):
    f(); mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    mx.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n

b, h, N, d = 32, 8, 2112, 64
dt = mx.bfloat16
x = mx.random.normal((b, h, 1, d)).astype(dt)
st = {"a": mx.zeros((b, h, N, d), dt)}
mx.eval(st["a"], x)
start = mx.array([0, 0, 2000, 0])
def dyn():
    st["a"] = mx.slice_update(st["a"], x, start, axes=(0, 1, 2, 3)); mx.eval(st["a"])
def stat():
    a = st["a"]; a[:, :, 2000:2001, :] = x; st["a"] = a; mx.eval(st["a"])
def wslot():
    st["a"] = evict.write_slot(st["a"], x, 2000); mx.eval(st["a"])
slot = mx.full((b, h, 1), 2000, mx.int32)
def scat():
    st["a"] = evict.write_slot(st["a"], x, slot); mx.eval(st["a"])
def copy():
    st["a"] = st["a"] + 0; mx.eval(st["a"])
for name, f in (("dynamic slice_update", dyn), ("static setitem", stat), ("write_slot int", wslot),
                ("write_slot scatter", scat), ("full copy (a+0)", copy)):
    print(f"{name}: {t(f):.1f} us", flush=True)
q = mx.random.normal((b, 32, 1, d)).astype(dt)
k = mx.random.normal((b, h, N, d)).astype(dt); v = mx.random.normal((b, h, N, d)).astype(dt)
kc = mx.contiguous(k[:, :, :2100]); vc = mx.contiguous(v[:, :, :2100]); mx.eval(q, k, v, kc, vc)
sd = lambda kk, vv: mx.eval(mx.fast.scaled_dot_product_attention(q, kk, vv, scale=0.125))
print(f"sdpa contiguous 2100: {t(lambda: sd(kc, vc)):.1f} us")
print(f"sdpa prefix view 2100 of {N}: {t(lambda: sd(k[:, :, :2100], v[:, :, :2100])):.1f} us")
print(f"sdpa full {N}: {t(lambda: sd(k, v)):.1f} us")
N2 = 2304  # a multiple of 256: MLX's cuDNN decode path for slices of such a buffer
k2 = mx.random.normal((b, h, N2, d)).astype(dt); v2 = mx.random.normal((b, h, N2, d)).astype(dt); mx.eval(k2, v2)
print(f"sdpa prefix view 2100 of {N2}: {t(lambda: sd(k2[:, :, :2100], v2[:, :, :2100])):.1f} us")
for bb in (1,):
    q1 = q[:1]; k1 = k[:1]; v1 = v[:1]; k21 = mx.contiguous(k2[:1]); v21 = mx.contiguous(v2[:1]); mx.eval(k21, v21)
    s1 = lambda kk, vv: mx.eval(mx.fast.scaled_dot_product_attention(q1, kk, vv, scale=0.125))
    print(f"b1 sdpa prefix 2100 of {N}: {t(lambda: s1(k1[:, :, :2100], v1[:, :, :2100])):.1f} us; of {N2}: {t(lambda: s1(k21[:, :, :2100], v21[:, :, :2100])):.1f} us")
