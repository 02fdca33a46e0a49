"""OpenBLAS for MLX's CPU matmuls: ``VELOX_OPENBLAS`` and the shim over the wheel's OpenBLAS."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import openblas_shim  # noqa: E402

PROBE = """
import velox, velox._blas as b
import mlx.core as mx, numpy as np
a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(a))
print(b.loaded, '|', b.reason, '|', float(np.abs(got - a.astype(np.float64) @ a).max()))
"""


def _probe(**env) -> list[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("VELOX_OPENBLAS", "VELOX_NO_OPENBLAS")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**e, **env}, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return [p.strip() for p in out.strip().splitlines()[-1].split("|")]


def test_a_missing_velox_openblas_is_named_and_nothing_loads():
    loaded, reason, err = _probe(VELOX_OPENBLAS="/nonexistent/libblas.so.3")
    assert loaded == "None" and reason == "VELOX_OPENBLAS=/nonexistent/libblas.so.3 does not exist"
    assert float(err) < 1e-2  # MLX's own BLAS still multiplies


def test_the_shim_jumps_from_each_plain_name_to_the_prefixed_one():
    text = openblas_shim.assembly(["cblas_sgemm", "sgesdd_"], "x86_64")
    assert ".globl cblas_sgemm\n.type cblas_sgemm, @function\ncblas_sgemm:\n\tjmp scipy_cblas_sgemm@PLT" in text
    assert "sgesdd_:\n\tjmp scipy_sgesdd_@PLT" in text
    assert text.count(".globl") == 2 and 'section .note.GNU-stack' in text


@pytest.mark.skipif(importlib.util.find_spec("scipy_openblas32") is None,
                    reason="the scipy-openblas32 wheel is not installed (pip install '.[blas-shim]')")
def test_the_shim_over_the_wheel_loads_and_multiplies(tmp_path):
    lib = openblas_shim.build(tmp_path / "shim")
    names = openblas_shim.exported(openblas_shim.wheel_library())
    assert "cblas_sgemm" in names and "sgemm_" in names
    loaded, reason, err = _probe(VELOX_OPENBLAS=str(lib))
    assert loaded == str(lib) and reason == "loaded before mlx.core (VELOX_OPENBLAS)"
    assert float(err) < 1e-2
