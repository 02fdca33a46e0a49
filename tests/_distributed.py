"""Ring-backend processes on localhost for the tensor-parallel tests (``tests/test_distributed.py``).

Imported by the tests (``from tests._distributed import ...``) and run as a script by each
process they start (``python tests/_distributed.py --model DIR --out DIR ...``): the script
loads the tiny llama saved by :func:`save_tiny_model`, shards it over the ring group its
environment names (``MLX_RANK``, ``MLX_HOSTFILE``; none: one process holding every head),
runs every method asked for through ``make_cache`` and greedy decoding, and feeds the same
random rows to each method's functions directly (``velox.init(..., heads=...)``), writing
what it kept to ``<out>/rank<r>.json`` and ``.npz``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import velox  # noqa: F401  (first: OpenBLAS loads before mlx.core)

import mlx.core as mx
import numpy as np

# A tiny llama: 2 layers, hidden 64, 16 query and 8 kv heads of 32 (GQA groups of 2).
CONFIG = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
              num_attention_heads=16, num_key_value_heads=8, head_dim=32, rms_norm_eps=1e-5,
              vocab_size=97, rope_theta=10000.0, tie_word_embeddings=True)
# distinct tokens: a repeated token's keys have equal norms (RoPE turns them), an exact tie
# that rounding in the sharded projections would break either way
PROMPT = [int(t) for t in np.random.default_rng(3).permutation(97)[:48]]
PREFILL_STEP = 16
TOKENS = 6  # greedy tokens a method generates
# The core check's rows: batch 2, head_dim 32, chunks of a prefill, decode steps, a chunk.
CORE_CHUNKS = (28, 1, 1, 6, 1, 1)
CORE_BATCH, CORE_DIM = 2, 32


def save_tiny_model(folder: Path, kv_heads: int = 8, seed: int = 0) -> Path:
    """A random tiny llama (weights scaled so that greedy decoding varies) in ``folder``:
    ``config.json`` and ``model.safetensors``; the same weights for a given ``seed``."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG, num_key_value_heads=kv_heads)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**config))
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def load_tiny_model(folder: Path, group=None):
    """The model :func:`save_tiny_model` wrote, sharded over ``group`` (mlx-lm's
    ``model.shard``) when it holds more than one process."""
    from mlx_lm.models import llama

    config = json.loads((Path(folder) / "config.json").read_text())
    model = llama.Model(llama.ModelArgs(**config))
    model.load_weights(str(Path(folder) / "model.safetensors"))
    if group is not None and group.size() > 1:
        model.shard(group)
    mx.eval(model.parameters())
    return model


def params_for(key: str, tokens: int) -> dict:
    """Parameters that compress ``tokens`` (capacities well below them), with the head-mixing
    choice of the methods that have one (``per_head=False``), and the spec's test choice where
    the default is a shipped fit of SmolLM2 (Palu's basis, A2ATS's and VecInfer's codebooks)."""
    from tests._helpers import small_params
    from velox.registry import get_method

    spec = get_method(key).spec
    p = small_params(key, tokens)
    if "per_head" in spec.params:
        p["per_head"] = False
    for name, param in spec.params.items():  # a shipped fit (SmolLM2's): the tests' choice
        if param.type == "choice" and param.test_choices and param.default not in param.test_choices:
            p[name] = param.test_choices[0]
    return p


def free_ports(n: int) -> list[int]:
    """``n`` distinct localhost ports free at the time of the call."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def launch_ring(n: int, argv: list[str], *, timeout: float, cwd: str | None = None,
                env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``python <argv>`` as ``n`` ring-backend processes on localhost (free ports; the
    hostfile in a temporary file) and wait at most ``timeout`` seconds for all of them; the
    processes still running then are killed and a ``TimeoutError`` names them. ``n == 1``
    runs one plain process (no group)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = dict(os.environ, **(env or {}))
        base.pop("MLX_RANK", None)
        base.pop("MLX_HOSTFILE", None)
        if n > 1:
            hostfile = Path(tmp) / "hosts.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        procs, logs = [], []
        for r in range(n):
            e = dict(base)
            if n > 1:
                e.update(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile))
            out = open(Path(tmp) / f"out{r}", "w+")
            err = open(Path(tmp) / f"err{r}", "w+")
            logs.append((out, err))
            procs.append(subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err,
                                          env=e, cwd=cwd))
        deadline = time.monotonic() + timeout
        late = []
        for r, p in enumerate(procs):
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                late.append(r)
        for r in late:
            procs[r].kill()
            procs[r].wait()
        done = []
        for r, (p, (out, err)) in enumerate(zip(procs, logs)):
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
            out.close()
            err.close()
        if late:
            tails = "\n".join(f"rank {r}: {done[r].stderr[-2000:]}" for r in late)
            raise TimeoutError(f"ranks {late} of {n} still ran after {timeout:.0f} s:\n{tails}")
        return done


# --- the worker -------------------------------------------------------------------------------

def _generate(model, key: str, n: int = TOKENS) -> dict:
    """One method through make_cache and greedy decoding: the tokens, each layer's kept
    positions and bytes, or the refusal."""
    from mlx_lm.generate import generate_step

    from velox.adapters.mlxlm import VeloxCache, make_cache

    try:
        caches = make_cache(model, key, **params_for(key, len(PROMPT)))
    except ValueError as e:
        return {"refused": str(e)}
    tokens, gaps = [], []
    for t, logprobs in generate_step(mx.array(PROMPT), model, prompt_cache=caches,
                                     max_tokens=n, prefill_step_size=PREFILL_STEP):
        top = np.sort(np.array(logprobs.astype(mx.float32)).reshape(-1))[-2:]
        tokens.append(int(t))
        gaps.append(float(top[1] - top[0]))
    layers = [c for c in caches if isinstance(c, VeloxCache)]
    return {"tokens": tokens, "gaps": gaps,
            "positions": [np.array(velox.positions(c.velox_state)).tolist() for c in layers],
            "nbytes": [int(c.nbytes) for c in layers]}


def _core_rows(heads_total: int, seed: int):
    """The rows every process draws alike: keys, values ``[b, H, s, d]`` and queries ``[b,
    2 H, s, d]`` of each chunk."""
    rng = np.random.default_rng(seed)
    out = []
    for s in CORE_CHUNKS:
        k = (0.5 * rng.standard_normal((CORE_BATCH, heads_total, s, CORE_DIM))).astype(np.float32)
        v = rng.standard_normal((CORE_BATCH, heads_total, s, CORE_DIM)).astype(np.float32)
        q = rng.standard_normal((CORE_BATCH, 2 * heads_total, s, CORE_DIM)).astype(np.float32)
        out.append((k, v, q))
    return out


def _core(key: str, heads, heads_total: int, backend: str) -> dict:
    """One method's functions fed this shard's heads of the same rows (``velox.init(...,
    heads=)``, then ``update`` with real queries): its kept positions and ``get_kv`` after
    the last update, or the refusal."""
    from velox.distributed import first_head

    h = heads_total // heads.shards
    a = first_head(heads, h)
    try:
        state = velox.init(key, CORE_BATCH, h, CORE_DIM, backend=backend, heads=heads,
                           **params_for(key, sum(CORE_CHUNKS)))
    except ValueError as e:
        return {"refused": str(e)}
    for k, v, q in _core_rows(heads_total, 7):
        state = velox.update(state, mx.array(k[:, a:a + h]), mx.array(v[:, a:a + h]),
                             queries=mx.array(q[:, 2 * a:2 * (a + h)]))
    keys, values = velox.get_kv(state)
    return {"positions": np.array(velox.positions(state)),
            "keys": np.array(keys.astype(mx.float32)), "values": np.array(values.astype(mx.float32)),
            "nbytes": int(velox.nbytes(state))}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from velox.adapters.sharding import model_heads
    from velox.registry import get_method

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--methods", required=True, help="comma-separated method keys")
    p.add_argument("--core", action="store_true",
                   help="also feed each method's functions directly (mlx; reference too where "
                        "its decisions mix heads)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="greedy tokens a method generates")
    args = p.parse_args(argv)
    group = mx.distributed.init(backend="ring", strict=True) if os.environ.get("MLX_HOSTFILE") else None
    rank = 0 if group is None else group.rank()
    model = load_tiny_model(Path(args.model), group)
    heads = model_heads(model)
    total = json.loads((Path(args.model) / "config.json").read_text())["num_key_value_heads"]
    out, arrays = {"shards": heads.shards, "shard": heads.shard, "methods": {}}, {}
    t0 = time.perf_counter()
    for key in args.methods.split(","):
        out["methods"][key] = _generate(model, key, args.tokens)
        if args.core:
            m = get_method(key)
            mixed = m.spec.heads == "mixed" and "reference" in m.backends
            for backend in ("mlx", "reference") if mixed else ("mlx",):
                got = _core(key, heads, total, backend)
                if "refused" in got:
                    out["methods"][key][f"core_{backend}_refused"] = got["refused"]
                    continue
                out["methods"][key][f"core_{backend}_nbytes"] = got.pop("nbytes")
                for name, x in got.items():
                    arrays[f"{key}|{backend}|{name}"] = x
    out["seconds"] = time.perf_counter() - t0
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(out))
    np.savez(folder / f"rank{rank}.npz", **arrays)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests._helpers, as a script
    sys.exit(main())
