"""GPU: the adapter's fill step with the attend kernel against MLX's attention over the
filled prefix: greedy tokens and logits of a small random Llama with tova/streaming_llm
slack caches (cuda backend), kernel vs no kernel, each fill step's kernel output against MLX's
attention over the same rows, and two runs without the kernel; plus attend vs sdpa at a few
shapes. The logits' 1e-4 check holds with MLX_ENABLE_TF32=0: with TF32 matmuls (MLX's CUDA
default) a 4e-7 change in an attention output can flip the rounding of a matmul input to
TF32's 10-bit mantissa, and the logits then differ by ~3e-4 of their largest.

    python docs/results/speed/fill-kernel/fill_check.py
    MLX_ENABLE_TF32=0 python docs/results/speed/fill-kernel/fill_check.py"""
import sys

import velox  # noqa: F401
import mlx.core as mx
import numpy as np
from mlx_lm.models.llama import Model, ModelArgs

from velox.adapters import mlxlm as A
from velox.kernels import evict as ev
from velox.registry import get_method

sys.path.insert(0, "benchmarks")
from decode_speed import LLAMA_1B  # noqa: E402

bad = 0
for b, h, g, d, n, rows, dt in [(1, 8, 4, 64, 2112, 2080, mx.bfloat16), (32, 8, 4, 64, 2112, 2048, mx.bfloat16),
                                (2, 2, 10, 128, 700, 650, mx.float32), (3, 3, 3, 64, 300, 0, mx.float16),
                                (4, 2, 2, 256, 513, 513, mx.float32), (2, 3, 3, 64, 9000, 8999, mx.float32)]:
    mx.random.seed(b * 7 + n)
    q, kn, vn = (mx.random.normal(s).astype(dt) for s in ((b, h * g, 1, d), (b, h, 1, d), (b, h, 1, d)))
    garbage = mx.arange(n)[None, None, :, None] >= rows
    k, v = (mx.where(garbage, mx.nan, mx.random.normal((b, h, n, d))).astype(dt) for _ in range(2))
    out = ev.attend(q, k, v, kn, vn, rows=rows)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k[:, :, :rows], kn], 2),
                                                mx.concatenate([v[:, :, :rows], vn], 2), scale=d ** -0.5)
    err = mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item()
    tol = 2e-5 if dt == mx.float32 else 2e-2
    ok = err <= tol and out.dtype == dt
    bad += not ok
    print(f"attend b{b} h{h} g{g} d{d} n{n} rows{rows} {dt}: max err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)

args = dict(LLAMA_1B)
args.update(vocab_size=512, num_hidden_layers=4)
model = Model(ModelArgs(**args))
model.set_dtype(mx.float32)
mx.eval(model.parameters())
A.install_query_capture()
prompt = mx.random.randint(0, 512, (2, 300))
from velox import evict  # noqa: E402

step_err = []


def checked(saved):
    """fill_attention, each call's output compared with MLX's attention over the filled rows."""
    def f(held, new, q, k, v, scale):
        out = saved(held, new, q, k, v, scale)
        ks, vs = evict.filled_rows(new.keys, new.values, new.empty)
        want = mx.fast.scaled_dot_product_attention(q, ks, vs, scale=scale)
        step_err.append((mx.abs(out - want).max() / mx.abs(want).max()).item())
        return out
    return f


for method, params in (("tova", dict(budget=200, slack=31)), ("streaming_llm", dict(n_sink=4, window_size=196, slack=31))):
    runs = {}
    for kernel in (True, False, "again"):
        be = get_method(method).backends["cuda"]
        saved = be.fill_attention
        be.fill_attention = checked(saved) if kernel is True else lambda *a: None
        try:
            c = A.make_cache(model, method, backend="cuda", **params)
            logits = model(prompt, cache=c)[:, -1:]
            y = mx.argmax(logits, -1)
            toks, lg, kinds = [], [], {}
            for _ in range(70):
                logits = model(y, cache=c)[:, -1:]
                y = mx.argmax(logits, -1)
                mx.eval(y, logits)
                toks.append(np.array(y))
                lg.append(np.array(logits))
                kinds[c[0].last_step] = kinds.get(c[0].last_step, 0) + 1
        finally:
            be.fill_attention = saved
        runs[kernel] = (np.concatenate(toks, 1), np.concatenate(lg, 1), kinds)
    again = np.abs(runs["again"][1] - runs[False][1]).max() / np.abs(runs[False][1]).max()
    print(f"{method}: {len(step_err)} fill attentions, max relative error {max(step_err):.2e}; "
          f"two runs without the kernel differ by {again:.2e} of max |logit|", flush=True)
    bad += max(step_err) > 1e-5
    step_err.clear()
    same = (runs[True][0] == runs[False][0]).mean()
    err = np.abs(runs[True][1] - runs[False][1]).max() / np.abs(runs[False][1]).max()
    ok = same == 1.0 and err < 1e-4 and runs[True][2].get("fill", 0) > 0
    bad += not ok
    print(f"{method} {params}: steps {runs[True][2]}, tokens equal {same:.3f}, max logit diff / max |logit| {err:.2e} "
          f"{'ok' if ok else 'FAIL'}", flush=True)
print("FAILURES" if bad else "all ok", bad)
