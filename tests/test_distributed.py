"""velox caches on tensor-parallel models (``mx.distributed``, mlx-lm's ``model.shard``).

Default run: the record and its reductions (``velox.distributed``: a group of one is the
local operation itself), the refusals (a method whose state cannot be split by heads, heads
that do not divide among the processes) on a model sharded over a stand-in group (no process
started), and one smoke run of two ring-backend processes on localhost (TOVA, a few tokens).

Marked ``distributed`` (``pytest --run-distributed -m distributed tests/test_distributed.py``):
every registered method on a tiny random llama (2 layers, hidden 64, 16 query and 8 kv
heads, fixed seed, weights shared through a temporary folder) sharded over 2 and over 4
ring processes, against one process holding every head:

* the core check (exact): each method's functions fed the same rows, each process its heads
  (``velox.init(..., heads=)``), keep exactly the positions, keys and values of the one
  process's state for those heads (``mlx``; ``reference`` too where decisions mix heads);
* the model (``make_cache`` on the sharded model, greedy decoding): every process produces
  the same tokens; a selection shared by a layer's heads is the same on every process; the
  tokens and each process's kept positions are those of the one process. A sharded model
  does not compute bit for bit what one process computes (its ``o_proj`` and ``down_proj``
  sum the processes' partial products, ``all_sum``), so a method whose spec says its codes
  follow the BLAS's rounding (``contract.blas_codes``: a prefill-fitted eigenbasis, a code at
  a cell boundary goes either way) is held to the processes' agreement and the exact core
  check there;
* a method whose spec says ``heads = "unshardable"`` is refused by ``make_cache`` and by its
  ``init`` with an error naming it;
* ``velox generate`` and ``velox serve`` under ``mlx.launch``: the text of one process.

Every process is started with a deadline and killed past it; ports are chosen free.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import velox
from tests._distributed import (CONFIG, PROMPT, free_ports, launch_ring, params_for,
                                save_tiny_model)
from velox.distributed import (LOCAL, Comm, Heads, check_heads, head_gather, head_max, head_sum,
                               heads_of, host_max)
from velox.registry import get_method, method_keys

WORKER = str(Path(__file__).with_name("_distributed.py"))
KEYS = method_keys()
TIMEOUT = 900  # seconds a run of every method may take (4 processes on a loaded 2-core CPU)


class FakeGroup:
    """A stand-in ``mx.distributed.Group`` of ``n`` processes (this one ``rank``): enough for
    mlx-lm's ``model.shard`` and velox's reading of it; no collective can run over it."""

    def __init__(self, n: int, rank: int = 0):
        self.n, self.r = n, rank

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


# --- the record and its reductions -------------------------------------------------------

def test_one_process_reduces_locally_and_bit_for_bit():
    x = mx.random.normal((2, 3, 5))
    assert head_gather(LOCAL, x) is x
    assert mx.array_equal(head_sum(LOCAL, x), x.sum(axis=1)).item()
    assert mx.array_equal(head_max(LOCAL, x, keepdims=True), x.max(axis=1, keepdims=True)).item()
    assert host_max(LOCAL, 7) == 7
    npx = np.ones((2, 3))
    assert head_gather(LOCAL, npx) is npx
    assert heads_of(None) is LOCAL and heads_of(FakeGroup(1)) is LOCAL


def test_the_record_is_checked_and_copies_keep_the_group():
    g = FakeGroup(4, 2)
    h = heads_of(g)
    assert (h.shards, h.shard, int(h.comm)) == (4, 2, 4) and h.comm.group is g
    assert copy.deepcopy(h).comm is h.comm and copy.copy(h.comm) is h.comm
    assert check_heads(h) is h
    for bad, what in ((Heads(2, 0, None), "comm"), (Heads(2, 2, Comm(FakeGroup(2))), "shard"),
                      (Heads(0, 0, None), "shards"), ((1, 0, None), "Heads")):
        with pytest.raises(ValueError, match=what):
            check_heads(bad)


def test_a_group_of_one_gives_the_states_it_gave():
    """A method that reduces over heads, given the record of one process, holds exactly what
    it holds without it (the golden trajectories say the same for every method)."""
    rng = np.random.default_rng(0)
    k, v, q = (mx.array(rng.standard_normal(s).astype(np.float32))
               for s in ((1, 4, 30, 32), (1, 4, 30, 32), (1, 8, 30, 32)))
    for key, params in (("tova", dict(budget=12)), ("kivi_sink", dict(residual_length=8)),
                        ("chunkkv", dict(budget=24, per_head=False))):
        a = velox.update(velox.init(key, 1, 4, 32, **params), k, v, queries=q)
        b = velox.update(velox.init(key, 1, 4, 32, heads=LOCAL, **params), k, v, queries=q)
        assert np.array_equal(np.array(velox.positions(a)), np.array(velox.positions(b)))
        for x, y in zip(velox.get_kv(a), velox.get_kv(b)):
            assert mx.array_equal(x, y).item()


def test_every_method_declares_how_its_decisions_treat_kv_heads():
    kinds = {k: get_method(k).spec.heads for k in KEYS}
    assert set(kinds.values()) <= {"independent", "mixed", "unshardable"}
    assert {k for k, v in kinds.items() if v == "unshardable"} == {"adakv", "anchorkv"}
    assert {"tova", "kvzip", "morphkv", "chunkkv", "kivi_sink", "squeeze", "xkv", "minicache",
            "palu"} <= {k for k, v in kinds.items() if v == "mixed"}


def test_an_unshardable_method_refuses_a_shard_at_init():
    h = heads_of(FakeGroup(2))
    for key in ("adakv", "anchorkv"):
        with pytest.raises(ValueError, match=f"{key} cannot hold one shard"):
            velox.init(key, 1, 2, 32, heads=h)
        velox.init(key, 1, 2, 32)  # one process: as always


def test_palu_refuses_a_group_of_heads_split_between_shards():
    h = heads_of(FakeGroup(2))
    with pytest.raises(ValueError, match="would split a group"):
        velox.init("palu", 1, 3, 32, heads=h, basis="prefill", n_head_groups=3)
    st = velox.init("palu", 1, 2, 32, heads=h, basis="prefill", n_head_groups=4)
    assert st.tables.groups == 2  # the layer's 4 groups of one head, 2 a shard


# --- reading mlx-lm's sharded models (no process started) ----------------------------------

def _tiny(kv_heads: int, heads: int = 16):
    from mlx_lm.models import llama

    mx.random.seed(0)
    return llama.Model(llama.ModelArgs(**dict(CONFIG, num_key_value_heads=kv_heads,
                                              num_attention_heads=heads)))


def test_make_cache_reads_the_shard_from_the_model():
    from velox.adapters.mlxlm import make_cache
    from velox.adapters.sharding import model_heads

    assert model_heads(_tiny(8)) is LOCAL
    model = _tiny(8)
    model.shard(FakeGroup(4, 3))
    h = model_heads(model)
    assert (h.shards, h.shard) == (4, 3)
    caches = make_cache(model, "tova", budget=24)
    assert all(c.heads == h for c in caches)
    for key in ("adakv", "anchorkv"):
        with pytest.raises(ValueError, match=f"{key} cannot run on a tensor-parallel model"):
            make_cache(model, key)


def test_heads_that_do_not_divide_among_the_processes_are_refused():
    from velox.adapters.mlxlm import make_cache

    model = _tiny(6, heads=12)  # 6 kv heads over 4: mlx-lm's shard divides without checking
    model.shard(FakeGroup(4))
    with pytest.raises(ValueError, match="6 kv heads and 12 query heads do not divide among 4"):
        make_cache(model, "tova")


def test_a_shard_is_not_saved_or_loaded(tmp_path):
    from velox.adapters.mlxlm import load_cache, make_cache, save_cache

    model = _tiny(8)
    model.shard(FakeGroup(2))
    with pytest.raises(ValueError, match="one shard of a tensor-parallel"):
        save_cache(tmp_path / "c.safetensors", make_cache(model, "h2o", budget=24))
    with pytest.raises(ValueError, match="not a tensor-parallel shard"):
        load_cache(tmp_path / "c.safetensors", model)


# --- processes ------------------------------------------------------------------------------

def _run(n: int, folder: Path, out: Path, methods, *, core: bool, tokens: int | None = None,
         timeout: float = TIMEOUT) -> list[dict]:
    """Every process's results of ``n`` ring processes (``n == 1``: one plain process)."""
    argv = [WORKER, "--model", str(folder), "--out", str(out), "--methods", ",".join(methods)]
    argv += ["--core"] if core else []
    argv += [] if tokens is None else ["--tokens", str(tokens)]
    done = launch_ring(n, argv, timeout=timeout)
    for r, p in enumerate(done):
        assert p.returncode == 0, f"rank {r} of {n} exited {p.returncode}:\n{p.stderr[-4000:]}"
    return [dict(json.loads((out / f"rank{r}.json").read_text()),
                 arrays=dict(np.load(out / f"rank{r}.npz"))) for r in range(n)]


def _shared_selection(key: str) -> bool:
    """Whether ``params_for(key)`` gives a layer's heads one selection."""
    flag = get_method(key).spec.contract.get("head_independent", True)
    return isinstance(flag, str) and not params_for(key, len(PROMPT)).get(flag, True)


def check_processes(key: str, base: dict, ranks: list[dict]) -> None:
    """What ``n`` processes holding a shard of the heads each did with method ``key``,
    against one process holding every head (module doc)."""
    spec = get_method(key).spec
    n, h = len(ranks), CONFIG["num_key_value_heads"] // len(ranks)
    one = base["methods"][key]
    got = [r["methods"][key] for r in ranks]
    assert "refused" not in one, f"{key}: one process refused: {one['refused']}"
    if spec.heads == "unshardable":
        for r, m in enumerate(got):
            assert "refused" in m and f"{key} cannot run on a tensor-parallel model" in m["refused"], (
                f"{key}, rank {r}: not refused ({m})")
            assert f"{key} cannot hold one shard" in m["core_mlx_refused"]
        return
    for r, m in enumerate(got):
        assert "refused" not in m, f"{key}, rank {r} of {n}: refused: {m['refused']}"
        assert m["tokens"] == got[0]["tokens"], f"{key}: rank {r} decoded {m['tokens']}, rank 0 {got[0]['tokens']}"
        for layer, (p, p0) in enumerate(zip(m["positions"], got[0]["positions"])):
            assert np.shape(p) == np.shape(p0), f"{key}, layer {layer}: ranks hold different counts"
            if _shared_selection(key):  # one selection for every head of every process
                assert (np.array(p) == np.array(p0)[:, :1]).all(), (
                    f"{key}, layer {layer}: rank {r} keeps other positions than rank 0")
    # the core check: the same rows, exactly the one process's state, head for head
    backends = [b for b in ("mlx", "reference") if f"core_{b}_nbytes" in one]
    assert "mlx" in backends, f"{key}: no core check ran"
    for b in backends:
        for what in ("positions", "keys", "values"):
            want = base["arrays"][f"{key}|{b}|{what}"]
            for r, rk in enumerate(ranks):
                x = rk["arrays"][f"{key}|{b}|{what}"]
                y = want[:, r * h:(r + 1) * h]
                assert x.shape == y.shape and np.array_equal(x, y), (
                    f"{key} ({b}): rank {r} of {n} holds other {what} than one process's heads "
                    f"{r * h}..{(r + 1) * h - 1}" + ("" if x.shape != y.shape else
                                                     f" (largest difference {np.abs(x - y).max():g})"))
        total = sum(rk["methods"][key][f"core_{b}_nbytes"] for rk in ranks)
        assert total >= one[f"core_{b}_nbytes"], f"{key} ({b}): {total} bytes over {n} processes"
    if spec.contract.get("blas_codes"):
        return  # codes follow the rounding of the sharded projections (module doc)
    assert got[0]["tokens"] == one["tokens"], (
        f"{key}: {n} processes decoded {got[0]['tokens']}, one process {one['tokens']}")
    for r, m in enumerate(got):
        for layer, (p, q) in enumerate(zip(m["positions"], one["positions"])):
            assert np.array_equal(np.array(p), np.array(q)[:, r * h:(r + 1) * h]), (
                f"{key}, layer {layer}: rank {r} keeps other positions than one process keeps "
                f"for its heads")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", kv_heads=8, seed=0)


def test_two_processes_keep_what_one_keeps(tiny_folder, tmp_path):
    """Smoke (default run): TOVA, one selection for a layer's heads (gathered over the two
    processes), three tokens; the tokens and every process's positions are one process's."""
    t0 = time.monotonic()
    base = _run(1, tiny_folder, tmp_path / "one", ["tova"], core=False, tokens=3, timeout=120)[0]
    ranks = _run(2, tiny_folder, tmp_path / "two", ["tova"], core=False, tokens=3, timeout=120)
    one, h = base["methods"]["tova"], CONFIG["num_key_value_heads"] // 2
    for r, rk in enumerate(ranks):
        m = rk["methods"]["tova"]
        assert (rk["shards"], rk["shard"]) == (2, r)
        assert m["tokens"] == one["tokens"]
        for p, q in zip(m["positions"], one["positions"]):
            p, q = np.array(p), np.array(q)
            assert p.shape[1] == h and np.array_equal(p, q[:, r * h:(r + 1) * h])
            assert (p == p[:, :1]).all()  # one selection for every head
    assert time.monotonic() - t0 < 60


@pytest.fixture(scope="module")
def every_method(tiny_folder, tmp_path_factory):
    """The results of one process and of 2 and 4 ring processes, every method, each computed
    at its first use."""
    root, done = tmp_path_factory.mktemp("runs"), {}

    def get(n: int):
        if n not in done:
            got = _run(n, tiny_folder, root / f"n{n}", KEYS, core=True)
            done[n] = got[0] if n == 1 else got
        return done[n]
    return get


@pytest.mark.distributed
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("key", KEYS)
def test_every_method_on_a_sharded_model(every_method, n, key):
    check_processes(key, every_method(1), every_method(n))


# --- the command line under mlx.launch ------------------------------------------------------

@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory, smollm2):
    """A random tiny llama with SmolLM2's tokenizer (its vocabulary): a model folder the
    command line loads (``mlx_lm.utils.sharded_load`` under mlx.launch)."""
    import shutil

    from velox.adapters.smollm2 import MODEL_DIRNAME, default_cache_dir

    src = default_cache_dir() / MODEL_DIRNAME
    folder = tmp_path_factory.mktemp("chat") / "model"
    save_tiny_model(folder, kv_heads=8, seed=1)
    config = json.loads((folder / "config.json").read_text())
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    mx.random.seed(1)
    config.update(vocab_size=vocab)
    model = llama.Model(llama.ModelArgs(**config))
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, folder / f.name)
    return folder


def _launch(n: int, command: list[str], **kw) -> subprocess.Popen:
    """``mlx.launch`` of ``command`` over ``n`` ring processes on localhost (free ports), in a
    session of its own (the test ends it and everything it started)."""
    launcher = str(Path(sys.executable).with_name("mlx.launch"))
    port = free_ports(1)[0]
    return subprocess.Popen([launcher, "--hosts", "127.0.0.1", "-n", str(n), "--backend", "ring",
                             "--starting-port", str(port), "--", *command],
                            start_new_session=True, **kw)


def _end(proc: subprocess.Popen) -> None:
    """End a process this test started and its session (the processes it launched)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.distributed
@pytest.mark.model
def test_velox_generate_under_mlx_launch(chat_folder):
    velox_cli = str(Path(sys.executable).with_name("velox"))
    args = ["generate", "Name three colours.", "--model", str(chat_folder), "--method", "tova",
            "--budget", "24", "--max-tokens", "8"]
    one = subprocess.run([velox_cli, *args], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    proc = _launch(2, [velox_cli, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        _end(proc)
    assert proc.returncode == 0, err
    text = one.stdout.splitlines()[0]
    assert out.count(text) == 1, f"one process printed {one.stdout!r}; two printed {out!r}"
    assert "in process 0 of 2 (its shard of the kv heads)" in out


@pytest.mark.distributed
@pytest.mark.model
def test_velox_serve_under_mlx_launch(chat_folder, tmp_path):
    velox_cli = str(Path(sys.executable).with_name("velox"))
    body = json.dumps({"model": str(chat_folder), "prompt": "Name three colours.",
                       "max_tokens": 6, "temperature": 0}).encode()
    answers = []
    for n in (1, 2):
        port = free_ports(1)[0]
        command = [velox_cli, "serve", "--model", str(chat_folder), "--method", "tova",
                   "--budget", "24", "--port", str(port)]
        log = open(tmp_path / f"serve{n}.log", "w")
        proc = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                if n == 1 else _launch(n, command, stdout=log, stderr=subprocess.STDOUT))
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                        break
                except OSError:
                    assert proc.poll() is None, (tmp_path / f"serve{n}.log").read_text()[-3000:]
                    assert time.monotonic() < deadline, "the server did not start"
                    time.sleep(1)
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                answers.append(json.loads(resp.read())["choices"][0]["text"])
        finally:
            _end(proc)
            log.close()
    assert answers[0] == answers[1], answers


def test_the_benchmark_reports_steps_costs_and_bytes():
    """``benchmarks/distributed_step.py``'s report of a run's results (no process started)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "distributed_step.py"
    spec = importlib.util.spec_from_file_location("distributed_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names = list(bench.CACHES)

    def rank(n, r, step):
        spread = {"median": 1e-3, "iqr": 1e-4}
        return {"shards": n, "shard": r, "steps": {k: step for k in names},
                "steps_iqr": {k: 1e-4 for k in names}, "ab": spread,
                "tokens": {k: 7 for k in names}, "bytes": {k: 1 << 20 for k in names},
                "alone": None if n == 1 else {"all_gather": spread, "all_sum": spread}}
    results = {1: [rank(1, 0, 0.004)], 2: [rank(2, r, 0.008) for r in range(2)]}
    text, doc = bench.report(results, "python benchmarks/distributed_step.py")
    assert "| 2 | tova | 12 | 8.00 | 0.10 | 2.00x | yes | yes |" in text
    assert "| 2 | +1.00 (0.10) | +12.5% | 1.000 (0.100) | 1.000 (0.100) | 1.00 | 0.50 |" in text
    assert "| 2 | h2o | 1.00 MiB, 1.00 MiB | 2.00 MiB | 1.00 MiB | 1.000 |" in text
    assert doc["summary"]["2"]["velox_collectives_s"] == 4e-3
