"""docs/your-own-method.md stays true: its files, written into an empty folder outside the
repository, register a method with its own spec and pass velox.testing's checks there; and
velox.testing without hypothesis names the extra to install."""

import os
import pathlib
import re
import subprocess
import sys

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "your-own-method.md"
FILES = re.findall(r"^<!-- file: (\S+) -->\n```\w+\n(.*?)^```", DOC.read_text(), re.S | re.M)


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}


def test_the_documented_method_is_verified_out_of_tree(tmp_path):
    assert [name for name, _ in FILES] == ["mymethods/vnorm.toml", "mymethods/vnorm.py",
                                          "tests/test_vnorm.py"]
    for name, text in FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "mymethods" / "__init__.py").write_text("")
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-p", "no:randomly", "--rootdir", str(tmp_path), "tests/test_vnorm.py"]
    done = subprocess.run(run, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    # the checks can fail: a reference backend scoring the keys instead of the values
    module = tmp_path / "mymethods" / "vnorm.py"
    module.write_text(module.read_text().replace("head.values.astype", "head.keys.astype"))
    done = subprocess.run(run, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-3000:]


def test_velox_testing_without_hypothesis_names_the_extra():
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "import velox\n"
            "try:\n    import velox.testing\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=300, cwd=DOC.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "velox[test]" in done.stdout and "hypothesis" in done.stdout, done.stdout
