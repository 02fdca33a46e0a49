"""The KIVI decode step's kernels beside SDPA, for ncu (see h200-kivi-step-ncu.txt):

    N=32768 ncu --clock-control none -k regex:"velox|sdpa" --metrics gpu__time_duration.sum \
        python docs/results/speed/kivi/kivi_ncu.py
"""
import os, mlx.core as mx, velox
from velox.methods import kivi
from velox.kernels import kivi as kk
n = int(os.environ.get("N", 32768)); b = int(os.environ.get("B", 1))
st = kivi.init(b, 8, 64, dtype=mx.bfloat16, bits=4)
for i in range(0, n, 4096):
    k = mx.random.normal((b, 8, 4096, 64)).astype(mx.bfloat16)
    st = kivi.update(st, k, k); mx.eval(st)
q = mx.random.normal((b, 32, 1, 64)).astype(mx.bfloat16); kn = mx.random.normal((b, 8, 1, 64)).astype(mx.bfloat16)
for _ in range(2):
    mx.eval(kk.decode_step(st, q, kn, kn, scale=0.125))
k = mx.random.normal((b, 8, n, 64)).astype(mx.bfloat16)
for _ in range(2):
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125))
