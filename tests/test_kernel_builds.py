"""The test run's precompiled MLX kernel preamble (``tests/_kernel_builds.py``) builds kernels
that compute what MLX's own builds compute."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._kernel_builds import install

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import mlx.core as mx, numpy as np
f = lambda x, y: mx.exp(x * 1.25) + mx.sin(y) * x - mx.maximum(x, y * 3.0) + (x > y) * 2.0
x = mx.linspace(-2, 2, 97); y = mx.linspace(3, -1, 97)
a, b = mx.compile(f)(x, y), f(x, y)
print(np.array_equal(np.array(a), np.array(b)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the precompiled preamble is for g++ on Linux")
def test_kernels_built_with_the_precompiled_preamble_compute_the_same(tmp_path):
    base = install()
    if base is None:
        pytest.skip("no g++ or no MLX headers here: the suite builds kernels as MLX does")
    assert (base / "include" / "mlx" / "backend" / "cpu" / "compiled_preamble.h.gch").is_file()
    wrapper = base / "bin" / "g++"
    assert os.environ["PATH"].split(os.pathsep)[0] == str(wrapper.parent)
    env = dict(os.environ, TMPDIR=str(tmp_path))  # an empty kernel cache: the kernel is built
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert list((tmp_path / "mlx").rglob("*.so")), "no kernel was built"
