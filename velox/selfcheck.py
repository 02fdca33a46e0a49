"""The parity self-check of the ``metal`` backend: its kernels against the ``mlx`` ops, on the
machine that is to run them.

The Metal kernels (``velox.kernels``, rendered by ``velox.kernels.dialect``) are generated,
syntax- and type-checked on Linux (``tests/test_metal_sources.py``), but this project has run
none of them on Apple hardware. So ``backend="metal"`` is opt-in until proven where it runs:
its first use in a process runs :func:`run_checks` (a few decode steps of every kernel beside
the ``mlx`` ops on the same device: positions exact, rows within the method's tolerance) and
raises :class:`velox.backend.BackendUnavailable` saying what disagreed, or that Metal is
absent. The verdict is kept per MLX version, device name and kernel sources in
``$XDG_CACHE_HOME/velox/metal-selfcheck.json`` (``~/.cache/velox/``): ``backend="auto"``
picks ``metal`` only where that check has passed, and the codec and KIVI decode kernels run on
an Apple GPU only there. ``velox selftest --backend metal`` runs the checks and prints a report
to send back (:meth:`Report.text`).

The machinery takes its kernel builder and its device check as arguments (the tests run it
with stand-in kernels that agree, disagree or fail to build); every kernel launch of
``velox.kernels`` goes through the builder while the checks run.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import tempfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from . import backend as _backend

__all__ = ["Check", "Result", "Report", "Device", "metal_device", "metal_build", "run_checks",
           "metal_checks", "ensure_metal", "record", "metal_verified", "cached_verdict", "cache_path",
           "mlx_only", "KernelBuildError"]

CACHE_FILE = "metal-selfcheck.json"


class KernelBuildError(RuntimeError):
    """A kernel the builder could not build."""


@dataclass(frozen=True)
class Device:
    """What the device check says: whether the backend's device is there, its name, and why
    not when it is not."""

    available: bool
    name: str
    why: str = ""


@dataclass(frozen=True)
class Check:
    """One parity check: ``run()`` runs a kernel path and its ``mlx`` reference on the same
    inputs and returns ``(max_error, problem)``: the largest absolute difference of the
    compared float arrays (``nan`` where none was compared) and what disagreed, ``None``
    where everything agreed within ``tolerance`` (its description, for the report)."""

    name: str
    run: Callable[[], tuple[float, str | None]]
    tolerance: str = ""


@dataclass
class Result:
    """A check's outcome: passed, its max error, what failed, the kernels it launched."""

    name: str
    passed: bool
    max_error: float
    tolerance: str
    detail: str = ""
    kernels: tuple[str, ...] = ()


@dataclass
class Report:
    """Every check's result on one device, with the MLX version and device name."""

    backend: str
    mlx_version: str
    device: str
    available: bool
    why: str = ""
    results: list[Result] = field(default_factory=list)
    checked_at: str = ""

    @property
    def passed(self) -> bool:
        return self.available and bool(self.results) and all(r.passed for r in self.results)

    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.passed]

    def kernels(self) -> dict[str, bool]:
        """Every kernel launched, and whether each check that launched it passed."""
        out: dict[str, bool] = {}
        for r in self.results:
            for k in r.kernels:
                out[k] = out.get(k, True) and r.passed
        return out

    def summary(self) -> str:
        """One line: passed, or which checks failed and why."""
        head = f"{self.backend} kernels on {self.device} (MLX {self.mlx_version})"
        if not self.available:
            return f"{head}: not available: {self.why}"
        if self.passed:
            return f"{head}: all {len(self.results)} checks passed"
        bad = "; ".join(f"{r.name}: {r.detail}" for r in self.failures())
        return f"{head}: {len(self.failures())} of {len(self.results)} checks failed: {bad}"

    def text(self) -> str:
        """The report a user can send back: versions, device, each check and kernel."""
        lines = [f"velox self-check of the {self.backend} backend",
                 f"  MLX {self.mlx_version}, device: {self.device}, checked {self.checked_at}",
                 f"  velox kernel sources: {kernel_fingerprint()}"]
        if not self.available:
            lines.append(f"  NOT AVAILABLE: {self.why}")
            return "\n".join(lines) + "\n"
        lines.append("  checks:")
        for r in self.results:
            err = "-" if r.max_error != r.max_error else f"{r.max_error:.3g}"
            lines.append(f"    {'PASS' if r.passed else 'FAIL'}  {r.name:<34} max error {err:>9}"
                         f"  ({r.tolerance})" + (f"\n          {r.detail}" if r.detail else ""))
        lines.append("  kernels:")
        for k, ok in sorted(self.kernels().items()):
            lines.append(f"    {'PASS' if ok else 'FAIL'}  {k}")
        lines.append(f"  verdict: {'PASSED' if self.passed else 'FAILED'}")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"backend": self.backend, "mlx": self.mlx_version, "device": self.device,
                "available": self.available, "why": self.why, "passed": self.passed,
                "checked_at": self.checked_at,
                "results": [{"name": r.name, "passed": r.passed,
                             "max_error": None if r.max_error != r.max_error else r.max_error,
                             "tolerance": r.tolerance, "detail": r.detail, "kernels": list(r.kernels)}
                            for r in self.results]}


# --- the device, the builder, the cache ------------------------------------------------------

def metal_device() -> Device:
    """Whether MLX has a Metal device here, and its name."""
    if not mx.metal.is_available():
        return Device(False, "none", "MLX reports no Metal device here (it needs an Apple GPU)")
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return Device(True, str(info.get("device_name") or info.get("architecture") or "Apple GPU"))


def metal_build(spec: dict):
    """``mx.fast.metal_kernel`` of a Metal kernel spec (``velox.kernels.build``)."""
    from .kernels import build
    return build(spec, "metal")


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/velox/metal-selfcheck.json``, else ``~/.cache/velox/...``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "velox" / CACHE_FILE


@lru_cache(maxsize=1)
def kernel_fingerprint() -> str:
    """A hash of the kernel modules' sources: a new velox's kernels are checked again."""
    from .kernels import codec, dialect, evict, kivi, merge
    h = hashlib.sha256()
    for mod in (dialect, evict, kivi, codec, merge):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


def _key(device: str) -> str:
    return f"mlx {mx.__version__} | {device} | kernels {kernel_fingerprint()}"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) and isinstance(data.get("entries"), dict) else {"entries": {}}
    except (OSError, ValueError):
        return {"entries": {}}


def _write_cache(path: Path, report: Report) -> None:
    """Record ``report``'s verdict under its key (atomically; a cache that cannot be written
    is left alone: the check then runs again in the next process)."""
    data = _read_cache(path)
    data["entries"][_key(report.device)] = {"passed": report.passed, "checked_at": report.checked_at,
                                           "summary": report.summary()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


# The verdicts of this process: {key: Report}.
_VERDICTS: dict[str, Report] = {}


def cached_verdict(device: Device | None = None, path: Path | None = None) -> bool | None:
    """The recorded verdict for this MLX, device and kernel sources: True, False, or None
    where none was recorded (this process's own first)."""
    device = device or metal_device()
    if not device.available:
        return False
    key = _key(device.name)
    if key in _VERDICTS:
        return _VERDICTS[key].passed
    entry = _read_cache(path or cache_path())["entries"].get(key)
    return None if not isinstance(entry, dict) else bool(entry.get("passed"))


@lru_cache(maxsize=1)
def _verified_here() -> bool:
    """:func:`metal_verified`, read once per process (:func:`ensure_metal` clears it)."""
    dev = metal_device()
    return dev.available and bool(cached_verdict(dev))


def metal_verified() -> bool:
    """Whether the Metal kernels passed the self-check for this MLX, device and kernel sources
    (in this process or recorded in the cache): what ``backend="auto"`` and the codec and KIVI
    decode kernels require on an Apple GPU."""
    return _verified_here()


def ensure_metal(*, checks: Iterable[Check] | None = None, build: Callable | None = None,
                 device: Callable[[], Device] | None = None, path: Path | None = None) -> Report:
    """The first use of ``backend="metal"`` in a process: run the self-check (once per
    process and device; ``checks``, ``build`` and ``device`` default to the real ones),
    record its verdict in the cache, and raise :class:`velox.backend.BackendUnavailable` with
    what disagreed (or that Metal is absent) unless it passed. Returns the report."""
    BackendUnavailable = _backend.BackendUnavailable
    dev = (device or metal_device)()
    if not dev.available:
        raise BackendUnavailable(f"backend 'metal' is not available: {dev.why}")
    report = _VERDICTS.get(_key(dev.name))
    if report is None:
        report = run_checks(checks, build=build, device=lambda: dev)
        record(report, path)
    if not report.passed:
        raise BackendUnavailable(
            f"backend 'metal' failed its parity self-check on {dev.name} (MLX {mx.__version__}), "
            f"so it stays off here: " + "; ".join(f"{r.name}: {r.detail}" for r in report.failures())
            + ". `velox selftest --backend metal` prints the full report; backend='mlx' runs everywhere.")
    return report


def record(report: Report, path: Path | None = None) -> None:
    """Keep ``report``'s verdict for this process and in the cache (``velox selftest``'s
    runs count as a first use's)."""
    _VERDICTS[_key(report.device)] = report
    _write_cache(path or cache_path(), report)
    _verified_here.cache_clear()


# --- running checks --------------------------------------------------------------------------

@contextlib.contextmanager
def _launches_through(build: Callable, launched: list[str]):
    """Every kernel launch of ``velox.kernels`` (evict, merge, codec, KIVI) built by
    ``build`` from its Metal spec for as long as the context lasts, each kernel built once;
    the kernels launched are appended to ``launched``."""
    from .kernels import codec as ck
    from .kernels import evict as ev
    from .kernels import kivi as kk
    from .kernels import merge as mg
    from .kernels.dialect import METAL
    built: dict[str, Any] = {}

    def launch(spec, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
        name = spec["name"]
        if name not in launched:
            launched.append(name)
        if name not in built:
            try:
                built[name] = build(spec)
            except Exception as e:  # noqa: BLE001 (reported as the check's failure)
                raise KernelBuildError(f"{name} did not build: {type(e).__name__}: {e}") from e
        return built[name](inputs=inputs, grid=grid, threadgroup=threadgroup,
                           output_shapes=output_shapes, output_dtypes=output_dtypes,
                           template=template)

    def evict_run(variant, *args):
        return launch(ev._spec(variant, METAL), *args)

    def merge_run(which, *args):
        return launch(mg._spec(which, METAL), *args)

    def codec_run(codec, values, *args):
        spec = ck.merge_spec(dialect=METAL) if codec is None else ck.split_spec(codec, values, dialect=METAL)
        return launch(spec, *args)

    def kivi_run(codec, values, *args):
        spec = ck.merge_spec(dialect=METAL) if codec is None else kk.split_spec(codec == "kivi+append",
                                                                                 dialect=METAL)
        return launch(spec, *args)

    saved = [(m, m._run_kernel) for m in (ev, mg, ck, kk)]
    ev._run_kernel, mg._run_kernel, ck._run_kernel, kk._run_kernel = evict_run, merge_run, codec_run, kivi_run
    try:
        yield
    finally:
        for m, fn in saved:
            m._run_kernel = fn


_MLX_ONLY = [0]


@contextlib.contextmanager
def mlx_only():
    """The kernel paths of the ``mlx`` backends (codec and KIVI decode kernels, the fill
    step's attention) off while the context lasts: a check's reference is MLX ops."""
    _MLX_ONLY[0] += 1
    try:
        yield
    finally:
        _MLX_ONLY[0] -= 1


def reference_only() -> bool:
    """Whether :func:`mlx_only` is in force."""
    return _MLX_ONLY[0] > 0


def run_checks(checks: Iterable[Check] | None = None, *, build: Callable | None = None,
               device: Callable[[], Device] | None = None) -> Report:
    """Run ``checks`` (default :func:`metal_checks`) with every kernel built by ``build``
    (default ``mx.fast.metal_kernel``) on the device ``device()`` reports (default
    :func:`metal_device`): a :class:`Report`. Nothing runs where the device is absent."""
    dev = (device or metal_device)()
    report = Report("metal", mx.__version__, dev.name, dev.available, dev.why,
                    checked_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    if not dev.available:
        return report
    build = build or metal_build
    for check in (metal_checks() if checks is None else checks):
        launched: list[str] = []
        try:
            with _launches_through(build, launched):
                err, problem = check.run()
        except KernelBuildError as e:
            err, problem = float("nan"), str(e)
        except Exception as e:  # noqa: BLE001 (a check that errs fails, with the error)
            first = (str(e).strip().splitlines() or [""])[0]
            err, problem = float("nan"), f"error: {type(e).__name__}: {first}"
        if problem is None and not launched:
            problem = "no kernel ran: the check did not reach the kernel path"
        report.results.append(Result(check.name, problem is None, float(err), check.tolerance,
                                     problem or "", tuple(launched)))
    return report


# --- the checks ------------------------------------------------------------------------------

def _np(x) -> np.ndarray:
    return np.array(x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x)


class _Compare:
    """Comparisons of one check: the largest absolute difference seen, the first problem."""

    def __init__(self):
        self.err = float("nan")
        self.problem: str | None = None

    def exact(self, what: str, got, want) -> None:
        a, b = _np(got), _np(want)
        if a.shape != b.shape:
            self._fail(f"{what}: shape {a.shape}, expected {b.shape}")
            return
        floats = a.dtype.kind == "f" or b.dtype.kind == "f"
        same = (a == b) | (np.isnan(a) & np.isnan(b)) if floats else a == b
        if not same.all():
            i = tuple(np.argwhere(~same)[0])
            self._fail(f"{what} differ at {int((~same).sum())} places (first at {i}: {a[i]} vs {b[i]})")
        if floats and a.size:
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            self._err(float(np.nanmax(np.where(same, 0.0, diff))))

    def close(self, what: str, got, want, rtol: float, atol: float) -> None:
        a, b = _np(got).astype(np.float64), _np(want).astype(np.float64)
        if a.shape != b.shape:
            self._fail(f"{what}: shape {a.shape}, expected {b.shape}")
            return
        same_nan = np.isnan(a) == np.isnan(b)
        diff = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
        if a.size:
            self._err(float(np.nanmax(diff)))
        bad = ~same_nan | (diff > atol + rtol * np.abs(b))
        if bad.any():
            i = tuple(np.argwhere(bad)[0])
            self._fail(f"{what}: {int(bad.sum())} elements beyond atol {atol:g} + rtol {rtol:g} "
                       f"(first at {i}: {a[i]:.6g} vs {b[i]:.6g})")

    def _err(self, e: float) -> None:
        self.err = e if self.err != self.err else max(self.err, e)

    def _fail(self, problem: str) -> None:
        if self.problem is None:
            self.problem = problem

    def result(self) -> tuple[float, str | None]:
        return self.err, self.problem


def _arr(rng, *shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# the per-token data each eviction method carries beside its rows
_CARRIED = {"kvzip": ("importance",), "morphkv": ("profiles",), "cam": ("scores", "key_norms")}
_MERGED_RTOL = 2e-5  # CaM's merged rows in float32 (tests/test_kernels.py: MERGED_RTOL)


def _compare_states(c: _Compare, key: str, got, want, step: int) -> None:
    """Positions and the next position exactly; rows exactly (CaM's merged rows and carried
    data within float32 rounding); carried scores within float32 rounding."""
    what = f"{key} step {step}"
    c.exact(f"{what} positions", got.positions, want.positions)
    c.exact(f"{what} next_pos", got.next_pos, want.next_pos)
    merged = key == "cam"
    for f in ("keys", "values"):
        if merged:
            c.close(f"{what} {f}", getattr(got, f), getattr(want, f), _MERGED_RTOL, _MERGED_RTOL)
        else:
            c.exact(f"{what} {f}", getattr(got, f), getattr(want, f))
    for f in _CARRIED.get(key, ("scores",)):
        if f in got._fields and isinstance(getattr(got, f), mx.array):
            tol = (_MERGED_RTOL, _MERGED_RTOL) if merged else (2e-5, 1e-6)
            c.close(f"{what} {f}", getattr(got, f), getattr(want, f), *tol)


def _decode_steps(key: str, params: dict, *, b=1, h=2, g=2, d=64, prefill=30, steps=6):
    """``steps`` decode steps of ``key``'s ``metal`` backend (its kernels at a full cache)
    beside its ``mlx`` backend, after a prefill past the budget: states compared each step."""
    def run():
        from .registry import get_method
        m = get_method(key)
        rng = np.random.default_rng(zlib.crc32(key.encode()))
        ref = m.init(b, h, d, dtype=mx.float32, backend="mlx", **params)
        got = ref._replace(backend="metal")
        c = _Compare()
        for step in range(steps + 1):
            n = prefill if step == 0 else 1
            k, v, q = _arr(rng, b, h, n, d), _arr(rng, b, h, n, d), _arr(rng, b, h * g, n, d)
            with mlx_only():
                ref = m.update(ref, k, v, queries=q)
            got = m.update(got, k, v, queries=q)
            mx.eval(ref, got)
            _compare_states(c, key, got, ref, step)
            if c.problem:
                break
        return c.result()
    return run


def _fused_steps(key: str, params: dict, *, b=1, h=2, g=2, d=64, prefill=30, steps=5):
    """The adapter's fused decode step on the ``metal`` backend (``with_attention``: the
    output from the kernel that scores, the selection in the same launches) against MLX's
    attention over stored + new and the ``mlx`` backend's update."""
    def run():
        from . import decode
        from .registry import get_method
        m = get_method(key)
        rng = np.random.default_rng(zlib.crc32(repr(("fused", key)).encode()))
        st = m.init(b, h, d, dtype=mx.float32, backend="mlx", **params)
        st = m.update(st, _arr(rng, b, h, prefill, d), _arr(rng, b, h, prefill, d),
                      queries=_arr(rng, b, h * g, prefill, d))
        c = _Compare()
        for step in range(steps):
            q, k, v = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
            done = m.backends["metal"].with_attention(st._replace(backend="metal"), k, v, q)
            if done is None:
                return float("nan"), f"{key}: the fused step did not take a full decode step"
            out, new, move = done
            new = decode.write_row(new, (move.slot, *move.rows))._replace(backend="mlx")
            with mlx_only():
                want = mx.fast.scaled_dot_product_attention(
                    q, mx.concatenate([st.keys, k], axis=2), mx.concatenate([st.values, v], axis=2),
                    scale=d ** -0.5)
                plain = m.update(st, k, v, queries=q)
            mx.eval(out, new, want, plain)
            c.close(f"{key} step {step} output", out, want, 2e-5, 2e-5)
            _compare_states(c, key, new, plain, step)
            if c.problem:
                break
            st = plain
        return c.result()
    return run


def _attend_weights_check():
    """``attend_weights`` over several chunks (its two kernels): the output against MLX's
    attention over stored + new, the weights and H2O's decayed scores against MLX ops."""
    def run():
        from .attention import candidate_weights, scoring_queries
        from .kernels import evict as ev
        b, h, g, d, n = 1, 2, 3, 64, 2100
        rng = np.random.default_rng(11)
        q, k, v = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, n, d), _arr(rng, b, h, n, d)
        kn, vn = _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
        old = mx.array(rng.random((b, h, n)).astype(np.float32))
        out, w, scores = ev.attend_weights(q, k, v, kn, vn, old=old, accumulate="decay", decay=0.9)
        with mlx_only():
            want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k, kn], axis=2),
                                                        mx.concatenate([v, vn], axis=2), scale=d ** -0.5)
            ref_w = candidate_weights(scoring_queries(kn, q)[:, :, :, -1:], k, kn)[:, :, :, 0].mean(axis=2)
            ref_s = mx.concatenate([old * 0.9, mx.zeros((b, h, 1))], axis=2) + ref_w
        c = _Compare()
        c.close("output", out, want, 2e-5, 2e-5)
        c.close("weights", w, ref_w, 1e-5, 1e-7)
        c.close("decayed scores", scores, ref_s, 1e-5, 1e-7)
        return c.result()
    return run


def _select_check():
    """``select`` (the loser, the slot's row, positions, carried scores) given TOVA's ``mlx``
    scores, against the ``mlx`` slot step, over a few steps (slots out of position order)."""
    def run():
        from .kernels import evict as ev
        from .methods import tova
        from .registry import get_method
        m = get_method("tova")
        b, h, g, d = 1, 2, 2, 64
        rng = np.random.default_rng(12)
        st = m.init(b, h, d, backend="mlx", budget=24, n_sink=3, per_head=True)
        st = m.update(st, _arr(rng, b, h, 30, d), _arr(rng, b, h, 30, d), queries=_arr(rng, b, h * g, 30, d))
        c = _Compare()
        for step in range(5):
            k, v, q = _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h * g, 1, d)
            with mlx_only():
                by = tova._score(st, k, v, q, True)
                new, move = m.backends["mlx"].with_move(st, k, v, q)
            slot, rk, rv, pos, _ = ev.select(by, st.positions, st.next_pos, st.keys, st.values, k, v,
                                             n_sink=3, recent=0, shared=False)
            written = [mx.take_along_axis(getattr(new, f), move.slot[..., None], axis=2) for f in ("keys", "values")]
            c.exact(f"step {step} slot", slot, move.slot)
            c.exact(f"step {step} row keys", rk, written[0])
            c.exact(f"step {step} row values", rv, written[1])
            c.exact(f"step {step} positions", pos, new.positions)
            if c.problem:
                break
            st = new
        return c.result()
    return run


def _attend_check():
    """``attend``, a decode step's attention alone over a buffer's filled prefix (one chunk, and
    chunks combined by a second launch) against MLX's attention."""
    def run():
        from .kernels import evict as ev
        c = _Compare()
        for b, h, g, d, n, rows in ((1, 2, 2, 64, 40, 33), (1, 2, 2, 64, 4300, 4200)):
            rng = np.random.default_rng(n)
            q, kn, vn = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
            k, v = _arr(rng, b, h, n, d), _arr(rng, b, h, n, d)
            out = ev.attend(q, k, v, kn, vn, rows=rows)
            with mlx_only():
                want = mx.fast.scaled_dot_product_attention(
                    q, mx.concatenate([k[:, :, :rows], kn], axis=2),
                    mx.concatenate([v[:, :, :rows], vn], axis=2), scale=d ** -0.5)
            c.close(f"{rows} rows", out, want, 2e-5, 2e-5)
        return c.result()
    return run


def _kivi_check():
    """KIVI's decode step (its split kernel with the residual append, and the merge kernel)
    against ``kivi.attend``'s MLX path in float32 and the residual window appended."""
    def run():
        from .kernels import kivi as kk
        from .methods import kivi
        b, h, g, d = 1, 2, 2, 64
        rng = np.random.default_rng(13)
        st = kivi.init(b, h, d, backend="mlx", bits=4, group_size=32, residual_length=32)
        st = kivi.update(st, _arr(rng, b, h, 80, d), _arr(rng, b, h, 80, d))
        c = _Compare()
        for step in range(3):
            q, k, v = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
            out, rk, rv, nxt = kk.decode_step(st, q, k, v, scale=d ** -0.5)
            with mlx_only():
                want = kivi.attend(st, q, k, v, scale=d ** -0.5)
            atol, rtol = kk.TOLERANCE[mx.float32]
            c.close(f"step {step} output", out, want, rtol, atol)
            rd = st.residual_keys.dtype
            c.exact(f"step {step} residual keys", rk, mx.concatenate([st.residual_keys, k.astype(rd)], axis=2))
            c.exact(f"step {step} residual values", rv, mx.concatenate([st.residual_values, v.astype(rd)], axis=2))
            c.exact(f"step {step} next_pos", nxt, st.next_pos + 1)
            if c.problem:
                break
            st = kivi.update(st, k, v)
        return c.result()
    return run


def _codec_check(key: str, params: dict):
    """The attention decode step on a codec's key codes (split and merge kernels) against
    ``velox.codec_cache.attend``'s MLX path."""
    def run():
        import velox
        from . import codec_cache
        from .kernels import codec as ck
        b, h, g, d = 1, 2, 2, 64
        rng = np.random.default_rng(zlib.crc32(key.encode()))
        st = velox.init(key, b, h, d, dtype=mx.float32, **params)
        st = velox.update(st, _arr(rng, b, h, 150, d), _arr(rng, b, h, 150, d))
        c = _Compare()
        q, k, v = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
        if ck._layout(st, q) is None:
            return float("nan"), f"{key}: the kernels do not take this state"
        out = ck.decode_attend(st, q, k, v, scale=d ** -0.5)
        with mlx_only():
            want = codec_cache.attend(st, q, k, v, scale=d ** -0.5)
        atol, rtol = ck.TOLERANCE[mx.float32]
        c.close(f"{key} output", out, want, rtol, atol)
        return c.result()
    return run


def metal_checks() -> list[Check]:
    """The real checks: every kernel of ``velox.kernels`` on a few decode steps against the
    ``mlx`` ops on the same device (float32)."""
    evict_tol = "positions and rows exact, scores rtol 2e-5"
    out_tol = "output rtol 2e-5, positions and rows exact"
    return [
        Check("weights: H2O decode steps", _decode_steps("h2o", dict(budget=24, n_sink=3, grace=5, decay=0.95)),
              evict_tol),
        Check("weights: Keyformer's noise", _decode_steps("keyformer", dict(
            budget=24, n_sink=3, recent=5, tau_init=1.0, tau_end=0.25, anneal_steps=40, decay=0.95, seed=3)),
              evict_tol),
        Check("weights: KVzip's maximum", _decode_steps("kvzip", dict(budget=24, n_sink=3, probe="context")),
              evict_tol),
        Check("weights: MorphKV's votes", _decode_steps("morphkv", dict(budget=24, n_sink=3, window=4)),
              evict_tol),
        Check("compact: ChunkKV decode steps", _decode_steps("chunkkv", dict(
            budget=24, chunk_size=4, n_sink=3, grace=5, decay=0.95)), evict_tol),
        Check("merge: CaM decode steps", _decode_steps("cam", dict(
            budget=24, n_sink=3, grace=5, decay=0.95, seed=5, merge="sim_weighted", merge_keys=True)),
              "positions exact, merged rows and scores rtol 2e-5"),
        Check("attend_weights (two kernels)", _attend_weights_check(), "output rtol 2e-5, weights 1e-5"),
        Check("select", _select_check(), "slot, row and positions exact"),
        Check("attend_select: TOVA fused step", _fused_steps("tova", dict(budget=24, n_sink=3)), out_tol),
        Check("attend_select: H2O fused step", _fused_steps("h2o", dict(budget=24, n_sink=3, grace=5,
                                                                        decay=0.95)), out_tol),
        Check("attend (fill step)", _attend_check(), "output rtol 2e-5"),
        Check("KIVI decode step", _kivi_check(), "output within kivi.TOLERANCE, residual exact"),
        Check("codec: TurboQuant keys", _codec_check("turboquant_mse", dict(bits=3)),
              "output within codec.TOLERANCE"),
        Check("codec: QJL keys", _codec_check("qjl", {}), "output within codec.TOLERANCE"),
    ]


#: What ``velox.backend`` asks of the ``metal`` backend (installed by ``velox/__init__``):
#: each call reads this module's function at the time, so a stand-in put in its place counts.
PROOF = _backend.MetalProof(verified=lambda: metal_verified(),
                            reference_only=lambda: reference_only(),
                            ensure=lambda: ensure_metal())
