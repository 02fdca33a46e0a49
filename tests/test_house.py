"""The house rules: one way to write a method, each thing written once.

* a parameter's name, type and default are its ``init`` signature's, its doc the ``Args:``
  entry; spec files hold none of them;
* the paper and the deviations are the spec's, appended to the module's docstring;
* ``velox.<key>`` is the method's namespace with static aliases, generated and not drifting.
"""

from __future__ import annotations

import ast
import inspect
import pydoc
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import pytest

import velox
from velox.registry import get_method, method_keys
from velox.spec import args_section, spec_keys

ROOT = Path(__file__).resolve().parents[1]
KEYS = spec_keys()


def _module(key):
    return sys.modules[get_method(key).init.__module__]


def test_every_spec_file_is_a_registered_method():
    assert set(KEYS) <= set(method_keys())


@pytest.mark.parametrize("key", KEYS)
def test_spec_files_do_not_restate_the_signature(key):
    data = tomllib.loads((resources.files("velox.specs") / f"{key}.toml").read_text())
    for name, table in data.get("params", {}).items():
        assert not {"type", "default", "doc"} & set(table), (
            f"{key}.toml [params.{name}] restates what init's signature and Args say")


@pytest.mark.parametrize("key", KEYS)
def test_every_parameter_is_documented_in_args(key):
    init = get_method(key).init
    docs = args_section(inspect.unwrap(init).__doc__)
    docs.pop("heads", None)  # not a parameter: where the state's kv heads sit (velox.distributed)
    params = velox.load_spec(key).params
    assert set(docs) == set(params), f"{key}: Args {sorted(docs)} vs parameters {sorted(params)}"
    assert all(docs[n].strip() for n in params)
    text = pydoc.render_doc(init, renderer=pydoc.plaintext)
    for name in params:
        assert f"{name}:" in text
    assert "Args:" in text


@pytest.mark.parametrize("key", KEYS)
def test_deviations_and_paper_are_written_once(key):
    mod = _module(key)
    source_doc = ast.get_docstring(ast.parse(Path(mod.__file__).read_text())) or ""
    assert "Deviations from the paper" not in source_doc and "References:" not in source_doc, (
        f"{key}: the module docstring restates the spec's paper or deviations")
    spec = velox.load_spec(key)
    doc = " ".join(mod.__doc__.split())
    for d in spec.deviations:
        assert " ".join(d.split()) in doc, f"{key}: deviation missing from the generated docstring: {d}"
    if spec.title:
        assert " ".join(spec.title.split()) in doc and spec.authors in doc


@pytest.mark.parametrize("key", [k for k in KEYS if k.isidentifier()])
def test_namespace_and_aliases(key):
    ns = getattr(velox, key)
    m = get_method(key)
    assert ns.init is m.init is getattr(velox, f"{key}_init")
    assert ns.update is m.update is getattr(velox, f"{key}_update")
    assert ns.get_kv is m.get_kv is getattr(velox, f"{key}_get_kv")
    assert ns.nbytes is m.nbytes is getattr(velox, f"{key}_bytes")
    assert ns.State is m.state_type is getattr(velox, m.state_type.__name__)
    for name in (key, f"{key}_init", f"{key}_update", f"{key}_get_kv", f"{key}_bytes",
                 m.state_type.__name__):
        assert name in velox.__all__


def test_exports_are_static_and_current():
    source = (ROOT / "velox" / "__init__.py").read_text()
    assert "globals()" not in source
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_exports.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, "velox/__init__.py drifted: run python scripts/update_exports.py\n" + out.stdout


def test_init_validates_through_the_wrapper():
    with pytest.raises(ValueError, match="budget"):
        velox.tova.init(1, 2, 8, budget=0)
    with pytest.raises(ValueError, match="integer"):
        velox.tova.init(1, 2, 8, budget=8.0)
    st = velox.tova.init(1, 2, 8, budget=np_int(16))
    assert type(st.budget) is int and st.backend in ("mlx", "cuda")
    with pytest.raises(TypeError):
        velox.tova.init(1, 2, 8, bogus=1)


def np_int(x):
    import numpy as np
    return np.int64(x)
