"""Decode tokens/s of compressed caches against mlx-lm's full KVCache and RotatingKVCache.

For every (batch, context) pair: a prompt of random token ids (fixed seed) is prefilled into
each cache the way mlx-lm's ``generate`` prefills (chunks of ``--chunk`` tokens, the cache
states evaluated after each chunk; the prompt minus its last token), then ``--steps`` greedy
single-token decode steps run with every cache in interleaved blocks: round robin over the
caches, ``--reps`` blocks each, the starting cache rotating from one round to the next, one
untimed warm-up step per block, after ``--warmup-rounds`` untimed rounds. tok/s is ``batch *
steps / time`` of a block (median over the blocks); ``x full`` is its ratio to the full
cache's median, and ``x full per round`` the median (and range) of the ratios of each block to
the full cache's block of the same round (robust to a drift of the machine's speed).

Caches: mlx-lm's ``KVCache`` (full) and ``RotatingKVCache(max_size=budget, keep=4)``, always;
then every velox method of ``--methods`` through ``make_cache`` (budgeted methods keep
``--budget`` tokens, sinks included; ``kivi`` runs at ``bits=4``; ``--param key=value`` or
``--param method.key=value`` override; ``--methods tova tova:slack=16`` measures two
configurations of one method side by side).

Memory, attributed to one cache from MLX's allocator counters around its own work (nothing
else allocates meanwhile): ``prefill peak`` is ``mx.get_peak_memory()`` during its prefill
less the live memory before it (its states plus the prefill's activations); ``live`` is its
bytes before and after its decode blocks (flat for a bounded cache); ``decode peak`` is its
live bytes plus the largest transient of one of its blocks. ``KV bytes`` is what the cache
holds after decoding: velox caches report their ``nbytes``, the mlx-lm caches the bytes of
the tokens their arrays hold (``alloc`` adds KVCache's preallocated slack).

Bandwidth limit: the tok/s the device would reach if a step only read the weights (the
embedding table once, as the tied or separate output layer reads it) and the cache's KV
bytes once: ``batch * bandwidth / (weight bytes + KV bytes)``; ``of limit`` is the measured
fraction of it. ``--bandwidth`` defaults to 3.2e12 B/s on a GPU (an H200's measured copy
bandwidth). Two bandwidths are measured and printed on any device: the copy bandwidth of a
large array (read + written bytes over the time of ``y = x + 1``) and the bytes a
matrix-vector product reads per second; on a CPU the larger of the two is used (MLX's
elementwise copy runs on one thread there, the BLAS product on all of them).

Memory residency (``--resident``): ``all`` keeps every cache prefilled at once (the round
robin above); ``one`` keeps the full cache resident and prefills the other caches one at a
time, each decoded in blocks alternating with the full cache's (full, X, full, X, ...), its
ratio taken against the full cache's blocks of that same session, and then freed; ``auto``
picks ``one`` when an estimate of every cache together exceeds 70% of the device memory.

    python benchmarks/decode_speed.py --model llama-1b-random --batch 1 8 32 --context 8192 32768
    python benchmarks/decode_speed.py --model smollm2 --batch 1 4 --context 1024 2048 --budget 256

Models: ``llama-1b-random`` (Llama-3.2-1B's shape, random weights from ``--seed``: 16
layers, hidden 2048, 32 query / 8 kv heads, head_dim 64, MLP 8192, vocabulary 128256,
bfloat16 by default on a GPU), ``smollm2`` (the embedded SmolLM2-135M-Instruct, float32),
``tiny-random`` (2 layers, hidden 64, for tests). Prints a markdown table; ``--json`` is
rewritten after every cache, so an interrupted run leaves what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import velox  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from velox.adapters import model_step
from velox.adapters.cli import budget_params, parse_param
from velox.adapters.mlxlm import VeloxCache, make_cache
from velox.registry import get_method

FULL, ROTATING = "full", "rotating"
KEEP = 4  # RotatingKVCache's kept leading tokens (velox methods' default sinks)
GPU_BANDWIDTH = 3.2e12

LLAMA_1B = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                tie_word_embeddings=True,
                rope_scaling=dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0,
                                  low_freq_factor=1.0, original_max_position_embeddings=8192))
TINY = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
            vocab_size=256, rope_theta=10000.0, tie_word_embeddings=True)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def build_model(name: str, dtype: str | None, seed: int):
    """``(model, description)``; random models are drawn from ``seed``."""
    if name == "smollm2":
        from velox.adapters.smollm2 import load_default_model
        model, _ = load_default_model(progress=False)
        if dtype not in (None, "float32"):
            model.set_dtype(DTYPES[dtype])
        label = "SmolLM2-135M-Instruct (embedded GGUF)"
    elif name in ("llama-1b-random", "tiny-random"):
        from mlx_lm.models.llama import Model, ModelArgs
        mx.random.seed(seed)
        model = Model(ModelArgs(**(LLAMA_1B if name == "llama-1b-random" else TINY)))
        want = dtype or ("bfloat16" if on_gpu() and name == "llama-1b-random" else "float32")
        model.set_dtype(DTYPES[want])
        label = ("Llama-3.2-1B-shaped, random weights" if name == "llama-1b-random"
                 else "tiny Llama, random weights") + f" (seed {seed})"
    else:
        raise ValueError(f"unknown model {name!r}")
    mx.eval(model.parameters())
    return model, label


def model_shape(model) -> dict[str, Any]:
    a = model.args
    params = dict(tree_flatten(model.parameters()))
    dtypes = sorted({str(v.dtype).split(".")[-1] for v in params.values()})
    total = sum(v.nbytes for v in params.values())
    read = total
    if any("lm_head" in k for k in params):  # a separate output layer: a step reads b rows of the table
        read -= sum(v.nbytes for k, v in params.items() if "embed_tokens" in k)
    return dict(layers=a.num_hidden_layers, hidden=a.hidden_size, heads=a.num_attention_heads,
                kv_heads=a.num_key_value_heads,
                head_dim=a.head_dim or a.hidden_size // a.num_attention_heads,
                intermediate=a.intermediate_size, vocab=a.vocab_size, dtype="/".join(dtypes),
                param_bytes=int(total), weight_read_bytes=int(read),
                params=int(sum(v.size for v in params.values())))


def copy_bandwidth(mib: int) -> float:
    """Bytes/s of ``y = x + 1`` on a ``mib`` MiB float32 array (read + written bytes)."""
    x = mx.random.uniform(shape=(mib * 2**18,))
    mx.eval(x)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        mx.eval(x + 1)
        times.append(time.perf_counter() - t0)
    del x
    return 2 * mib * 2**20 / statistics.median(times[1:])


def gemv_bandwidth(mib: int) -> float:
    """Bytes/s a matrix-vector product reads (a ``mib`` MiB float32 matrix, once per call)."""
    w = mx.random.uniform(shape=(mib * 2**8, 1024))
    v = mx.random.uniform(shape=(1024,))
    mx.eval(w, v)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        mx.eval(w @ v)
        times.append(time.perf_counter() - t0)
    del w
    return mib * 2**20 / statistics.median(times[1:])


# --- caches ---------------------------------------------------------------------------

def method_params(methods: list[str], params: list[str]) -> dict[str, dict[str, Any]]:
    """The parameters given to each ``--methods`` entry: the unscoped ``--param key=value``
    its method's spec takes, then ``--param method.key=value``, then the entry's own
    ``method:key=value,...``."""
    common: dict[str, Any] = {}
    scoped: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for text in params:
        key, value = parse_param(text)
        method, dot, name = key.partition(".")
        if dot:
            if method not in scoped:
                raise ValueError(f"--param {text!r} names {method!r}, which is not measured")
            scoped[method][name] = value
        else:
            common[key] = value
    out = {}
    for entry in methods:  # "tova:slack=16,n_sink=4": the method with its own parameters
        m, colon, rest = entry.partition(":")
        spec = get_method(m).spec
        given = {k: v for k, v in common.items() if k in spec.params}
        given.update(scoped[entry])
        if colon:
            given.update(dict(parse_param(t) for t in rest.split(",")))
        out[entry] = given
    return out


def cache_configs(methods: list[str], budget: int, params: list[str]) -> list[tuple[str, str, dict]]:
    """``(label, method, parameters)``: full, rotating, then each velox method."""
    out = [(FULL, FULL, {}), (ROTATING, ROTATING, dict(max_size=budget, keep=KEEP))]
    for entry, given in method_params(methods, params).items():
        m = entry.partition(":")[0]
        if m == "kivi":
            given.setdefault("bits", 4)
        p = dict(given)
        if "budget" not in given:
            p.update(budget_params(m, budget, given) or {})
        label = m + "".join(f" {k}={v}" for k, v in given.items())
        out.append((label, m, p))
    labels = [l for l, _, _ in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--methods measures one configuration twice: {labels}")
    return out


def new_caches(model, method: str, params: dict) -> list:
    if method == FULL:
        caches = make_prompt_cache(model)
        assert all(type(c) is KVCache for c in caches)
        return caches
    if method == ROTATING:
        return [RotatingKVCache(**params) for _ in make_prompt_cache(model)]
    return make_cache(model, method, **params)


def kv_bytes(caches: list) -> tuple[int, int]:
    """(bytes of the tokens held, bytes of the arrays allocated)."""
    held = alloc = 0
    for c in caches:
        if isinstance(c, VeloxCache):
            held += c.nbytes
            alloc += c.nbytes
        elif c.keys is not None:
            n = c.keys.shape[2] if type(c) is RotatingKVCache else c.offset
            for x in (c.keys, c.values):
                b, h, _, d = x.shape
                held += b * h * n * d * x.dtype.size
            alloc += c.nbytes
    return int(held), int(alloc)


def full_formula(tokens: int, batch: int, shape: dict, itemsize: int) -> int:
    """Bytes of a full cache holding ``tokens`` tokens: keys and values of every layer."""
    return 2 * shape["layers"] * batch * shape["kv_heads"] * tokens * shape["head_dim"] * itemsize


def stored_tokens(caches: list) -> int:
    c = caches[0]
    return int(c.size())


def backend_of(caches: list) -> str:
    c = caches[0]
    if isinstance(c, VeloxCache) and c.velox_state is not None:
        return str(getattr(c.velox_state, "backend", "?"))
    return "mlx-lm"


# --- prefill and decode -----------------------------------------------------------------

def prefill(model, tokens: mx.array, caches: list, chunk: int) -> None:
    """mlx-lm's generate prefill: chunks, the cache states evaluated after each (no logits)."""
    for i in range(0, tokens.shape[1], chunk):
        model(tokens[:, i:i + chunk], cache=caches)
        mx.eval([c.state for c in caches])


def decode_block(model, caches: list, y: mx.array, steps: int,
                 loop: str = "sync") -> tuple[float, mx.array]:
    """One untimed warm-up step, then ``steps`` greedy steps; (seconds, last tokens).

    ``loop="sync"`` evaluates each step before building the next; ``"pipelined"`` runs them
    as mlx-lm's ``generate_step`` does: the next step's graph is built and queued
    (``mx.async_eval``) before the current token is waited for, so the host's graph building
    overlaps the device's work."""
    y = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
    mx.eval(y)
    mx.synchronize()
    t0 = time.perf_counter()
    if loop == "pipelined":
        nxt = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
        mx.async_eval(nxt)
        for _ in range(steps - 1):
            y, nxt = nxt, mx.argmax(model(nxt, cache=caches)[:, -1:], axis=-1)
            mx.async_eval(nxt)
            mx.eval(y)  # the token a caller would read now
        y = nxt
        mx.eval(y)
    else:
        for _ in range(steps):
            y = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
            mx.eval(y)
    mx.synchronize()
    return time.perf_counter() - t0, y


class Run:
    """One cache configuration at one (batch, context): its caches and its measurements."""

    def __init__(self, label: str, method: str, params: dict):
        self.label, self.method, self.params = label, method, params
        self.caches: list | None = None
        self.y: mx.array | None = None
        self.gen = None  # --loop generate: this cache's generate_step generator
        self.times: list[float] = []
        # the full cache's block of the same round (resident="all") or pair ("one")
        self.full_times: list[float] = []
        self.paired = False  # resident="one": measured in a session of its own with the full cache
        self.row: dict[str, Any] = dict(cache=label, method=method, params=params,
                                        kind="mlx-lm" if method in (FULL, ROTATING) else "velox")
        self.live = 0  # bytes attributed to this cache now
        self.decode_peak = 0
        self.live_before_decode: int | None = None
        self.finished: dict | None = None  # resident="one": its row, once measured and freed
        self.steps = {"compiled": 0, "layer_by_layer": 0}  # velox single-token calls, by path

    def prefill(self, model, tokens: mx.array, chunk: int) -> None:
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        self.caches = new_caches(model, self.method, self.params)
        prefill(model, tokens[:, :-1], self.caches, chunk)
        mx.synchronize()
        self.row["prefill_s"] = time.perf_counter() - t0
        self.row["prefill_peak_bytes"] = int(mx.get_peak_memory() - before)
        self.live = int(mx.get_active_memory() - before)
        self.row["live_after_prefill_bytes"] = self.live
        self.row["backend"] = backend_of(self.caches)
        self.y = tokens[:, -1:]

    def block(self, model, steps: int, loop: str, timed: bool = True) -> float:
        before = mx.get_active_memory()
        if self.live_before_decode is None:
            self.live_before_decode = self.live
        mx.reset_peak_memory()
        counted = model_step.decode_steps(model)
        if loop == "generate":
            dt = self.generate_block(model, steps)
        else:
            dt, self.y = decode_block(model, self.caches, self.y, steps, loop)
        for k, v in model_step.decode_steps(model).items():
            self.steps[k] += v - counted[k]
        self.decode_peak = max(self.decode_peak, self.live + int(mx.get_peak_memory() - before))
        self.live += int(mx.get_active_memory() - before)
        if timed:
            self.times.append(dt)
        return dt

    def generate_block(self, model, steps: int) -> float:
        """``steps`` tokens of mlx-lm's own ``generate_step`` (greedy), after one untimed:
        the loop ``mlx_lm.generate`` runs, one generator per cache kept across its blocks
        (its first call takes the prompt's last token)."""
        if self.gen is None:
            self.gen = generate_step(self.y[0], model, prompt_cache=self.caches, max_tokens=-1)
        next(self.gen)
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            next(self.gen)
        mx.synchronize()
        return time.perf_counter() - t0

    def free(self) -> None:
        self.caches = self.y = self.gen = None
        gc.collect()
        mx.clear_cache()


def finish_row(run: Run, batch: int, context: int, steps: int, full_tok_s: float | None,
               shape: dict, bandwidth: float) -> dict:
    r = run.row
    rates = [batch * steps / t for t in run.times]
    r.update(batch=batch, context=context, steps=steps, blocks=len(rates))
    if not rates:
        return r
    r["tok_s"] = statistics.median(rates)
    r["tok_s_blocks"] = rates
    if run.paired:  # against the full cache's blocks of its own session
        full_tok_s = statistics.median(batch * steps / t for t in run.full_times)
        r["full_tok_s_paired"] = full_tok_s
    r["x_full"] = r["tok_s"] / full_tok_s if full_tok_s else None
    if run.method == FULL:
        r["x_full_rounds"] = [1.0] * len(rates)
    elif run.full_times:  # block by block against the full cache's block of the same round
        r["x_full_rounds"] = [f / t for t, f in zip(run.times, run.full_times)]
    if r.get("x_full_rounds"):
        r["x_full_round_median"] = statistics.median(r["x_full_rounds"])
    held, alloc = kv_bytes(run.caches)
    r["kv_bytes"], r["kv_alloc_bytes"] = held, alloc
    r["stored_tokens"] = stored_tokens(run.caches)
    r["tokens_seen"] = int(run.caches[0].offset)
    r["decode_live_before_bytes"] = run.live_before_decode
    r["decode_live_after_bytes"] = run.live
    r["decode_peak_bytes"] = run.decode_peak
    r["decode_steps"] = dict(run.steps)
    r["bw_limit_tok_s"] = batch * bandwidth / (shape["weight_read_bytes"] + held)
    r["of_limit"] = r["tok_s"] / r["bw_limit_tok_s"]
    return r


def estimate_bytes(configs, batch: int, context: int, budget: int, shape: dict, itemsize: int,
                   chunk: int) -> int:
    """A rough bound on every cache prefilled at once, plus the largest prefill transient."""
    total = shape["param_bytes"]
    for _, method, _p in configs:
        if method == FULL:
            total += full_formula(context, batch, shape, itemsize)
        elif method == "kivi":
            total += full_formula(context, batch, shape, itemsize) // 3
        else:
            total += full_formula(min(context, 2 * budget), batch, shape, itemsize)
    c = min(chunk, context)
    act = batch * c * (12 * shape["hidden"] + 4 * shape["intermediate"]) * 4
    # a velox chunk's float32 attention weights over stored + new (scoring methods)
    scores = batch * shape["heads"] * c * (c + 2 * budget) * 4
    return int(total + act + scores)


def device_memory() -> int:
    info = mx.device_info()
    return int(info.get("memory_size") or mx.get_memory_limit())


# --- output ---------------------------------------------------------------------------

def mib(x) -> str:
    if x is None:
        return "-"
    m = x / 2**20
    return f"{m:.1f}" if abs(m) >= 10 else f"{m:.2f}"


def rounds(r: dict) -> str:
    q = r.get("x_full_rounds")
    if not q:
        return "-"
    return f"{statistics.median(q):.2f} ({min(q):.2f}-{max(q):.2f})"


def step_kind(r: dict) -> str:
    """How the timed single-token steps ran: ``compiled`` (the whole model's compiled step),
    ``layers`` (layer by layer), both with the count of each, or ``-`` (mlx-lm's caches)."""
    n = r.get("decode_steps") or {}
    c, lb = n.get("compiled", 0), n.get("layer_by_layer", 0)
    if not c and not lb:
        return "-"
    if not lb:
        return "compiled"
    return "layers" if not c else f"compiled {c}, layers {lb}"


def table(rows: list[dict]) -> str:
    out = ["| batch | context | cache | backend | step | stored | KV MiB | tok/s | x full | x full per round "
           "| BW-limit tok/s "
           "| of limit | prefill s | prefill peak MiB | decode peak MiB | live MiB before -> after |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "tok_s" not in r:
            out.append(f"| {r['batch']} | {r['context']} | {r['cache']} | - | - | - | - | "
                       f"{r.get('error', 'not measured')} | - | - | - | - | - | - | - | - |")
            continue
        out.append(
            f"| {r['batch']} | {r['context']} | {r['cache']} | {r.get('backend', '-')} | {step_kind(r)} "
            f"| {r['stored_tokens']} | {mib(r['kv_bytes'])} | {r['tok_s']:.1f} "
            f"| {'-' if r['x_full'] is None else format(r['x_full'], '.2f')} | {rounds(r)} | {r['bw_limit_tok_s']:.0f} | {r['of_limit']:.2f} "
            f"| {r['prefill_s']:.2f} | {mib(r['prefill_peak_bytes'])} | {mib(r['decode_peak_bytes'])} "
            f"| {mib(r['decode_live_before_bytes'])} -> {mib(r['decode_live_after_bytes'])} |")
    return "\n".join(out)


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def measure(model, shape, configs, batch, context, args, bandwidth, emit) -> list[dict]:
    """Every cache at one (batch, context); ``emit(rows)`` after each cache."""
    key = mx.random.key(args.seed + 1000 * batch + context)
    tokens = mx.random.randint(0, shape["vocab"], (batch, context), key=key).astype(mx.int32)
    mx.eval(tokens)
    itemsize = DTYPES[shape["dtype"]].size if shape["dtype"] in DTYPES else 4
    resident = args.resident
    if resident == "auto":
        need = estimate_bytes(configs, batch, context, args.budget, shape, itemsize, args.chunk)
        resident = "one" if need > 0.7 * device_memory() else "all"
        say(f"  estimate {need / 2**30:.1f} GiB of {device_memory() / 2**30:.1f} GiB: "
            f"resident={resident}")
    runs = [Run(*c) for c in configs]
    full = runs[0]
    rows: list[dict] = []

    def prefill_one(run: Run) -> bool:
        try:
            run.prefill(model, tokens, args.chunk)
            say(f"  prefilled {run.label}: {run.row['prefill_s']:.2f} s, peak "
                f"{mib(run.row['prefill_peak_bytes'])} MiB, backend {run.row['backend']}")
            return True
        except Exception as e:  # a cache this device cannot hold or run: recorded, skipped
            run.row["error"] = f"{type(e).__name__}: {e}"[:300]
            say(f"  {run.label}: {run.row['error']}")
            run.free()
            return False

    def rows_now() -> list[dict]:
        full_rate = (statistics.median(batch * args.steps / t for t in full.times)
                     if full.times else None)
        out = []
        for r in runs:
            if r.finished is not None:
                out.append(r.finished)
            elif r.caches is not None:
                out.append(finish_row(r, batch, context, args.steps, full_rate, shape, bandwidth))
            else:
                out.append({**r.row, "batch": batch, "context": context})
        return out

    if not prefill_one(full):
        return rows_now()
    if resident == "all":
        live = [full] + [r for r in runs[1:] if prefill_one(r)]
        emit(rows_now())
        for _ in range(args.warmup_rounds):
            for run in live:
                run.block(model, args.steps, args.loop, timed=False)
        for rep in range(args.reps):
            k = rep % len(live)
            for run in live[k:] + live[:k]:
                run.block(model, args.steps, args.loop)
            for run in live[1:]:
                run.full_times.append(full.times[-1])
            say(f"  round {rep + 1}/{args.reps}: " + ", ".join(
                f"{r.label} {batch * args.steps / r.times[-1]:.1f}" for r in live))
            emit(rows_now())
    else:
        for run in runs[1:]:
            if not prefill_one(run):
                continue
            run.paired = True
            for _ in range(args.warmup_rounds):
                for r in (full, run):
                    r.block(model, args.steps, args.loop, timed=False)
            for rep in range(args.reps):
                for r in ((full, run) if rep % 2 == 0 else (run, full)):
                    r.block(model, args.steps, args.loop)
                run.full_times.append(full.times[-1])
            row = finish_row(run, batch, context, args.steps, None, shape, bandwidth)
            say(f"  {run.label}: {row['tok_s']:.1f} tok/s, paired full "
                f"{row['full_tok_s_paired']:.1f}: x{row['x_full']:.2f}")
            run.finished = row
            run.free()
            emit(rows_now())
    rows = rows_now()
    for r in runs:
        r.free()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-1b-random", choices=["llama-1b-random", "smollm2", "tiny-random"])
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 for llama-1b-random "
                    "on a GPU, else float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--methods", nargs="*", default=["tova", "h2o", "streaming_llm", "snapkv", "kivi"])
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="a velox parameter (method.key=value for one method)")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per block")
    ap.add_argument("--loop", choices=["sync", "pipelined", "generate"], default="sync",
                    help="sync: each step evaluated before the next is built; pipelined: as "
                         "mlx-lm's generate_step, the next step queued before the current token "
                         "is read (host work overlaps the device's); generate: mlx-lm's "
                         "generate_step itself (batch 1), what mlx_lm.generate users run")
    ap.add_argument("--reps", type=int, default=5, help="blocks per cache")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="untimed blocks per cache before the timed rounds")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (mlx-lm's default)")
    ap.add_argument("--bandwidth", type=float, help="bytes/s for the limit (default: 3.2e12 on "
                    "a GPU, the measured copy bandwidth on a CPU)")
    ap.add_argument("--resident", choices=["auto", "all", "one"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new (batch, context) after this many seconds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.loop == "generate" and args.batch != [1]:
        ap.error("--loop generate runs mlx-lm's generate_step, which decodes batch 1: --batch 1")
    if args.steps < 1 or args.reps < 1 or args.chunk < 1 or args.warmup_rounds < 0:
        ap.error("--steps, --reps and --chunk must be at least 1, --warmup-rounds at least 0")

    t_start = time.perf_counter()
    model, label = build_model(args.model, args.dtype, args.seed)
    shape = model_shape(model)
    configs = cache_configs(args.methods, args.budget, args.param)
    measured_bw = copy_bandwidth(1024 if on_gpu() else 256)
    read_bw = gemv_bandwidth(1024 if on_gpu() else 256)
    # on a CPU the larger measurement: a limit must bound what a step's BLAS reads reach
    bandwidth = args.bandwidth or (GPU_BANDWIDTH if on_gpu() else max(measured_bw, read_bw))
    info = mx.device_info()
    meta = dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command="python benchmarks/decode_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        device=str(mx.default_device()), device_name=info.get("device_name"),
        device_memory=device_memory(), mlx=mx.__version__,
        mlx_lm=__import__("mlx_lm").__version__, python=platform.python_version(),
        machine=platform.machine(), model=args.model, model_label=label, shape=shape,
        budget=args.budget, steps=args.steps, reps=args.reps, chunk=args.chunk,
        warmup_rounds=args.warmup_rounds, loop=args.loop,
        resident=args.resident, seed=args.seed, bandwidth=bandwidth,
        bandwidth_source="--bandwidth" if args.bandwidth else (
            "H200 default" if on_gpu() else "measured: max of copy and gemv read"),
        measured_copy_bandwidth=measured_bw, measured_gemv_read_bandwidth=read_bw,
        configs=[dict(label=l, method=m, params=p) for l, m, p in configs])
    header = (f"{label} on {meta['device']} ({meta['device_name']}), MLX {mx.__version__}, "
              f"mlx-lm {meta['mlx_lm']}, {shape['dtype']}: {shape['layers']} layers, hidden "
              f"{shape['hidden']}, {shape['heads']} query / {shape['kv_heads']} kv heads, head_dim "
              f"{shape['head_dim']}, {shape['params'] / 1e6:.1f} M parameters "
              f"({shape['weight_read_bytes'] / 2**20:.0f} MiB read per step)\n"
              f"budget {args.budget}, {args.steps} steps x {args.reps} blocks per cache ({args.loop} "
              f"decode loop), prefill "
              f"chunk {args.chunk}; bandwidth {bandwidth / 1e9:.0f} GB/s ({meta['bandwidth_source']}; "
              f"measured: copy {measured_bw / 1e9:.1f} GB/s, gemv read {read_bw / 1e9:.1f} GB/s)")
    say(header)
    done: list[dict] = []

    def emit(rows: list[dict]) -> None:
        if args.json:
            meta["wall_s"] = time.perf_counter() - t_start
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(dict(meta=meta, rows=done + rows), indent=1))

    for batch in args.batch:
        for context in args.context:
            if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
                say(f"batch {batch}, context {context}: skipped (--max-seconds)")
                continue
            say(f"batch {batch}, context {context}:")
            rows = measure(model, shape, configs, batch, context, args, bandwidth, emit)
            done.extend(rows)
            emit([])
    print(header)
    print()
    print(table(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
