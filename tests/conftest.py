import os

# Backend parity compares float32 results against a float64 reference: keep float32 matmuls at
# full precision on GPUs too (MLX runs them as TF32 on CUDA unless told otherwise; a TF32
# cosine can flip a near-tie such as CaM's merge target). Read by MLX at its first matmul.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# MLX's CPU kernel builds read a precompiled header of its preamble (tests/_kernel_builds.py):
# set up before anything compiles, inherited by the test workers and subprocesses.
from tests._kernel_builds import install as _precompiled_preamble  # noqa: E402

_precompiled_preamble()

import velox  # noqa: E402,F401  (before any test module imports mlx.core: loads OpenBLAS, velox._blas)
from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                     HealthCheck.data_too_large])
# ci (the default): fixed example count and derandomized, so runs are reproducible and bounded
# in time; VELOX_HYPOTHESIS_PROFILE=dev draws new random cases, =thorough 300 per property.
settings.register_profile("ci", max_examples=12, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
_PROFILES = ("ci", "dev", "thorough")
_profile = os.environ.get("VELOX_HYPOTHESIS_PROFILE") or "ci"
if _profile not in _PROFILES:
    raise ValueError(f"VELOX_HYPOTHESIS_PROFILE={_profile!r} is not one of {', '.join(_PROFILES)}")
settings.load_profile(_profile)


import jaxtyping
import pytest


@pytest.fixture(autouse=True, scope="module")
def _shape_checks_by_module(request):
    """The test-time shape checks (``--jaxtyping-packages``) stay on for the core's unit,
    property and contract tests, which call every annotated function with checked shapes;
    modules marked ``unchecked`` (whole models driven through mlx-lm, where the checks of
    every call on every layer and token doubled the time) run with them off, fixtures
    included."""
    if request.node.get_closest_marker("unchecked") is None:
        yield
        return
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


@pytest.fixture
def no_shape_checks():
    """Switch off the test-time jaxtyping checks, to see the errors users get."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache directory)."""
    from velox.adapters.smollm2 import load_default_model

    return load_default_model()


@pytest.fixture(scope="module")
def tiny_llama():
    """Random mlx-lm llama (3 layers, 4 query and 2 kv heads, head_dim 32, vocabulary 97)
    whose weights are scaled so that greedy decoding varies."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=3,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0)
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture
def layer_by_layer():
    """Decode layer by layer (the per-layer fused steps): the whole model's compiled step
    (``velox.adapters.model_step``) kept out for the test (a patch of its own, which the
    test's ``monkeypatch.undo()`` leaves in place)."""
    from velox.adapters import model_step

    for cls in list(model_step._ORIGINAL_CALL):
        model_step.uninstall(cls)
    patch = pytest.MonkeyPatch()
    patch.setattr(model_step, "install", lambda model: None)
    yield
    patch.undo()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the every-method cases marked slow (tests._helpers.every_method)")
    parser.addoption("--run-distributed", action="store_true", default=False,
                     help="also run the multi-process cases marked distributed (tests/test_distributed.py)")


def pytest_collection_modifyitems(config, items):
    """Cases marked ``slow`` (an every-method test's methods beyond one of each family) are
    deselected unless ``--run-slow`` is given, those marked ``distributed`` (ring-backend
    processes on localhost) unless ``--run-distributed`` is."""
    for marker, option in (("slow", "--run-slow"), ("distributed", "--run-distributed")):
        if config.getoption(option):
            continue
        keep = [i for i in items if i.get_closest_marker(marker) is None]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker(marker)])
            items[:] = keep


def pytest_report_header(config):
    """The BLAS MLX's CPU matmuls run on (OpenBLAS halves the suite's time)."""
    from velox import _blas
    return [f"velox: OpenBLAS {_blas.loaded or 'not loaded'} ({_blas.reason})"]
