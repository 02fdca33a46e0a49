"""Method specs: the data file of each method (paper, parameters, invariants, tolerances).

A spec is a TOML file in ``velox/specs/<key>.toml`` read together with the method's ``init``.
The ``init`` signature is the one source of each parameter's name, type (its annotation:
``int``, ``float``, ``bool``, or ``str`` for a choice) and default, and its ``Args:``
docstring of the parameter's doc. The file says what Python cannot: each parameter's valid
range or choices and the range property tests draw from (``[params.<name>]``), constraints
relating parameters (``"budget > n_sink"``), the ``[contract]`` invariants, tolerances, the
paper, presets and the deviations from it.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .registered import _REGISTRY

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Param", "Spec", "load_spec", "read_spec", "spec_from_file", "spec_keys", "validate_params", "evaluate",
           "method_table", "init_params", "param_fields", "args_section"]

_TYPES = ("int", "float", "bool", "choice")


@dataclass(frozen=True)
class Param:
    """One method parameter: type, default, valid range and the range tests draw from."""

    name: str
    type: str
    default: Any
    doc: str = ""
    min: int | float | None = None
    max: int | float | None = None
    min_exclusive: bool = False
    max_exclusive: bool = False
    choices: tuple = ()
    test_min: int | float | None = None
    test_max: int | float | None = None
    test_choices: tuple = ()
    seed_name: str | None = None

    def check(self, value: Any) -> Any:
        """Return ``value`` as the parameter's Python type, or raise ``ValueError``.

        * ``int`` and a ``choice`` of ints take integers only: Python ``int`` or a NumPy
          integer (returned as ``int``). Floats are refused, ``16.0`` included, and so are
          bools (``True`` is not ``1``).
        * ``float`` takes Python or NumPy ints and floats (returned as a finite ``float``).
        * ``bool`` takes ``bool``, ``np.bool_`` and the integers ``0`` and ``1``.
        * A ``choice`` of strings takes ``str`` only.

        The error names the parameter and what it allows.
        """
        n = self.name
        if self.type == "bool":
            if isinstance(value, (bool, np.bool_)):
                return bool(value)
            if _is_integer(value) and value in (0, 1):
                return bool(value)
            raise ValueError(f"{n} must be a bool, got {value!r}")
        if self.type == "choice":
            return self._check_choice(value)
        if self.type == "int":
            if not _is_integer(value):
                raise ValueError(f"{n} must be an integer, got {value!r} ({type(value).__name__})")
            value = int(value)
        else:
            if not (_is_integer(value) or isinstance(value, (float, np.floating))):
                raise ValueError(f"{n} must be a number, got {value!r} ({type(value).__name__})")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{n} must be finite, got {value!r}")
        if self.min is not None:
            if value < self.min or (self.min_exclusive and value == self.min):
                op = ">" if self.min_exclusive else ">="
                raise ValueError(f"{n}={value!r} is out of range: must be {op} {_fmt(self.min)}")
        if self.max is not None:
            if value > self.max or (self.max_exclusive and value == self.max):
                op = "<" if self.max_exclusive else "<="
                raise ValueError(f"{n}={value!r} is out of range: must be {op} {_fmt(self.max)}")
        return value

    def _check_choice(self, value: Any) -> Any:
        allowed = ", ".join(repr(c) for c in self.choices)
        if all(isinstance(c, str) for c in self.choices):
            kind, ok = "a string", isinstance(value, str)
        elif all(_is_integer(c) for c in self.choices):
            kind, ok = "an integer", _is_integer(value)
        else:  # float choices compare as numbers
            kind, ok = "a number", _is_integer(value) or isinstance(value, (float, np.floating))
        if not ok:
            raise ValueError(f"{self.name} must be {kind}, one of {allowed}; "
                             f"got {value!r} ({type(value).__name__})")
        for c in self.choices:
            if c == value:
                return c
        raise ValueError(f"{self.name}={value!r} is not one of {allowed}")


def _is_integer(x: Any) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class Spec:
    """Everything the library and its tests know about one method, read from its TOML file."""

    key: str
    name: str
    title: str
    arxiv: str
    venue: str
    family: str
    phases: str
    queries: str
    summary: str
    params: Mapping[str, Param]
    constraints: tuple[str, ...]
    contract: Mapping[str, Any]
    tolerance: Mapping[str, Any]
    deviations: tuple[str, ...]
    backends: tuple[str, ...] = field(default=("reference", "mlx"))
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    authors: str = ""
    compose: tuple[str, ...] = ()
    #: why the method holds no eviction policy's survivors (``velox.compose``), where it cannot
    compose_note: str = ""
    heads: str = "independent"
    heads_note: str = ""

    @property
    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params.values()}

    def capacity(self, params: Mapping[str, Any]) -> int | None:
        """Stored-token bound for these parameters, or ``None`` for unbounded methods."""
        expr = self.contract.get("capacity")
        return None if expr is None else int(evaluate(expr, params))


def _fmt(x: int | float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


# --- tiny safe expression evaluator for constraints ("budget > n_sink + grace") ---

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv, ast.Mod: operator.mod}
_CMPOPS = {ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Lt: operator.lt,
           ast.LtE: operator.le, ast.Eq: operator.eq, ast.NotEq: operator.ne}
_CMPSYM = {ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}


def _eval(node: ast.AST, env: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
        return _CMPOPS[type(node.ops[0])](_eval(node.left, env), _eval(node.comparators[0], env))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        fn = min if node.func.id == "min" else max
        return fn(*(_eval(a, env) for a in node.args))
    if isinstance(node, ast.BoolOp):
        vals = [_eval(v, env) for v in node.values]
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    raise ValueError(f"unsupported expression element: {ast.dump(node)}")


def evaluate(expr: str, env: Mapping[str, Any]) -> Any:
    """Evaluate an arithmetic/comparison expression over parameter names."""
    return _eval(ast.parse(expr, mode="eval"), env)


def _check_constraint(expr: str, env: Mapping[str, Any]) -> None:
    if evaluate(expr, env):
        return
    tree = ast.parse(expr, mode="eval").body
    if isinstance(tree, ast.Compare) and len(tree.ops) == 1:
        left, right = tree.left, tree.comparators[0]
        sym = _CMPSYM[type(tree.ops[0])]

        def show(node: ast.AST) -> str:
            text = ast.unparse(node)
            value = _eval(node, env)
            if isinstance(node, ast.Name):
                return f"{text}={value!r}"
            if isinstance(node, ast.Constant):
                return text
            names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)})
            parts = ", ".join(f"{k}={env[k]!r}" for k in names if k not in ("min", "max"))
            return f"{text} = {value!r} ({parts})"

        raise ValueError(f"{show(left)} must be {sym} {show(right)}")
    raise ValueError(f"parameters violate {expr!r}: " + ", ".join(f"{k}={v!r}" for k, v in env.items()))


def validate_params(spec: Spec, given: Mapping[str, Any],
                    dims: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Fill defaults, check types, ranges and constraints; return the full parameter dict.

    ``dims`` (``batch``, ``kv_heads``, ``head_dim``) may appear in constraints; constraints
    naming a dim are skipped when ``dims`` is not given.
    """
    unknown = sorted(set(given) - set(spec.params))
    if unknown:
        valid = ", ".join(spec.params)
        raise ValueError(f"{spec.key} got unknown parameter(s) {', '.join(unknown)}; valid: {valid}")
    out = {}
    for name, p in spec.params.items():
        out[name] = p.check(given[name]) if name in given else p.default
    env = {**out, **(dims or {})}
    for expr in spec.constraints:
        names = {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}
        if names <= set(env) | {"min", "max"}:
            _check_constraint(expr, env)
    return out


_TABLE_ONLY = {"min", "max", "min_exclusive", "max_exclusive", "choices", "test_min", "test_max",
               "test_choices", "seed_name"}
_ANNOTATIONS = {int: "int", float: "float", bool: "bool", str: "choice",
                "int": "int", "float": "float", "bool": "bool", "str": "choice"}
_NOT_PARAMS = ("batch", "kv_heads", "head_dim", "dtype", "backend", "heads")


_PY_TYPES = {"int": int, "float": float, "bool": bool, "str": str,
             int: int, float: float, bool: bool, str: str}


def param_fields(init: Callable) -> list[tuple[str, type]]:
    """``(name, Python type)`` of each method parameter of an ``init`` (its keyword-only
    parameters but ``dtype``, ``backend`` and ``heads``, in signature order): the static fields of a
    state record built from the signature."""
    return [(q.name, _PY_TYPES[q.annotation]) for q in inspect.signature(init).parameters.values()
            if q.kind is q.KEYWORD_ONLY and q.name not in _NOT_PARAMS]


def args_section(doc: str | None) -> dict[str, str]:
    """``name -> text`` of a Google-style ``Args:`` section (continuation lines joined)."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "Args:")
    except StopIteration:
        return out
    indent, name = None, None
    for ln in lines[start + 1:]:
        if not ln.strip():
            continue
        depth = len(ln) - len(ln.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        head, sep, text = ln.strip().partition(":")
        if depth == indent and sep and head.isidentifier():
            name = head
            out[name] = text.strip()
        elif name is not None:
            out[name] = (out[name] + " " + ln.strip()).strip()
    return out


def init_params(init: Callable) -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, doc)`` of each method parameter of an ``init`` function: its
    keyword-only parameters other than ``dtype``, ``backend`` and ``heads``, in signature
    order."""
    sig = inspect.signature(init)
    docs = args_section(init.__doc__)
    out = []
    for q in sig.parameters.values():
        if q.kind is not q.KEYWORD_ONLY or q.name in _NOT_PARAMS:
            continue
        kind = _ANNOTATIONS.get(q.annotation)
        if kind is None:
            raise ValueError(f"{init.__qualname__}: parameter {q.name} needs an int, float, bool "
                             f"or str annotation, got {q.annotation!r}")
        if q.default is q.empty:
            raise ValueError(f"{init.__qualname__}: parameter {q.name} needs a default")
        out.append((q.name, kind, q.default, docs.get(q.name, "")))
    return out


def _param(name: str, raw: Mapping[str, Any], declared: tuple[str, Any, str] | None) -> Param:
    if declared is None:  # a spec without an init (tests, tools): the table says it all
        declared = raw.get("type"), raw.get("default"), raw.get("doc", "")
    else:
        stray = sorted({"type", "default", "doc"} & set(raw))
        if stray:
            raise ValueError(f"parameter {name}: {', '.join(stray)} come(s) from the init "
                             f"signature and its Args, not the spec file")
    kind, default, doc = declared
    unknown = sorted(set(raw) - _TABLE_ONLY - {"type", "default", "doc"})
    if unknown:
        raise ValueError(f"parameter {name}: unknown field(s) {', '.join(unknown)}")
    if kind == "choice" and not raw.get("choices"):
        raise ValueError(f"parameter {name}: a str parameter needs `choices` in the spec file")
    if kind in ("int", "float") and raw.get("choices"):
        kind = "choice"
    if kind not in _TYPES:
        raise ValueError(f"parameter {name}: type must be one of {_TYPES}, got {kind!r}")
    return Param(
        name=name, type=kind, default=default, doc=doc,
        min=raw.get("min"), max=raw.get("max"),
        min_exclusive=raw.get("min_exclusive", False), max_exclusive=raw.get("max_exclusive", False),
        choices=tuple(raw.get("choices", ())), test_min=raw.get("test_min"),
        test_max=raw.get("test_max"), test_choices=tuple(raw.get("test_choices", ())),
        seed_name=raw.get("seed_name"),
    )


def parse_spec(data: Mapping[str, Any], init: Callable | None = None) -> Spec:
    """Build a :class:`Spec` from parsed TOML data and (when given) the method's ``init``,
    whose signature declares the parameters."""
    paper = data.get("paper", {})
    tables = data.get("params", {})
    if init is None:
        params = {k: _param(k, v, None) for k, v in tables.items()}
    else:
        declared = {n: (t, d, doc) for n, t, d, doc in init_params(init)}
        extra = sorted(set(tables) - set(declared))
        if extra:
            raise ValueError(f"spec {data['key']}: [params.{extra[0]}] is not a parameter of "
                             f"{init.__qualname__}")
        params = {k: _param(k, tables.get(k, {}), v) for k, v in declared.items()}
    return Spec(
        key=data["key"], name=data["name"], title=paper.get("title", ""),
        arxiv=paper.get("arxiv", ""), venue=paper.get("venue", ""), family=data["family"],
        phases=data["phases"], queries=data.get("queries", "no"), summary=data.get("summary", ""),
        params=params,
        constraints=tuple(data.get("constraints", ())), contract=dict(data.get("contract", {})),
        tolerance=dict(data.get("tolerance", {})), deviations=tuple(data.get("deviations", ())),
        backends=with_metal(tuple(data.get("backends", ("reference", "mlx")))),
        presets={k: dict(v) for k, v in data.get("presets", {}).items()},
        authors=paper.get("authors", ""),
        compose=tuple(data.get("compose", ())),
        compose_note=data.get("compose_note", ""),
        **_heads_fields(data),
    )


def _heads_fields(data: Mapping[str, Any]) -> dict[str, str]:
    """The spec's ``heads`` (how the method's decisions treat a layer's kv heads, one of
    ``velox.distributed.HEAD_KINDS``: what a tensor-parallel shard, holding some of them,
    needs) and ``heads_note`` (what crosses the heads; required unless ``independent``)."""
    from .distributed import HEAD_KINDS
    key, kind, note = data.get("key"), data.get("heads"), data.get("heads_note", "")
    if kind not in HEAD_KINDS:
        raise ValueError(f"spec {key}: heads={kind!r} must be one of {', '.join(HEAD_KINDS)} "
                         f"(whether a decision reduces over a layer's kv heads)")
    if kind != "independent" and not note:
        raise ValueError(f"spec {key}: heads={kind!r} needs heads_note (what crosses the kv heads)")
    return dict(heads=kind, heads_note=note)


def with_metal(backends: tuple[str, ...]) -> tuple[str, ...]:
    """``backends`` with ``metal`` after ``cuda``: every method with CUDA kernels has the
    ``metal`` backend built from the same kernel sources (``velox.kernels.dialect``), opt-in
    until its parity self-check passes on the machine (``velox.selfcheck``)."""
    if "cuda" in backends and "metal" not in backends:
        i = backends.index("cuda")
        return backends[:i + 1] + ("metal",) + backends[i + 1:]
    return backends


def spec_keys() -> tuple[str, ...]:
    """Keys of every spec file shipped with the package."""
    files = resources.files("velox.specs").iterdir()
    return tuple(sorted(f.name[:-5] for f in files if f.name.endswith(".toml")))


def read_spec(key: str, init: Callable | None = None) -> Spec:
    """Read ``velox/specs/<key>.toml`` with the parameters of ``init`` and check it: defaults
    valid, constraints hold at the defaults, presets valid."""
    path = resources.files("velox.specs") / f"{key}.toml"
    if not path.is_file():
        raise ValueError(f"no spec file for method {key!r}")
    spec = spec_from_file(path, init)
    if spec.key != key:
        raise ValueError(f"spec file {key}.toml declares key {spec.key!r}")
    return spec


def spec_from_file(path, init: Callable | None = None) -> Spec:
    """Read the spec file at ``path`` (a ``str``, ``pathlib.Path`` or resource) with the
    parameters of ``init`` and check it: defaults valid, constraints hold at the defaults,
    presets valid. A method of one's own passes the result to ``register(..., spec=...)``
    (docs/your-own-method.md)."""
    if isinstance(path, str):
        from pathlib import Path

        path = Path(path)
    spec = parse_spec(tomllib.loads(path.read_text(encoding="utf-8")), init)
    key = spec.key
    for p in spec.params.values():
        p.check(p.default)
    validate_params(spec, {})
    for name, preset in spec.presets.items():
        try:
            validate_params(spec, preset)
        except ValueError as e:
            raise ValueError(f"{key}.toml preset {name!r}: {e}") from None
    return spec


def load_spec(key: str) -> Spec:
    """The spec of method ``key`` (a registered method's, with its ``init`` parameters)."""
    method = _REGISTRY.get(key)
    if method is not None:
        return method.spec
    return _file_spec(key)


@lru_cache(maxsize=None)
def _file_spec(key: str) -> Spec:
    return read_spec(key)


def method_table(keys: tuple[str, ...] | None = None) -> str:
    """Markdown table of the methods: key, name, family, phases, queries, backends beyond
    ``reference`` and ``mlx``, batching, paper, parameters.

    Batching is how mlx-lm's batched generation (``batch_generate``, the server) runs the
    method's caches (``velox.adapters.batch``): ``per row`` is one batch-of-one state per
    sequence, which takes every method; ``joined`` (the methods whose spec declares
    ``contract.ragged``) is that, and the rows run as one batched state whenever they hold the
    same slot layout (e.g. every row's cache full at its budget); a spec may declare another
    way in its contract (``batching``)."""
    lines = ["| key | method | family | phases | queries | kernels | batching | paper "
             "| parameters (defaults) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in keys or spec_keys():
        s = load_spec(key)
        params = ", ".join(f"`{p.name}={p.default!r}`" for p in s.params.values())
        paper = f"[{s.arxiv}](https://arxiv.org/abs/{s.arxiv})" if s.arxiv else s.venue
        # (metal: every cuda method's twin, opt-in and self-checked: the README's backends section)
        kernels = ", ".join(b for b in s.backends if b not in ("reference", "mlx", "metal")) or "-"
        batching = s.contract.get("batching", "joined" if s.contract.get("ragged", False) else "per row")
        lines.append(f"| `{s.key}` | {s.name} | {s.family} | {s.phases} | {s.queries} | {kernels} "
                     f"| {batching} | {paper} | {params} |")
    return "\n".join(lines) + "\n"
