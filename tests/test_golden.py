"""Golden trajectories: every registered method computes what it computed when
``tests/golden/`` was recorded.

Each method, on the ``reference`` and ``mlx`` backends, with real queries and with the
key-as-query proxy, replays a fixed seeded run from ``velox.init`` (a prefill chunk over its
capacity, decode steps at a full cache, a chunk after decode, more decode steps; parameters
and dims in ``tests/golden/trajectories.json``). After every update each state field,
``get_kv``, ``positions`` and the byte count must match the recording: by sha256 of dtype,
shape and bytes (``repr`` for Python scalars), except the fields listed under ``close``,
compared with the arrays in ``tests/golden/arrays.npz`` within ``atol + rtol |expected|``:

* merged rows: every floating field of a merging method (CaM) within its spec's
  ``[tolerance]`` (``specs/cam.toml``), which allows a merged sum taken in another order;
* BLAS rounding: fields computed through matmuls or an SVD, whose last bits depend on the
  BLAS and the CPU, so that a hash would break on another machine: those that changed when the
  recording was repeated with no OpenBLAS, or with OpenBLAS's Haswell and Zen kernels and
  NumPy without AVX-512 (as on another x86 CPU; the script does this when it records). At the
  first recording: accumulated attention scores (``h2o``, ``squeeze``, ``chunkkv``,
  ``keyformer``, ``kvzip``'s importance, ``morphkv``'s profiles, ``zipcache``'s buffer
  scores; mlx backend), CurDKV's scores and bases and GEAR's low-rank factors (float16: a
  flipped last bit) and ``get_kv``. Their tolerance is ten times the largest difference seen
  there, relative to the field's magnitude (float32: at least 1e-6). Positions, codes, exact
  rows and scalars never changed there (nor with 1 or 2 OpenBLAS threads, nor on a rerun):
  they are compared by hash, except the code fields of a method whose spec says why its codes
  follow BLAS rounding (``contract.blas_codes``: KVTC, whose basis is an eigendecomposition
  fitted at the prefill, so that a coefficient near a cell boundary codes to either side);
  those are listed under the method's ``unhashed`` and left out, its floating fields compared
  as above.

Observations are canonical (``rg.observe``): the per-token fields of a state of slots
(``velox.evict``) are ordered by position and empty slots dropped, so the recordings (of
sorted states) prove that a state of slots holds the same tokens, rows and per-token data at
every step. A parameter added after the recording (``rg.NEUTRAL``; a method's own value in
``rg.NEUTRAL_FOR``) replays at the value that is the recorded behaviour, and its field is then
left out of the comparison; so is a static state field added since (``ADDED_FIELDS``) at its
neutral value.

A refactor must pass unchanged. Re-record (``python scripts/record_golden.py``, with OpenBLAS
loaded as CI has it) only for a deliberate change of behaviour, and say so in the commit.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import velox

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_golden", ROOT / "scripts" / "record_golden.py")
rg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rg)

GOLDEN = json.loads((ROOT / "tests" / "golden" / rg.JSON_NAME).read_text(encoding="utf-8"))
CONFIG = GOLDEN["config"]


@pytest.fixture(scope="module")
def arrays():
    return rg.load_arrays(ROOT / "tests" / "golden" / rg.NPZ_NAME)


@pytest.fixture(autouse=True)
def on_cpu():
    """The recording is of CPU runs (a GPU's matmuls round differently)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def test_every_method_recorded(tmp_path):
    """The methods ``import velox`` registers (in a fresh process: tests may register more)."""
    assert GOLDEN["format"] == rg.FORMAT and GOLDEN["hex_digits"] == rg.HEX
    out = subprocess.run([sys.executable, "-c", "import velox; print(*velox.method_keys())"],
                         capture_output=True, text=True, check=True,
                         cwd=tmp_path)  # outside the source tree: the installed velox
    registered = set(out.stdout.split())
    recorded = set(GOLDEN["methods"])
    assert registered == recorded, (
        f"registered but not recorded: {sorted(registered - recorded)}; recorded but not "
        f"registered: {sorted(recorded - registered)} (python scripts/record_golden.py)")


def test_inputs_unchanged():
    assert rg.inputs_digest(CONFIG) == GOLDEN["inputs_sha256"], (
        "the seeded inputs differ (NumPy's generator changed?): nothing else can be compared")


def neutral(key: str, entry: dict) -> tuple[dict, set[str]]:
    """The recording's overrides with every parameter added since (``rg.NEUTRAL``) at its
    neutral value, and the names of those parameters' fields."""
    spec = velox.get_method(key).spec
    added = {name: rg.NEUTRAL_FOR.get(key, {}).get(name, rg.NEUTRAL[name]) for name in spec.params
             if name not in entry["params"] and name in rg.NEUTRAL}
    return {**entry["overrides"], **added}, {f"{p}{name}" for name in added for p in ("", "policy.")}


# Static state fields added after the recording, with the value that is the recorded
# behaviour: an observation of one at that value is left out of the comparison.
ADDED_FIELDS = {"ragged": False,  # velox.ragged: rows holding different numbers of tokens
                # velox.distributed.Heads of a method reducing over kv heads: every head, here
                "heads.shards": 1, "heads.shard": 0, "heads.comm": None}


def _added_field(name: str, value) -> bool:
    base = name.rsplit(".", 1)[-1]
    if name.startswith("policy."):
        name = name[len("policy."):]
    base = name if name in ADDED_FIELDS else base
    return base in ADDED_FIELDS and not isinstance(value, mx.array) and value == ADDED_FIELDS[base]


def replay(key: str, entry: dict, arrays: dict) -> list[str]:
    """Mismatches of ``key``'s trajectories: at the first call that differs, every field."""
    fields, problems = entry["fields"], []
    overrides, added = neutral(key, entry)
    for backend, modes in entry["trajectories"].items():
        for mode, rec in modes.items():
            want = rg.decode_calls(rec["calls"])
            # a field added after the recording (at its neutral value) is left out; one the
            # recording holds is compared
            got = [{f: x for f, x in obs.items()
                    if f in fields or (f not in added and not _added_field(f, x))}
                   for obs in rg.trajectory(key, backend, mode, overrides, CONFIG)]
            if len(got) != len(want):
                problems.append(f"{key} {backend} {mode}: {len(got)} calls, recorded {len(want)}")
                continue
            for i, (obs, hashes) in enumerate(zip(got, want)):
                if set(obs) != set(fields):
                    problems.append(f"{key} {backend} {mode} call {i}: fields added "
                                    f"{sorted(set(obs) - set(fields))}, missing "
                                    f"{sorted(set(fields) - set(obs))}")
                    break
                bad = []
                for f, h in zip(fields, hashes):
                    if f in entry.get("unhashed", {}):  # codes that move with BLAS rounding
                        continue
                    tol = rec["close"].get(f)
                    if tol is None:
                        if rg.digest(obs[f]) != h:
                            shown = "" if isinstance(obs[f], mx.array) else f" ({obs[f]!r})"
                            bad.append(f"{f}{shown}")
                        continue
                    actual, expected = rg.to_numpy(obs[f]), arrays[h]
                    if not rg.close_enough(actual, expected, tol["atol"], tol["rtol"]):
                        moved = (f"by {rg.max_abs_diff(actual, expected):.3g}"
                                 if actual.shape == expected.shape else
                                 f"shape {actual.shape}, recorded {expected.shape}")
                        bad.append(f"{f} ({moved}; atol {tol['atol']}, rtol {tol['rtol']})")
                if bad:
                    problems.append(f"{key} {backend} {mode} call {i} "
                                    f"(chunk of {CONFIG['chunks'][i]}): {', '.join(bad)}")
                    break
    return problems


@pytest.mark.parametrize("key", sorted(GOLDEN["methods"]))
def test_golden_trajectory(key, arrays):
    entry = GOLDEN["methods"][key]
    spec = velox.get_method(key).spec
    overrides, added = neutral(key, entry)
    params = rg.validate_params(spec, overrides, dims=rg.dims(CONFIG))
    params = {k: v for k, v in params.items() if k not in added}
    changed = {k: (params.get(k), v) for k, v in entry["params"].items() if params.get(k) != v}
    assert not changed and set(params) == set(entry["params"]), (
        f"{key}: parameters differ from the recording (now, recorded): {changed}; "
        f"added or removed: {sorted(set(params) ^ set(entry['params']))}")
    problems = replay(key, entry, arrays)
    if problems:
        pytest.fail("behaviour changed (method backend mode call: fields):\n"
                    + "\n".join(problems), pytrace=False)
