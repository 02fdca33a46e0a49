"""The parity self-check of the ``metal`` backend (``velox.selfcheck``), with stand-ins.

No Apple GPU is reachable here, so the machinery runs with stand-in kernels and a stand-in
device: a kernel that agrees with the ``mlx`` reference, one that disagrees, one that fails to
build, and no device at all. Each time: the outcome (``backend="metal"`` taken or refused with
``BackendUnavailable``), its message, the recorded verdict (``$XDG_CACHE_HOME/velox/``) and what
``backend="auto"`` then picks. Every launch goes through the module's launch function
(``velox.kernels.evict._run_kernel``), which the self-check routes to the builder it is given.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from velox import backend, selfcheck
from velox.backend import BackendUnavailable, resolve_backend
from velox.kernels import evict as ev

VARIANT = ("attend_out",)  # any kernel of velox.kernels.evict: the stand-ins compute 2 * x
SPEC_NAME = "velox_attend_out"
DEVICE = selfcheck.Device(True, "Stand-in GPU")


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """No verdict of this process; the cache under a temporary XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    selfcheck._verified_here.cache_clear()
    yield
    selfcheck._verified_here.cache_clear()


def _doubling_check(name="double"):
    """A check whose kernel path is one launch of VARIANT through the module's launcher, its
    reference ``2 * x`` in MLX ops."""
    def run():
        x = mx.arange(12, dtype=mx.float32).reshape(3, 4)
        (got,) = ev._run_kernel(VARIANT, [x], (128, 1, 1), (128, 1, 1), [x.shape], [mx.float32], [])
        c = selfcheck._Compare()
        c.close("doubled", got, 2 * x, 1e-6, 1e-6)
        return c.result()
    return selfcheck.Check(name, run, "rtol 1e-6")


class StandIn:
    """A builder of stand-in kernels: ``agree`` (2 * x), ``disagree`` (2 * x + 0.5) or
    ``fail`` (the build raises); counts its builds and checks it is given Metal specs."""

    def __init__(self, mode):
        self.mode, self.built = mode, []

    def __call__(self, spec):
        assert spec["name"] == SPEC_NAME and "threadgroup_barrier" in spec["header"], spec["name"]
        assert "__syncthreads" not in spec["source"]
        self.built.append(spec["name"])
        if self.mode == "fail":
            raise RuntimeError("program_source:12:5: error: use of undeclared identifier 'velox_tid'")
        extra = 0.5 if self.mode == "disagree" else 0.0

        def kernel(*, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
            return [2 * inputs[0] + extra]
        return kernel


def _ensure(build, device=DEVICE):
    return selfcheck.ensure_metal(checks=[_doubling_check()], build=build, device=lambda: device)


def _entries():
    return json.loads(selfcheck.cache_path().read_text())["entries"]


def test_a_kernel_that_agrees_passes_and_is_recorded(monkeypatch):
    build = StandIn("agree")
    report = _ensure(build)
    assert report.passed and report.device == "Stand-in GPU" and report.mlx_version == mx.__version__
    (result,) = report.results
    assert result.passed and result.max_error == 0.0 and result.kernels == (SPEC_NAME,)
    assert build.built == [SPEC_NAME]
    assert _ensure(build) is report and build.built == [SPEC_NAME]  # once a process
    (key, entry), = _entries().items()
    assert entry["passed"] is True
    assert f"mlx {mx.__version__}" in key and "Stand-in GPU" in key and selfcheck.kernel_fingerprint() in key
    assert selfcheck.cached_verdict(DEVICE) is True
    assert ev._run_kernel.__name__ == "_run_kernel"  # the module's own launcher again
    text = report.text()
    for part in (f"MLX {mx.__version__}", "Stand-in GPU", "PASS  double", f"PASS  {SPEC_NAME}", "PASSED"):
        assert part in text, part


def test_a_kernel_that_disagrees_refuses_the_backend(monkeypatch):
    build = StandIn("disagree")
    with pytest.raises(BackendUnavailable, match=r"failed its parity self-check on Stand-in GPU") as e:
        _ensure(build)
    msg = str(e.value)
    assert "double: doubled: 12 elements beyond atol 1e-06" in msg and "velox selftest --backend metal" in msg
    assert _entries()[next(iter(_entries()))]["passed"] is False
    assert selfcheck.cached_verdict(DEVICE) is False
    with pytest.raises(BackendUnavailable, match="parity self-check"):  # the verdict stands
        _ensure(build)
    assert build.built == [SPEC_NAME]
    report = selfcheck.run_checks([_doubling_check()], build=build, device=lambda: DEVICE)
    assert not report.passed and report.results[0].max_error == 0.5
    assert "FAIL  double" in report.text() and f"FAIL  {SPEC_NAME}" in report.text()


def test_a_kernel_that_fails_to_build_refuses_the_backend():
    build = StandIn("fail")
    with pytest.raises(BackendUnavailable, match=rf"{SPEC_NAME} did not build: RuntimeError: "
                                                 r"program_source:12:5: error: use of undeclared"):
        _ensure(build)
    assert selfcheck.cached_verdict(DEVICE) is False
    report = selfcheck.run_checks([_doubling_check(), _doubling_check("again")], build=build,
                                  device=lambda: DEVICE)
    assert [r.passed for r in report.results] == [False, False]
    assert all(r.max_error != r.max_error for r in report.results)  # nan: nothing compared


def test_no_metal_device_refuses_before_any_check():
    build = StandIn("agree")
    absent = selfcheck.Device(False, "none", "MLX reports no Metal device here")
    with pytest.raises(BackendUnavailable, match="'metal' is not available: MLX reports no Metal device"):
        _ensure(build, absent)
    assert build.built == [] and not selfcheck.cache_path().exists()
    report = selfcheck.run_checks([_doubling_check()], build=build, device=lambda: absent)
    assert not report.passed and report.results == [] and "NOT AVAILABLE" in report.text()
    # and on this machine, the real device check
    if not mx.metal.is_available():
        assert not selfcheck.metal_device().available and not selfcheck.metal_verified()
        with pytest.raises(BackendUnavailable, match="Apple GPU"):
            resolve_backend("metal", "tova", ("reference", "mlx", "metal"))


def test_a_check_that_runs_no_kernel_or_errs_fails():
    idle = selfcheck.Check("idle", lambda: (0.0, None))

    def broken():
        raise ValueError("shapes do not match\nmore")
    report = selfcheck.run_checks([idle, selfcheck.Check("broken", broken)], build=StandIn("agree"),
                                  device=lambda: DEVICE)
    assert [r.detail for r in report.results] == [
        "no kernel ran: the check did not reach the kernel path", "error: ValueError: shapes do not match"]


@pytest.mark.parametrize("mode, picked", [("agree", "metal"), ("disagree", "mlx"), (None, "mlx")])
def test_auto_picks_metal_only_where_the_check_passed(monkeypatch, mode, picked):
    """A verdict recorded by an earlier process (the cache) decides ``auto``: metal after a
    pass, mlx after a failure or with none recorded; ``auto`` never runs the check itself."""
    monkeypatch.setattr(selfcheck, "metal_device", lambda: DEVICE)
    real = backend.device_supports
    monkeypatch.setattr(backend, "device_supports", lambda b: b == "metal" or real(b))
    if mode is not None:
        with pytest.raises(BackendUnavailable) if mode == "disagree" else _nothing():
            _ensure(StandIn(mode))
        monkeypatch.setattr(selfcheck, "_VERDICTS", {})  # a new process: the cache alone
        selfcheck._verified_here.cache_clear()
    monkeypatch.setattr(selfcheck, "run_checks", lambda *a, **k: pytest.fail("auto ran the check"))
    implemented = ("reference", "mlx", "metal")
    assert resolve_backend("auto", "tova", implemented) == picked
    assert selfcheck.metal_verified() == (mode == "agree")


def test_a_verdict_is_per_mlx_version_device_and_kernels(monkeypatch):
    _ensure(StandIn("agree"))
    assert selfcheck.cached_verdict(DEVICE) is True
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    assert selfcheck.cached_verdict(selfcheck.Device(True, "Another GPU")) is None
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    assert selfcheck.cached_verdict(DEVICE) is None


def test_the_cache_lives_under_xdg_cache_home(monkeypatch, tmp_path):
    assert selfcheck.cache_path() == tmp_path / "velox" / "metal-selfcheck.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert selfcheck.cache_path() == tmp_path / "home" / ".cache" / "velox" / "metal-selfcheck.json"
    # a cache that cannot be read is no verdict; one that cannot be written is left alone
    (tmp_path / "velox").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    selfcheck.cache_path().write_text("not json")
    assert selfcheck.cached_verdict(DEVICE) is None


def test_compare_reports_the_largest_difference_and_the_first_problem():
    c = selfcheck._Compare()
    c.exact("positions", mx.array([1, 2, 3]), mx.array([1, 2, 3]))
    c.close("rows", mx.array([1.0, 2.0, np.nan]), mx.array([1.0, 2.001, np.nan]), 1e-6, 1e-6)
    c.exact("slots", mx.array([1, 5]), mx.array([1, 4]))
    err, problem = c.result()
    assert abs(err - 0.001) < 1e-6 and problem.startswith("rows: 1 elements beyond")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_velox_selftest_prints_the_report_and_records_the_verdict(monkeypatch, capsys):
    """``velox selftest --backend metal``: the report on stdout (exit 0 when every check passed,
    1 otherwise), the verdict recorded for ``auto``; on a machine without Metal, exit 1 and
    the reason."""
    from velox.adapters import cli
    code = cli.main(["selftest", "--backend", "metal"])
    out = capsys.readouterr().out
    if not mx.metal.is_available():
        assert code == 1 and "NOT AVAILABLE" in out and f"MLX {mx.__version__}" in out
        assert not selfcheck.cache_path().exists()
    monkeypatch.setattr(selfcheck, "metal_device", lambda: DEVICE)
    monkeypatch.setattr(selfcheck, "metal_checks", lambda: [_doubling_check()])
    for mode, want in (("disagree", 1), ("agree", 0)):
        monkeypatch.setattr(selfcheck, "metal_build", StandIn(mode))
        assert cli.main(["selftest", "--backend", "metal"]) == want
        out = capsys.readouterr().out
        assert "Stand-in GPU" in out and ("PASSED" if want == 0 else "FAILED") in out
        assert selfcheck.cached_verdict(DEVICE) is (want == 0)
    assert selfcheck.metal_verified()
    assert cli.main(["selftest", "--backend", "metal", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] and data["device"] == "Stand-in GPU" and data["results"][0]["kernels"] == [SPEC_NAME]
    with pytest.raises(SystemExit):
        cli.main(["selftest", "--backend", "cuda"])
