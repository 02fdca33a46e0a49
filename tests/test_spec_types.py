"""Parameter types at the spec layer: integers are integers (no float twins, no bools), strings
are strings, NumPy scalars count as the Python scalars they hold; every spec, every parameter.
(Run without the test-time jaxtyping checks, to see what users get.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import velox
from velox.registry import get_method
from velox.spec import Param, spec_keys

KEYS = sorted(set(spec_keys()) | {k for k in velox.method_keys() if "+" in k})  # + compositions
CASES = [(key, name) for key in KEYS for name in get_method(key).spec.params]


def _kind(p: Param) -> str:
    if p.type != "choice":
        return p.type
    return "str" if isinstance(p.default, str) else "int"


def _wrong_types(p: Param) -> list:
    """Values of the wrong type that equal (or stand for) a valid value."""
    d, kind = p.default, _kind(p)
    if kind == "int":
        return [float(d), np.float64(d), bool(d) if d in (0, 1) else True, str(d)]
    if kind == "float":
        return [True, np.bool_(False), str(d), None]
    if kind == "bool":
        return [float(d), str(d).lower(), None]
    return [1, np.int64(0), d.encode(), None]


def _numpy_twin(p: Param):
    d = p.default
    return {"int": np.int64, "float": np.float64, "bool": np.bool_, "str": np.str_}[_kind(p)](d)


def _init(key: str, **params):
    return velox.init(key, 1, 2, 32, dtype=mx.float32, backend="mlx", **params)


@pytest.mark.parametrize("key,name", CASES)
def test_wrong_types_are_refused_naming_the_parameter(key, name, no_shape_checks):
    p = get_method(key).spec.params[name]
    for bad in _wrong_types(p):
        with pytest.raises(ValueError, match=name):
            p.check(bad)
        with pytest.raises(ValueError, match=name):
            _init(key, **{name: bad})


@pytest.mark.parametrize("key,name", CASES)
def test_numpy_scalars_give_the_state_python_scalars_give(key, name, no_shape_checks):
    p = get_method(key).spec.params[name]
    twin = _numpy_twin(p)
    got = p.check(twin)
    assert type(got) is type(p.check(p.default)) and got == p.default
    a, b = _init(key, **{name: twin}), _init(key, **{name: p.default})
    fa, fb = tree_flatten(a), tree_flatten(b)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        assert type(x) is type(y), f"{path}: {type(x).__name__} vs {type(y).__name__}"
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()
        else:
            assert x == y, path


def test_float_twins_of_int_choices_are_refused_with_the_allowed_values(no_shape_checks):
    with pytest.raises(ValueError, match=r"bits must be an integer, one of 2, 3, 4, 8; got 2.0"):
        velox.init("kivi_sink", 1, 2, 32, bits=2.0)
    with pytest.raises(ValueError, match="bits"):
        velox.init("kvquant", 1, 2, 32, bits=3.0)
    with pytest.raises(ValueError, match="bits_old"):
        velox.init("age_tiered", 1, 2, 32, bits_old=np.float32(2))


def test_the_rules_of_each_type():
    i = Param("budget", "int", 16, min=1)
    assert type(i.check(np.int32(16))) is int and i.check(np.uint8(3)) == 3
    for bad in (16.0, True, np.bool_(True), "16", mx.array(16)):
        with pytest.raises(ValueError, match="budget must be an integer"):
            i.check(bad)
    with pytest.raises(ValueError, match=r"budget=0 is out of range: must be >= 1"):
        i.check(np.int64(0))
    f = Param("decay", "float", 0.5, min=0.0, max=1.0)
    assert type(f.check(np.float32(0.25))) is float and f.check(1) == 1.0
    for bad in (float("nan"), np.float64("inf")):
        with pytest.raises(ValueError, match="decay must be finite"):
            f.check(bad)
    b = Param("per_head", "bool", False)
    assert b.check(np.bool_(True)) is True and b.check(0) is False and b.check(np.int64(1)) is True
    for bad in (2, 1.0, "True"):
        with pytest.raises(ValueError, match="per_head must be a bool"):
            b.check(bad)
    c = Param("sign", "choice", 1, choices=(1, -1))
    assert c.check(np.int8(-1)) == -1 and type(c.check(np.int8(-1))) is int
    with pytest.raises(ValueError, match=r"sign must be an integer, one of 1, -1; got True"):
        c.check(True)
    with pytest.raises(ValueError, match=r"sign=2 is not one of 1, -1"):
        c.check(2)
    s = Param("pooling", "choice", "avgpool", choices=("avgpool", "maxpool"))
    assert s.check(np.str_("maxpool")) == "maxpool" and type(s.check(np.str_("maxpool"))) is str
    with pytest.raises(ValueError, match="pooling must be a string"):
        s.check(0)
