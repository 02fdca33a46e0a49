"""The ``metal`` backend's real self-check (``velox.selfcheck.metal_checks``) run on the CPU.

Its kernels here are the CUDA twins of the Metal kernels it asks for (the same source, the
other dialect), run through ``tests/test_evict_kernel_emulation.py``'s emulation: so every
check's reference and comparison is tried against kernels known to be right (each check passes,
launching the kernels it is meant to), and a kernel a little off fails the check that runs it.
What the Metal kernels compute on an Apple GPU is the same check's question on the Mac.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests import test_codec_kernel as tck
from tests import test_evict_kernel_emulation as te
from tests import test_kernels as tk
from velox import selfcheck
from velox.kernels import codec as ck
from velox.kernels import kivi as kk

pytestmark = te.pytestmark  # a C++20 compiler, glibc's fibers, no CUDA device

DEVICE = selfcheck.Device(True, "CPU emulation")


def _cuda_twins() -> dict:
    """Every CUDA kernel spec by name (a kernel's name is the same in both dialects)."""
    twins = {}
    for variant in tk.KERNEL_VARIANTS:
        _, spec = tk._spec(variant)
        twins[spec["name"]] = spec
    for codec, values in tck.SPLIT_VARIANTS:
        spec = ck.split_spec(codec, values)
        twins[spec["name"]] = spec
    twins["velox_codec_merge"] = ck.merge_spec()
    for append in (False, True):
        spec = kk.split_spec(append)
        twins[spec["name"]] = spec
    return twins


TWINS = _cuda_twins()


def emulated_build(spec, off: str | None = None):
    """A stand-in for ``mx.fast.metal_kernel``: the kernel's CUDA twin emulated; ``off``: the
    kernel whose float outputs come back 0.1% too large."""
    assert spec["header"].startswith("\n// velox's Metal dialect")
    cuda = TWINS[spec["name"]]

    def kernel(*, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
        out = te.emulate(cuda, inputs, grid, threadgroup, output_shapes, output_dtypes, template)
        if spec["name"] == off:
            out = [o * (1 + 1e-3) if o.dtype == mx.float32 else o for o in out]
        return out
    return kernel


def test_every_real_check_passes_on_kernels_known_to_be_right():
    report = selfcheck.run_checks(build=emulated_build, device=lambda: DEVICE)
    assert report.passed, report.text()
    launched = set(report.kernels())
    assert {"velox_weights_mean_decay", "velox_weights_mean_decay_noise", "velox_weights_max_max",
            "velox_weights_mean_vote_sum", "velox_compact_full_full", "velox_merge_plan",
            "velox_merge_compact", "velox_attend_part", "velox_attend_combine_mean_decay", "velox_select",
            "velox_attend_select_mean_weights", "velox_attend_select_mean_decay_carried_carry",
            "velox_attend_flash_direct", "velox_attend_flash", "velox_attend_out", "velox_kivi_step",
            "velox_codec_split_mse_int8", "velox_codec_split_qjl_int8", "velox_codec_merge"} <= launched
    for r in report.results:
        assert 0 <= r.max_error < 1e-4, (r.name, r.max_error)


@pytest.mark.parametrize("off, failing", [("velox_attend_out", "attend (fill step)"),
                                          ("velox_weights_max_max", "weights: KVzip's maximum")])
def test_a_kernel_a_little_off_fails_its_check(off, failing):
    checks = [c for c in selfcheck.metal_checks() if c.name == failing]
    report = selfcheck.run_checks(checks, build=lambda s: emulated_build(s, off), device=lambda: DEVICE)
    (result,) = report.results
    assert not result.passed and off in result.kernels and "beyond" in result.detail, result
