"""Record golden trajectories of every registered method: ``python scripts/record_golden.py``.

Each method (compositions included) runs on each CPU backend (``reference``, ``mlx``) from
``velox.init`` through a fixed, seeded sequence of updates: a prefill chunk larger than its
capacity, single-token decode steps at a full cache, a multi-token chunk, more decode steps;
once with real queries (GQA, ``groups`` query heads per kv head) and once without (the
key-as-query proxy). After every call it hashes each state field (arrays: dtype, shape and
bytes; Python scalars: ``repr``), ``get_kv``, ``positions`` and the byte count, and writes
``tests/golden/trajectories.json`` (hashes and every parameter used) and
``tests/golden/arrays.npz`` (the arrays compared within a tolerance instead of by hash).
``tests/test_golden.py`` replays the file.

Floating-point fields are compared within a tolerance instead of by hash when

* the method merges rows (spec family ``merging`` with a nonzero ``[tolerance]``): the
  spec's tolerance, which also allows a summation in another order;
* the field changes between BLAS configurations (``VARIANTS``: OpenBLAS threads, no OpenBLAS,
  other OpenBLAS kernels and NumPy without AVX-512, as on another x86 CPU). Recording runs
  each variant in a subprocess and marks those fields (``--variants none`` skips them: only
  for trying things out). A non-floating field that changes there is an error: it could only
  be compared by a hash that breaks on another machine.

Record under the CI configuration: OpenBLAS loaded (``import velox`` does it), default threads.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import velox  # first: loads OpenBLAS before mlx.core
import mlx.core as mx
import numpy as np

from velox.registry import get_method, method_keys
from velox.spec import validate_params
from velox.testing import test_params

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
JSON_NAME = "trajectories.json"
NPZ_NAME = "arrays.npz"
FORMAT = 1
HEX = 10  # hex digits kept of each sha256 (40 bits)

# The scenario every method runs (stored in the file; the replay reads it from there).
CONFIG: dict[str, Any] = {
    "seed": 0,
    "batch": 2,
    "kv_heads": 2,
    "head_dim": 32,
    "groups": 2,            # query heads per kv head in the runs with real queries
    "dtype": "float32",
    "key_scale": 0.5,       # keys ~ N(0, 0.5^2); values and queries ~ N(0, 1)
    # prefill above every capacity, decode at a full cache, a chunk after decode, decode
    "chunks": [40] + [1] * 8 + [7] + [1] * 4,
}
BACKENDS = ("reference", "mlx")
MODES = ("queries", "proxy")

# Integer defaults above these caps are lowered to them (spec defaults otherwise): budgets of
# 512 tokens and windows of 128 do not fit a 59-token trajectory. Every set is validated.
CAPS = {
    "budget": 24,
    "window_size": 20,        # streaming_llm: n_sink + window_size = 24
    "obs_window": 8,
    "kernel_size": 7,
    "window": 12,
    "residual_length": 16,
    "recent_boundary": 12,    # age_tiered: its first group is recent, then mid, then old
    "mid_boundary": 24,
    "threshold_window": 16,
    "calib_tokens": 16,
    "recent": 8,              # knorm, keyformer, qfilters: budget > n_sink + recent
}

_SHIM = "<shim>"  # a variant's library built by scripts/openblas_shim.py when it runs
# BLAS configurations whose differences decide which fields are compared within a tolerance.
_AVX512 = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
VARIANTS: dict[str, dict[str, str | None]] = {
    "repeat": {},
    "threads1": {"OPENBLAS_NUM_THREADS": "1"},
    "threads2": {"OPENBLAS_NUM_THREADS": "2"},
    "no_openblas": {"VELOX_NO_OPENBLAS": "1", "LD_PRELOAD": None},
    "haswell": {"OPENBLAS_CORETYPE": "Haswell", "NPY_DISABLE_CPU_FEATURES": _AVX512},
    "skylakex": {"OPENBLAS_CORETYPE": "SkylakeX"},
    "zen": {"OPENBLAS_CORETYPE": "Zen", "NPY_DISABLE_CPU_FEATURES": _AVX512},
    # the scipy-openblas32 wheel's OpenBLAS (another release) through scripts/openblas_shim.py,
    # what CI loads where the system package cannot be installed
    "wheel_openblas": {"VELOX_OPENBLAS": _SHIM, "LD_PRELOAD": None},
}
# A field that depends on BLAS rounding is compared within ``rel * scale + rel * |expected|``,
# scale its largest magnitude in the trajectory, rel ten times the largest difference the
# variants showed relative to scale, and at least this floor (a few units in the last place).
BLAS_FLOOR = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}

_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


# --- the scenario ------------------------------------------------------------------------

def small_params(key: str, config: dict[str, Any]) -> dict[str, Any]:
    """The parameters passed to ``velox.init``: integer defaults above ``CAPS`` lowered."""
    spec = get_method(key).spec
    out = {name: CAPS[name] for name, p in spec.params.items()
           if name in CAPS and p.type == "int" and p.default > CAPS[name]}
    out.update(test_params(key))  # a default kept out of tests (a codebook shipped for one model)
    validate_params(spec, out, dims=dims(config))
    return out


def dims(config: dict[str, Any]) -> dict[str, int]:
    return dict(batch=config["batch"], kv_heads=config["kv_heads"], head_dim=config["head_dim"])


def inputs(config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys, values ``[b, h, T, d]`` and queries ``[b, h * groups, T, d]`` of the whole run."""
    rng = np.random.default_rng(config["seed"])
    b, h, d, T = config["batch"], config["kv_heads"], config["head_dim"], sum(config["chunks"])
    keys = (rng.standard_normal((b, h, T, d)) * config["key_scale"]).astype(np.float32)
    values = rng.standard_normal((b, h, T, d)).astype(np.float32)
    queries = rng.standard_normal((b, h * config["groups"], T, d)).astype(np.float32)
    return keys, values, queries


def inputs_digest(config: dict[str, Any]) -> str:
    return "".join(digest(mx.array(x)) for x in inputs(config))


# --- hashing -----------------------------------------------------------------------------

def digest(x: Any) -> str:
    """sha256 (``HEX`` hex digits) of an array's dtype, shape and bytes, or of ``repr(x)``."""
    h = hashlib.sha256()
    if isinstance(x, mx.array):
        mx.eval(x)
        h.update(f"{x.dtype}{tuple(x.shape)}".encode())
        h.update(np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x).tobytes())
    else:
        h.update(repr(x).encode())
    return h.hexdigest()[:HEX]


def _leaves(name: str, x: Any):
    if hasattr(x, "_fields"):
        for f in x._fields:
            yield from _leaves(f"{name}.{f}" if name else f, getattr(x, f))
    elif isinstance(x, dict):
        for k in sorted(x):
            yield from _leaves(f"{name}.{k}", x[k])
    elif isinstance(x, (tuple, list)):
        for i, y in enumerate(x):
            yield from _leaves(f"{name}.{i}", y)
    else:
        yield name, x


# Parameters added after a recording, at the value that reproduces the recorded behaviour
# (tests/test_golden.py replays older entries with them; a new recording records them).
NEUTRAL: dict[str, Any] = {"slack": 0, "value_codec": "affine", "value_bits": 8}
#: A method's own neutral value of a parameter, where it differs from NEUTRAL's (the values of
#: turboquant_rvq were held exact when it was recorded).
NEUTRAL_FOR: dict[str, dict[str, Any]] = {"turboquant_rvq": {"value_codec": "exact"}}

# Storage bookkeeping of a state of slots (velox.evict): the canonical observation orders
# every per-token field by position and drops empty slots, so the count is left out too.
SLOT_FIELDS = ("empty", "policy.empty")


def _slot_positions(state: tuple) -> tuple[mx.array, int] | None:
    """The slot positions ``[b, h, n]`` of a state (or of a composed state's policy) and its
    empty slots, or ``None``."""
    for rec in (state, getattr(state, "policy", None)):
        pos = getattr(rec, "positions", None)
        if isinstance(pos, mx.array) and pos.ndim == 3:
            return pos, getattr(rec, "empty", 0)
    return None


def _per_token_dims(record_type: type) -> dict[str, bool]:
    """``field -> whether its annotation says it is per token`` (``[b, h, n, ...]``), for the
    fields whose annotation has jaxtyping dims."""
    out = {}
    for name, hint in getattr(record_type, "__annotations__", {}).items():
        dims = getattr(hint, "dim_str", None)
        if isinstance(dims, str):
            out[name] = dims.split()[:3] == ["b", "h", "n"]
    return out


def _held_rows(state: tuple, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` (the leaves of a codec cache's state, ``velox.codec_cache``) with the rows of
    its code arrays cut to the tokens it holds, and its count of empty rows left out: its
    storage in chunks observes as the state holding those tokens' codes alone."""
    from velox import codec_cache

    n, rows = codec_cache.stored_tokens(state), codec_cache.capacity(state)
    out.pop("empty", None)
    for name, x in list(out.items()):
        if (name.startswith(("key_codes.", "value_codes.")) and isinstance(x, mx.array)
                and x.ndim >= 3 and x.shape[2] == rows):
            out[name] = x[:, :, :n]
    return out


def _canonical(state: tuple, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` (the leaves of ``state``) with every per-token array ordered by position and
    empty slots dropped: a state of slots observes as the sorted state holding the same
    tokens, rows and per-token fields; a codec cache's, its held rows only (:func:`_held_rows`)."""
    from velox import codec_cache

    if codec_cache.is_chunked(state):
        return _held_rows(state, out)
    found = _slot_positions(state)
    if found is None:
        return out
    pos, empty = found
    order = mx.argsort(pos, axis=-1)[..., empty:]
    hints: dict[str, bool] = {}
    for prefix, rec in (("", state), ("policy.", getattr(state, "policy", None))):
        if rec is not None and hasattr(rec, "_fields"):
            hints.update({prefix + k: v for k, v in _per_token_dims(type(rec)).items()})
            for f in rec._fields:  # nested records (codes) of per-token rows
                sub = getattr(rec, f)
                if hasattr(sub, "_fields"):
                    hints.update({f"{prefix}{f}.{k}": v for k, v in _per_token_dims(type(sub)).items()})
    for name, x in list(out.items()):
        if name in SLOT_FIELDS:
            del out[name]
            continue
        if not isinstance(x, mx.array) or x.ndim < 3 or tuple(x.shape[:3]) != tuple(pos.shape):
            continue
        if hints.get(name, True):
            out[name] = mx.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)
    return out


def observe(state: tuple) -> dict[str, Any]:
    """Every leaf of the state (nested fields dotted), ``get_kv``, ``positions`` and bytes.

    Canonical: per-token fields of a state of slots ordered by position, empty slots and the
    ``empty`` count dropped (:func:`_canonical`), so a state holding the same tokens, rows and
    per-token data in another slot order observes the same; a codec cache's code arrays cut to
    the tokens it holds (its empty rows and their count dropped). ``nbytes()`` counts every
    row held."""
    out = _canonical(state, dict(_leaves("", state)))
    keys, values = velox.get_kv(state)
    out["get_kv.keys"], out["get_kv.values"] = keys, values
    out["positions()"] = velox.positions(state)
    out["nbytes()"] = velox.nbytes(state)
    mx.eval([v for v in out.values() if isinstance(v, mx.array)])
    return out


def trajectory(key: str, backend: str, mode: str, overrides: dict[str, Any],
               config: dict[str, Any]):
    """Yield :func:`observe` after each update of the scenario."""
    keys, values, queries = inputs(config)
    dtype = getattr(mx, config["dtype"])
    state = velox.init(key, config["batch"], config["kv_heads"], config["head_dim"],
                       dtype=dtype, backend=backend, **overrides)
    start = 0
    for s in config["chunks"]:
        sl = slice(start, start + s)
        k, v = (mx.array(x[:, :, sl]).astype(dtype) for x in (keys, values))
        q = mx.array(queries[:, :, sl]).astype(dtype) if mode == "queries" else None
        state = velox.update(state, k, v, queries=q)
        start += s
        yield observe(state)


def is_float(x: Any) -> bool:
    return isinstance(x, mx.array) and x.dtype in _FLOATS


def to_numpy(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)


def merge_tolerance(key: str) -> tuple[float, float] | None:
    """``(atol, rtol)`` of a merging method's ``[tolerance]`` (``None``: compare by hash)."""
    spec = get_method(key).spec
    atol, rtol = float(spec.tolerance.get("atol", 0.0)), float(spec.tolerance.get("rtol", 0.0))
    return (atol, rtol) if spec.family == "merging" and (atol or rtol) else None


# --- recording ---------------------------------------------------------------------------

def run_all(config: dict[str, Any], keys: tuple[str, ...], arrays: dict | None = None,
            log=None) -> dict:
    """``{key: {backend: {mode: [{field: hash}]}}}``; floating arrays go into ``arrays``
    (``"key|backend|mode|call|field"``) when given."""
    out: dict = {}
    for key in keys:
        t0 = time.perf_counter()
        overrides = small_params(key, config)
        for backend in BACKENDS:
            if backend not in get_method(key).backends:
                continue
            for mode in MODES:
                calls = []
                for i, obs in enumerate(trajectory(key, backend, mode, overrides, config)):
                    calls.append({f: digest(x) for f, x in obs.items()})
                    if arrays is not None:
                        for f, x in obs.items():
                            if is_float(x):
                                arrays[f"{key}|{backend}|{mode}|{i}|{f}"] = to_numpy(x)
                out.setdefault(key, {}).setdefault(backend, {})[mode] = calls
        if log:
            log(f"{key:14s} {time.perf_counter() - t0:6.2f} s")
    return out


def _variant(name: str, env_changes: dict[str, str | None], keys: tuple[str, ...],
             tmp: Path) -> tuple[dict, dict]:
    """Hashes and floating arrays of a run in a subprocess with ``env_changes``."""
    env = dict(os.environ)
    for k, v in env_changes.items():
        if v == _SHIM:
            sys.path.insert(0, str(ROOT / "scripts"))
            import openblas_shim
            env[k] = str(openblas_shim.build(tmp / "openblas-shim"))
        elif v is None:
            env.pop(k, None)
        else:
            env[k] = v
    out = tmp / f"{name}.npz"
    subprocess.run([sys.executable, __file__, "--dump", str(out), "--methods", ",".join(keys)],
                   env=env, check=True)
    with np.load(out) as z:
        hashes = json.loads(str(z["__hashes__"]))
        arrays = {k: z[k] for k in z.files if k != "__hashes__"}
    return hashes, arrays


def max_abs_diff(x: np.ndarray, y: np.ndarray) -> float:
    """Largest ``|x - y|`` over the finite pairs (0 for empty arrays)."""
    d = np.abs(x.astype(np.float64) - y.astype(np.float64))
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else 0.0


def close_enough(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> bool:
    """Same shape, same non-finite entries, ``|actual - expected| <= atol + rtol |expected|``."""
    return actual.shape == expected.shape and bool(np.allclose(
        actual.astype(np.float64), expected.astype(np.float64), atol=atol, rtol=rtol,
        equal_nan=True))


def decode_calls(calls: list[str]) -> list[list[str]]:
    """The hashes of every call (``"."``: the previous call's hash of that field)."""
    out: list[list[str]] = []
    for row in calls:
        hs = row.split(" ")
        out.append([out[-1][j] if h == "." else h for j, h in enumerate(hs)] if out else hs)
    return out


def _encode_calls(calls: list[list[str]]) -> list[str]:
    return [" ".join("." if i and h == calls[i - 1][j] else h for j, h in enumerate(c))
            for i, c in enumerate(calls)]


class _Store:
    """The arrays compared within a tolerance, by hash, in a few npz members: token rows
    (``x[b, h, i]``, 4 elements or more) once each in a table per dtype and row shape
    (``rows.<dtype>.<shape>``) with the arrays' row indices in ``row_index``; other arrays
    concatenated per dtype (``flat.<dtype>``). ``directory`` (JSON) says where each array is."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[bytes, int]] = {}
        self.rows: dict[str, list[np.ndarray]] = {}
        self.flat: dict[str, list[np.ndarray]] = {}
        self.row_index: list[np.ndarray] = []
        self.directory: dict[str, list] = {}

    def add(self, h: str, x: np.ndarray) -> None:
        if h in self.directory:
            return
        if x.ndim >= 3 and x.size and int(np.prod(x.shape[3:], dtype=np.int64)) >= 4:
            name = f"rows.{x.dtype}.{'x'.join(map(str, x.shape[3:]))}"
            seen, rows = self.seen.setdefault(name, {}), self.rows.setdefault(name, [])
            idx = []
            for r in x.reshape(-1, *x.shape[3:]):
                idx.append(seen.setdefault(r.tobytes(), len(rows)))
                if idx[-1] == len(rows):
                    rows.append(r)
            offset = sum(len(a) for a in self.row_index)
            self.row_index.append(np.array(idx, np.int32))
            self.directory[h] = [name, offset, list(x.shape)]
        else:
            name = f"flat.{x.dtype}"
            parts = self.flat.setdefault(name, [])
            self.directory[h] = [name, sum(a.size for a in parts), list(x.shape)]
            parts.append(x.ravel())

    def save(self, path: Path) -> None:
        members = {n: np.stack(r) for n, r in self.rows.items()}
        members.update({n: np.concatenate(p) for n, p in self.flat.items()})
        members["row_index"] = (np.concatenate(self.row_index) if self.row_index
                                else np.zeros(0, np.int32))
        members["directory"] = np.array(json.dumps(self.directory, sort_keys=True))
        # an npz file, written with fixed timestamps so that equal arrays give equal bytes
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for name, a in members.items():
                buf = io.BytesIO()
                np.lib.format.write_array(buf, a, allow_pickle=False)
                info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, buf.getvalue())


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a ``_Store`` file by hash."""
    out = {}
    with np.load(path) as z:
        members = {n: z[n] for n in z.files}
    for h, (name, offset, shape) in json.loads(str(members["directory"])).items():
        if name.startswith("rows."):
            n = int(np.prod(shape[:3], dtype=np.int64))
            idx = members["row_index"][offset:offset + n]
            out[h] = members[name][idx].reshape(shape)
        else:
            n = int(np.prod(shape, dtype=np.int64))
            out[h] = members[name][offset:offset + n].reshape(shape)
    return out


def _dumps(x: Any, indent: str = "") -> str:
    """JSON, one line per dict entry and per call; short lists and small dicts inline."""
    flat = json.dumps(x)
    if not isinstance(x, (dict, list)) or len(flat) + len(indent) <= 100 or (
            isinstance(x, list) and all(not isinstance(v, str) or len(v) < 40 for v in x)):
        return flat
    inner = indent + " "
    if isinstance(x, dict):
        body = ",\n".join(f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in x.items())
        return "{\n" + body + "\n" + indent + "}"
    return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in x) + "\n" + indent + "]"


def record(keys: tuple[str, ...], variants: tuple[str, ...], log=print) -> None:
    if velox._blas.loaded is None:
        raise SystemExit(f"OpenBLAS is not loaded ({velox._blas.reason}): record as CI runs "
                         "(apt-get install libopenblas0-pthread)")
    config = dict(CONFIG)
    arrays: dict[str, np.ndarray] = {}
    log(f"BLAS: {velox._blas.loaded}, {velox._blas.reason}")
    hashes = run_all(config, keys, arrays, log=log)
    merge_tol = {key: merge_tolerance(key) for key in keys}

    # Fields that change between BLAS configurations: (key, backend, mode, field) ->
    # (largest |difference|, variants where it changed)
    moved: dict[tuple, tuple[float, set[str]]] = {}
    # Code fields (integers) that move under a BLAS configuration, for a method whose spec says
    # why they may (``contract.blas_codes``): left out of the hashes, the reason recorded.
    unhashed: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            log(f"variant {name}: {VARIANTS[name]}")
            v_hashes, v_arrays = _variant(name, VARIANTS[name], keys, Path(tmp))
            for key in keys:
                for backend, modes in hashes[key].items():
                    for mode, calls in modes.items():
                        for i, (a, b) in enumerate(zip(calls, v_hashes[key][backend][mode])):
                            for f in a:
                                if a[f] == b.get(f):
                                    continue
                                where = f"{key} {backend} {mode} call {i}: {f}"
                                ak = f"{key}|{backend}|{mode}|{i}|{f}"
                                if ak not in arrays or ak not in v_arrays:
                                    why = get_method(key).spec.contract.get("blas_codes")
                                    if why:
                                        unhashed.setdefault(key, {})[f] = why
                                        continue
                                    raise SystemExit(f"{where} changes under variant {name} "
                                                     "and is not floating point")
                                x, y = arrays[ak], v_arrays[ak]
                                if x.shape != y.shape or not np.array_equal(
                                        np.isfinite(x), np.isfinite(y)):
                                    raise SystemExit(f"{where} changes shape or finiteness "
                                                     f"under variant {name}")
                                tol = merge_tol[key]
                                if tol is not None and not close_enough(y, x, *tol):
                                    raise SystemExit(f"{where} moves by {max_abs_diff(x, y):.3g} "
                                                     f"under variant {name}, beyond the spec's "
                                                     f"tolerance {tol}")
                                d, names = moved.get((key, backend, mode, f), (0.0, set()))
                                moved[(key, backend, mode, f)] = (max(d, max_abs_diff(x, y)),
                                                                  names | {name})

    doc: dict[str, Any] = {
        "format": FORMAT,
        "about": ("Golden trajectories of every registered method, written by "
                  "scripts/record_golden.py and replayed by tests/test_golden.py. Per method: "
                  "the parameters passed to velox.init (overrides) and all of them (params); "
                  "the state's fields (dotted: nested), get_kv, positions() and nbytes(); "
                  "per backend and mode one line per update: each field's sha256 "
                  f"({HEX} hex digits of dtype, shape and bytes, or of repr), '.' where it "
                  "equals the previous call's. Fields in 'close' are compared within atol + "
                  "rtol |expected| against the arrays in arrays.npz, stored by hash."),
        "config": config,
        "backends": list(BACKENDS),
        "modes": {"queries": f"real queries, {config['groups']} query heads per kv head",
                  "proxy": "no queries (key-as-query proxy)"},
        "inputs_sha256": inputs_digest(config),
        "hex_digits": HEX,
        "recorded_with": {"mlx": mx.__version__, "numpy": np.__version__,
                          "blas": velox._blas.loaded, "variants": list(variants)},
        "methods": {},
    }
    store = _Store()
    for key in keys:
        m = get_method(key)
        overrides = small_params(key, config)
        entry: dict[str, Any] = {
            "overrides": overrides,
            "params": validate_params(m.spec, overrides, dims=dims(config)),
            "trajectories": {},
        }
        for backend, modes in hashes[key].items():
            for mode, calls in modes.items():
                fields = list(calls[0])
                for i, c in enumerate(calls):
                    if list(c) != fields:
                        raise SystemExit(f"{key} {backend} {mode}: fields change at call {i}")
                close: dict[str, dict[str, Any]] = {}
                for f in fields:
                    series = [arrays.get(f"{key}|{backend}|{mode}|{i}|{f}")
                              for i in range(len(calls))]
                    if series[0] is None:
                        continue
                    if merge_tol[key] is not None:
                        atol, rtol = merge_tol[key]
                        close[f] = {"why": "merged", "atol": atol, "rtol": rtol}
                    elif (key, backend, mode, f) in moved:
                        d, names = moved[(key, backend, mode, f)]
                        scale = max((float(np.abs(x[np.isfinite(x)]).max(initial=0.0))
                                     for x in series), default=0.0)
                        rel = max(BLAS_FLOOR[str(series[0].dtype)], 10 * d / scale if scale else 0.0)
                        close[f] = {"why": "blas", "atol": float(f"{rel * scale:.3g}"),
                                    "rtol": float(f"{rel:.3g}"), "max_diff_seen": d,
                                    "variants": sorted(names)}
                    else:
                        continue
                    for i, c in enumerate(calls):
                        store.add(c[f], series[i])
                if entry.setdefault("fields", fields) != fields:
                    raise SystemExit(f"{key} {backend} {mode}: other fields than {entry['fields']}")
                if key in unhashed:
                    entry["unhashed"] = unhashed[key]
                entry["trajectories"].setdefault(backend, {})[mode] = {
                    "close": close,
                    "calls": _encode_calls([[c[f] for f in fields] for c in calls]),
                }
        doc["methods"][key] = entry

    GOLDEN.mkdir(parents=True, exist_ok=True)
    (GOLDEN / JSON_NAME).write_text(_dumps(doc) + "\n", encoding="utf-8")
    store.save(GOLDEN / NPZ_NAME)
    n_close = sum(len(t["close"]) for e in doc["methods"].values()
                  for b in e["trajectories"].values() for t in b.values())
    log(f"wrote {GOLDEN / JSON_NAME} ({(GOLDEN / JSON_NAME).stat().st_size} bytes) and "
        f"{GOLDEN / NPZ_NAME} ({(GOLDEN / NPZ_NAME).stat().st_size} bytes); {n_close} fields "
        "compared within a tolerance:")
    for key, e in doc["methods"].items():
        for backend, t in e["trajectories"].items():
            for mode, tr in t.items():
                for f, c in tr["close"].items():
                    log(f"  {key} {backend} {mode} {f}: {c}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="all", help="comma-separated keys (default: all)")
    ap.add_argument("--variants", default="all",
                    help=f"BLAS variants to compare with: all, none or a list of "
                         f"{', '.join(VARIANTS)}")
    ap.add_argument("--dump", metavar="NPZ", help=argparse.SUPPRESS)  # a variant's run
    args = ap.parse_args(argv)
    keys = method_keys() if args.methods == "all" else tuple(args.methods.split(","))
    if args.dump:
        arrays: dict[str, np.ndarray] = {}
        hashes = run_all(dict(CONFIG), keys, arrays)
        np.savez(args.dump, __hashes__=np.array(json.dumps(hashes)), **arrays)
        return
    if args.methods != "all":
        raise SystemExit("a recording covers every method (--methods is for variant runs)")
    variants = (tuple(VARIANTS) if args.variants == "all" else
                () if args.variants == "none" else tuple(args.variants.split(",")))
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    record(keys, variants)


if __name__ == "__main__":
    main()
