"""Backends are typed records (``velox.backend.Backend``), a score-and-keep method's CUDA
scores a ``velox.evict.ScoreKernel``: nothing the decode step reads hangs on a function."""

import ast
from pathlib import Path

import mlx.core as mx
import pytest

import velox
from velox import evict
from velox.backend import Backend
from velox.registry import register_backend

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("with_move", "with_attention", "fill", "fill_attention", "steady_step", "ragged",
         "slots", "logits_only", "skeleton", "attends", "select_args")


def test_every_registered_backend_is_a_record():
    for key in velox.method_keys():
        for name, b in velox.get_method(key).backends.items():
            assert isinstance(b, Backend), (key, name, type(b))
            assert callable(b.update)


def test_a_plain_update_is_wrapped_into_a_record_offering_nothing_else():
    def update(state, keys, values, queries):
        return state

    b = Backend.of(update)
    assert b.update is update and Backend.of(b) is b
    assert (b.with_move, b.fill, b.steady_step, b.ragged, b.skeleton) == (None,) * 5
    assert not b.slots and not b.logits_only
    assert b("s", None, None) == "s"  # callable as its update


def test_bad_records_are_refused_at_construction():
    with pytest.raises(TypeError, match="update"):
        Backend(None)
    with pytest.raises(TypeError, match="fill"):
        Backend(lambda *a: None, fill=3)
    with pytest.raises(TypeError):
        Backend(lambda *a: None, fil=lambda *a: None)  # a misspelt part
    with pytest.raises(TypeError, match="Backend"):
        Backend.of("mlx")
    b = Backend(lambda *a: None)
    with pytest.raises(AttributeError):
        b.fill = lambda *a: None  # frozen: a record, not a bag of attributes


def test_register_backend_wraps_a_function(monkeypatch):
    m = velox.get_method("kivi")
    monkeypatch.setitem(m.backends, "metal", m.backends["mlx"])  # restored after the test

    def update(state, keys, values, queries):
        return m.backends["mlx"].update(state, keys, values, queries)

    register_backend("kivi", "metal", update)
    assert isinstance(m.backends["metal"], Backend) and m.backends["metal"].update is update


def test_score_and_keep_refuses_a_kernel_that_is_not_a_record():
    def inputs(state, keys, values, queries):
        return dict(drop=0)

    with pytest.raises(TypeError, match="ScoreKernel"):
        evict.score_and_keep(None, None, kernel=inputs)
    assert callable(evict.score_and_keep(None, None, kernel=evict.ScoreKernel(inputs)))


def test_the_parts_the_decode_step_reads_are_what_the_backends_offer():
    """TOVA's mlx backend fills empty slots and moves rows; H2O's carries scores (no fill);
    a codec cache's mlx backend steps in place into chunked storage."""
    tova, h2o = velox.get_method("tova").backends, velox.get_method("h2o").backends
    assert tova["mlx"].fill is not None and tova["mlx"].with_move is not None and tova["mlx"].slots
    assert tova["mlx"].logits_only and tova["reference"].logits_only
    assert tova["mlx"].skeleton is not None and tova["reference"].skeleton is None
    assert h2o["mlx"].fill is None and h2o["mlx"].ragged is not None
    tq = velox.get_method("turboquant_mse").backends
    assert tq["mlx"].steady_step is not None and tq["reference"].steady_step is None
    st = velox.init("tova", 1, 2, 8, budget=8)
    k = mx.zeros((1, 2, 3, 8))
    assert tova["mlx"](st, k, k, None).keys.shape[2] == 3


def _attribute_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """``name.part = ...`` statements whose part is one the decode step reads."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr in PARTS and isinstance(t.value, ast.Name):
                    out.append((node.lineno, f"{t.value.id}.{t.attr}"))
    return out


def test_no_decode_part_hangs_on_a_function():
    """No module of the library sets a backend part as an attribute (``update.fill = ...``),
    nor reads one with ``getattr(<backend>, "<part>", ...)``."""
    found = []
    for folder in ("velox", "adapters", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            found += [f"{path.relative_to(ROOT)}:{n}: {w}" for n, w in _attribute_writes(tree)]
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in PARTS
                        and ast.unparse(node.args[0]) != "state"):  # a state's own ``ragged`` field
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}(..., "
                                 f"{node.args[1].value!r})")
    assert not found, "\n".join(found)
