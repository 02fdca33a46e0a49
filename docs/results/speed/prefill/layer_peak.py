"""Prefill peak of one Llama-3.2-1B-shaped attention layer (random weights, float32, small MLP
and vocabulary) for mlx-lm's full cache or a velox method at budget 2048:

    python docs/results/speed/prefill/layer_peak.py full|METHOD CONTEXT [LAYERS]

prefills CONTEXT random tokens in chunks of 2048 and prints MLX's peak memory above what was
live before the prefill, the memory live after it, and the time.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
import velox  # noqa: E402,F401  (OpenBLAS before mlx)
import velox.adapters.mlxlm as A  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.models.llama import Model, ModelArgs  # noqa: E402
from decode_speed import LLAMA_1B  # noqa: E402

name, ctx = sys.argv[1], int(sys.argv[2])
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 1
mx.random.seed(0)
args = dict(LLAMA_1B, intermediate_size=256, vocab_size=512, num_hidden_layers=layers)
model = Model(ModelArgs(**args))
mx.eval(model.parameters())
toks = mx.random.randint(0, 512, (1, ctx))
cache = make_prompt_cache(model) if name == "full" else A.make_cache(model, name, budget=2048)
mx.synchronize()
base = mx.get_active_memory()
mx.reset_peak_memory()
t0 = time.perf_counter()
for i in range(0, ctx, 2048):
    model(toks[:, i:i + 2048], cache=cache)
    mx.eval([c.state for c in cache])
dt = time.perf_counter() - t0
print(f"{name:10s} context {ctx} layers {layers}: peak above live {(mx.get_peak_memory() - base) / 2**20:8.1f} MiB, "
      f"live after {(mx.get_active_memory() - base) / 2**20:7.1f} MiB, {dt:.1f} s", flush=True)
