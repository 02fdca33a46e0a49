import os

# Backend parity compares float32 results against a float64 reference: keep float32 matmuls at
# full precision on GPUs too (MLX runs them as TF32 on CUDA unless told otherwise; a TF32
# cosine can flip a near-tie such as CaM's merge target). Read by MLX at its first matmul.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

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


# Known defects, each named with what fails and why, kept visible as expected failures (a
# strict one makes the run fail once fixed, until its entry goes): the rest stays a gate.
KNOWN_FAILURES = {
    "tests/test_memory.py::test_live_memory_tracks_reported_bytes[rocketkv]":
        "RocketKV's state-level decode keeps about 2.9x its reported bytes' growth live "
        "(1.77 MB against 0.62 MB over 800 steps): a buffer outlives the step that replaced it",
    "tests/test_contract.py::test_batch_and_head_independence[turboquant_rvq]":
        "with OpenBLAS, one drawn case (3 heads, 56 tokens, bits 3, 2 outliers) codes a key row "
        "differently stacked than alone (a rounding at a cell boundary of the rotated keys); "
        "passes with VELOX_NO_OPENBLAS=1",
    "tests/test_batch_generate.py::test_batch_generate_equals_batch_of_one_for_every_method[qjl]":
        "with OpenBLAS, QJL's value codes of a row batched differ from the row alone (the "
        "sketch's matmul rounds differently at another batch shape); passes with "
        "VELOX_NO_OPENBLAS=1",
}
_ORDER = ("exact equality of a matmul's result at two shapes, which OpenBLAS's kernels on this "
          "CPU round differently; passes with VELOX_NO_OPENBLAS=1")
KNOWN_FAILURES.update({
    **{f"tests/test_codec_split.py::test_split_codes_append_and_take[{k}]": _ORDER
       for k in ("turboquant_mse", "turboquant_prod", "turboquant_rvq")},
    "tests/test_kvzip.py::test_kvzip_importance_is_a_max_over_probes": _ORDER,
})
# Not strict: those that depend on the BLAS's rounding (another BLAS passes them), and
# RocketKV's, which passed in a run of the whole suite where it ran after other files.
_NOT_STRICT = {k for k, v in KNOWN_FAILURES.items() if "VELOX_NO_OPENBLAS" in v} | {
    "tests/test_memory.py::test_live_memory_tracks_reported_bytes[rocketkv]"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = KNOWN_FAILURES.get(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason,
                                              strict=item.nodeid not in _NOT_STRICT))
