"""The README stays true: its method table is generated from specs/, and every python block in
it runs as printed (each on its own) and prints what it claims."""

import pathlib
import re

import pytest

from velox.spec import method_table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, re.S | re.M)


def _heading(block: str) -> str:
    before = TEXT[:TEXT.index(block)]
    return re.findall(r"^## (.+)$", before, re.M)[-1]


def _needs_model(block: str) -> bool:
    return "load_default_model" in block or "mlx_lm" in block


def test_method_table_is_current():
    table = re.search(r"<!-- methods:begin -->\n(.*?)<!-- methods:end -->", TEXT, re.S).group(1)
    assert table == method_table(), "run: python scripts/update_readme_table.py"


def test_every_python_block_is_checked():
    assert sorted(map(_heading, BLOCKS)) == sorted(CHECKS)


def _check_decoding_loop(out):
    assert out[0] == "(1, 8, 256, 64)"
    positions = [int(p) for p in re.findall(r"\d+", out[1].split("dtype")[0])]
    assert positions[:4] == [0, 1, 2, 3] and len(positions) == 6  # the sinks, then survivors
    assert out[2].endswith(" bytes held") and int(out[2].split()[0]) > 0


def _check_mlx_lm(out):
    text, stats = "\n".join(out[:-1]), out[-1]
    assert len(text) > 100 and text.endswith("...")
    found = re.fullmatch(r"(\d+) of (\d+) tokens kept: (\d+) bytes held, (\d+) for a full "
                         r"float32 cache", stats)
    assert found, stats
    stored, seen, held, full = map(int, found.groups())
    assert stored == 64 < seen  # the cache evicted while the answer was written
    assert held < full


def _check_composing(out):
    assert out[0] == "(1, 8, 256, 128)"
    codes, rows = map(int, re.fullmatch(r"(\d+) bytes as 2-bit codes, (\d+) as float32 rows",
                                        out[1]).groups())
    assert codes * 4 < rows


CHECKS = {
    "A decoding loop with TOVA": _check_decoding_loop,
    "With mlx-lm": _check_mlx_lm,
    "Composing policies": _check_composing,
}


@pytest.mark.parametrize("block", [
    pytest.param(b, id=_heading(b), marks=[pytest.mark.model] if _needs_model(b) else [])
    for b in BLOCKS])
def test_python_block_runs_as_printed(block, capsys):
    exec(compile(block, f"README.md ({_heading(block)})", "exec"), {"__name__": "__readme__"})
    CHECKS[_heading(block)](capsys.readouterr().out.strip().splitlines())


ROOT = README.parent


@pytest.mark.parametrize("block", [pytest.param(b, id=_heading(b)) for b in BLOCKS
                                   if not _needs_model(b)])
def test_python_block_runs_from_the_clone_root(block):
    """A new user runs the README's examples where the README leaves them, in the clone's
    root, whose ``./velox`` comes before the installed package on ``sys.path``: the source
    tree's ``kernels/``, ``adapters/`` and ``specs/`` are ``velox.kernels``,
    ``velox.adapters`` and ``velox.specs`` there too, and the example prints what it claims."""
    import subprocess
    import sys

    probe = ("import velox, velox.kernels, velox.adapters, velox.specs\n"
             "print(velox.__file__)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", probe + block], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip().splitlines()
    assert pathlib.Path(out[0]).resolve() == ROOT / "velox" / "__init__.py"  # the source tree's
    CHECKS[_heading(block)](out[1:])
