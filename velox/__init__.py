"""velox: functional KV-cache compression for MLX.

Every method is a namespace, ``velox.<key>``, holding its state record ``State`` and pure
functions ``init``, ``update``, ``get_kv`` and ``nbytes``, vectorised over batch and kv heads
(``velox.tova.update(state, keys, values)``); the same functions are ``velox.<key>_init``,
``velox.<key>_update``, ``velox.<key>_get_kv`` and ``velox.<key>_bytes``, the state type
``velox.<Key>State``. The registry maps each method key to its functions and spec;
:func:`init`, :func:`update`, :func:`get_kv` and :func:`nbytes` dispatch on it.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

# The installed package maps the source tree's top-level kernels/, adapters/ and specs/ to
# velox.kernels, velox.adapters and velox.specs (pyproject.toml's package-dir). Where this
# package is imported from the source tree itself (a script or `python -c` run in the clone's
# root, whose ./velox comes before the installed copy), the same names resolve to those folders.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
_MAPPED = ("kernels", "adapters", "specs")


class _SourceTreeFinder(MetaPathFinder):
    """``velox.<name>`` for the mapped top-level folders of a source checkout (nothing else)."""

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, name = fullname.partition(".")
        if pkg != __name__ or name not in _MAPPED:
            return None
        return PathFinder.find_spec(fullname, [str(_SOURCE_ROOT)])


if (not (Path(__file__).parent / "kernels").exists()
        and (_SOURCE_ROOT / "pyproject.toml").is_file()
        and all((_SOURCE_ROOT / name / "__init__.py").is_file() for name in _MAPPED)
        and not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path)):
    sys.meta_path.append(_SourceTreeFinder())

from . import _blas  # noqa: E402,F401  (first of velox's modules: OpenBLAS loads before mlx.core)

if _blas.loaded is None and _blas.reason.startswith("mlx.core was imported before velox"):
    import warnings

    warnings.warn(f"OpenBLAS ({_blas.OPENBLAS}) is installed but was not loaded: mlx.core was "
                  f"imported before velox, so MLX's CPU matmuls use its bundled BLAS (a prefill "
                  f"several times slower). Import velox before mlx and mlx_lm, or set "
                  f"LD_PRELOAD={_blas.OPENBLAS}.", RuntimeWarning, stacklevel=2)

import mlx.core as mx

from . import compose, distributed, wrap
from .accounting import fp16_bytes, state_nbytes
from .backend import BACKENDS, BackendUnavailable
from .distributed import LOCAL, Heads
from .registry import Method, State, get_method, method_keys, method_of
from .spec import Spec, load_spec
from . import backend as _backend, selfcheck as _selfcheck  # noqa: E402

_backend.install_metal_proof(_selfcheck.PROOF)  # the metal backend's parity self-check

__version__ = "0.1.0"


def init(key: str, batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         backend: str = "auto", heads: Heads = LOCAL, **params: Any) -> State:
    """``<key>_init`` by method key; unknown parameter names raise ``ValueError``. ``heads``:
    where the state's ``kv_heads`` sit among its layer's (``velox.distributed``: one shard of
    a tensor-parallel model's; :data:`velox.distributed.LOCAL`, every head, by default)."""
    method = get_method(key)
    unknown = sorted(set(params) - set(method.spec.params))
    if unknown:
        raise ValueError(f"{key} got unknown parameter(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(method.spec.params)}")
    return method.init(batch, kv_heads, head_dim, dtype=dtype, backend=backend, heads=heads,
                       **params)


def update(state: State, keys: mx.array, values: mx.array, *,
           queries: mx.array | None = None, valid: Any = None) -> State:
    """``<key>_update`` for whichever method ``state`` belongs to (``valid``: each row's real
    new tokens, ``velox.ragged``)."""
    return method_of(state).update(state, keys, values, queries=queries, valid=valid)


def get_kv(state: State) -> tuple[mx.array, mx.array]:
    """``<key>_get_kv`` for whichever method ``state`` belongs to."""
    return method_of(state).get_kv(state)


def nbytes(state: State) -> int:
    """``<key>_bytes`` for whichever method ``state`` belongs to."""
    return method_of(state).nbytes(state)


def positions(state: State) -> mx.array:
    """Absolute positions ``[b, h, n]`` of the tokens ``get_kv`` returns."""
    return method_of(state).positions(state)


def kv_slots(state: State) -> tuple[mx.array, mx.array, mx.array | None]:
    """The stored rows in storage order, for attention code: ``(keys, values, mask)``, every
    row older than the next update's tokens; ``mask`` is ``None`` when every slot holds a token,
    else a bool ``[b, h, n]`` (True where a slot holds one). ``get_kv`` gives the same rows in
    increasing position (a gather where the slots are not sorted)."""
    return method_of(state).kv_slots(state)


def tokens_seen(state: State) -> int:
    """Tokens absorbed so far (the absolute position of the next token; of row 0 when rows
    are ragged)."""
    from .ragged import RowStates
    if isinstance(state, RowStates):
        state = state.rows[0]
    return int(state.next_pos[0, 0].item())


__all__ = [
    "BACKENDS", "BackendUnavailable", "Method", "Spec", "compose", "distributed", "wrap", "fp16_bytes", "get_kv", "get_method",
    "init", "kv_slots", "load_spec", "method_keys", "method_of", "nbytes", "positions", "state_nbytes",
    "tokens_seen", "update",
]


# --- begin generated exports (scripts/update_exports.py) ---
from .methods import (  # noqa: E402  (each registers its method)
    a2ats,
    adakv,
    age_tiered,
    amc,
    anchorkv,
    cachegen,
    cam,
    chunkkv,
    compositions,
    curdkv,
    gear,
    h2o,
    keyformer,
    kitty,
    kivi,
    kivi_sink,
    knorm,
    kvquant,
    kvtc,
    kvzip,
    minicache,
    morphkv,
    nestedkv,
    nsnquant,
    palu,
    polar,
    pyramidkv,
    qfilters,
    qjl,
    rocketkv,
    skvq,
    snapkv,
    spectral,
    squeeze,
    streaming_llm,
    svdq,
    tova,
    turboquant_mse,
    turboquant_prod,
    turboquant_rvq,
    vecinfer,
    xkv,
    xquant,
    zipcache,
)
A2atsState = a2ats.State
a2ats_init, a2ats_update, a2ats_get_kv, a2ats_bytes = (
    a2ats.init, a2ats.update, a2ats.get_kv, a2ats.nbytes)
AdaKVState = adakv.State
adakv_init, adakv_update, adakv_get_kv, adakv_bytes = (
    adakv.init, adakv.update, adakv.get_kv, adakv.nbytes)
AgeTieredState = age_tiered.State
age_tiered_init, age_tiered_update, age_tiered_get_kv, age_tiered_bytes = (
    age_tiered.init, age_tiered.update, age_tiered.get_kv, age_tiered.nbytes)
AMCState = amc.State
amc_init, amc_update, amc_get_kv, amc_bytes = (
    amc.init, amc.update, amc.get_kv, amc.nbytes)
AnchorKVState = anchorkv.State
anchorkv_init, anchorkv_update, anchorkv_get_kv, anchorkv_bytes = (
    anchorkv.init, anchorkv.update, anchorkv.get_kv, anchorkv.nbytes)
CacheGenState = cachegen.State
cachegen_init, cachegen_update, cachegen_get_kv, cachegen_bytes = (
    cachegen.init, cachegen.update, cachegen.get_kv, cachegen.nbytes)
CaMState = cam.State
cam_init, cam_update, cam_get_kv, cam_bytes = (
    cam.init, cam.update, cam.get_kv, cam.nbytes)
ChunkKVState = chunkkv.State
chunkkv_init, chunkkv_update, chunkkv_get_kv, chunkkv_bytes = (
    chunkkv.init, chunkkv.update, chunkkv.get_kv, chunkkv.nbytes)
CurDKVState = curdkv.State
curdkv_init, curdkv_update, curdkv_get_kv, curdkv_bytes = (
    curdkv.init, curdkv.update, curdkv.get_kv, curdkv.nbytes)
GearState = gear.State
gear_init, gear_update, gear_get_kv, gear_bytes = (
    gear.init, gear.update, gear.get_kv, gear.nbytes)
H2OState = h2o.State
h2o_init, h2o_update, h2o_get_kv, h2o_bytes = (
    h2o.init, h2o.update, h2o.get_kv, h2o.nbytes)
KeyformerState = keyformer.State
keyformer_init, keyformer_update, keyformer_get_kv, keyformer_bytes = (
    keyformer.init, keyformer.update, keyformer.get_kv, keyformer.nbytes)
KittyState = kitty.State
kitty_init, kitty_update, kitty_get_kv, kitty_bytes = (
    kitty.init, kitty.update, kitty.get_kv, kitty.nbytes)
KiviState = kivi.State
kivi_init, kivi_update, kivi_get_kv, kivi_bytes = (
    kivi.init, kivi.update, kivi.get_kv, kivi.nbytes)
KiviSinkState = kivi_sink.State
kivi_sink_init, kivi_sink_update, kivi_sink_get_kv, kivi_sink_bytes = (
    kivi_sink.init, kivi_sink.update, kivi_sink.get_kv, kivi_sink.nbytes)
KNormState = knorm.State
knorm_init, knorm_update, knorm_get_kv, knorm_bytes = (
    knorm.init, knorm.update, knorm.get_kv, knorm.nbytes)
KVQuantState = kvquant.State
kvquant_init, kvquant_update, kvquant_get_kv, kvquant_bytes = (
    kvquant.init, kvquant.update, kvquant.get_kv, kvquant.nbytes)
KVTCState = kvtc.State
kvtc_init, kvtc_update, kvtc_get_kv, kvtc_bytes = (
    kvtc.init, kvtc.update, kvtc.get_kv, kvtc.nbytes)
KVzipState = kvzip.State
kvzip_init, kvzip_update, kvzip_get_kv, kvzip_bytes = (
    kvzip.init, kvzip.update, kvzip.get_kv, kvzip.nbytes)
MiniCacheState = minicache.State
minicache_init, minicache_update, minicache_get_kv, minicache_bytes = (
    minicache.init, minicache.update, minicache.get_kv, minicache.nbytes)
MorphKVState = morphkv.State
morphkv_init, morphkv_update, morphkv_get_kv, morphkv_bytes = (
    morphkv.init, morphkv.update, morphkv.get_kv, morphkv.nbytes)
NestedKVState = nestedkv.State
nestedkv_init, nestedkv_update, nestedkv_get_kv, nestedkv_bytes = (
    nestedkv.init, nestedkv.update, nestedkv.get_kv, nestedkv.nbytes)
NSNQuantState = nsnquant.State
nsnquant_init, nsnquant_update, nsnquant_get_kv, nsnquant_bytes = (
    nsnquant.init, nsnquant.update, nsnquant.get_kv, nsnquant.nbytes)
PaluState = palu.State
palu_init, palu_update, palu_get_kv, palu_bytes = (
    palu.init, palu.update, palu.get_kv, palu.nbytes)
PolarState = polar.State
polar_init, polar_update, polar_get_kv, polar_bytes = (
    polar.init, polar.update, polar.get_kv, polar.nbytes)
PyramidKVState = pyramidkv.State
pyramidkv_init, pyramidkv_update, pyramidkv_get_kv, pyramidkv_bytes = (
    pyramidkv.init, pyramidkv.update, pyramidkv.get_kv, pyramidkv.nbytes)
QFiltersState = qfilters.State
qfilters_init, qfilters_update, qfilters_get_kv, qfilters_bytes = (
    qfilters.init, qfilters.update, qfilters.get_kv, qfilters.nbytes)
QJLState = qjl.State
qjl_init, qjl_update, qjl_get_kv, qjl_bytes = (
    qjl.init, qjl.update, qjl.get_kv, qjl.nbytes)
RocketKVState = rocketkv.State
rocketkv_init, rocketkv_update, rocketkv_get_kv, rocketkv_bytes = (
    rocketkv.init, rocketkv.update, rocketkv.get_kv, rocketkv.nbytes)
SKVQState = skvq.State
skvq_init, skvq_update, skvq_get_kv, skvq_bytes = (
    skvq.init, skvq.update, skvq.get_kv, skvq.nbytes)
SnapKVState = snapkv.State
snapkv_init, snapkv_update, snapkv_get_kv, snapkv_bytes = (
    snapkv.init, snapkv.update, snapkv.get_kv, snapkv.nbytes)
SpectralState = spectral.State
spectral_init, spectral_update, spectral_get_kv, spectral_bytes = (
    spectral.init, spectral.update, spectral.get_kv, spectral.nbytes)
SqueezeState = squeeze.State
squeeze_init, squeeze_update, squeeze_get_kv, squeeze_bytes = (
    squeeze.init, squeeze.update, squeeze.get_kv, squeeze.nbytes)
StreamingLLMState = streaming_llm.State
streaming_llm_init, streaming_llm_update, streaming_llm_get_kv, streaming_llm_bytes = (
    streaming_llm.init, streaming_llm.update, streaming_llm.get_kv, streaming_llm.nbytes)
SVDqState = svdq.State
svdq_init, svdq_update, svdq_get_kv, svdq_bytes = (
    svdq.init, svdq.update, svdq.get_kv, svdq.nbytes)
TovaState = tova.State
tova_init, tova_update, tova_get_kv, tova_bytes = (
    tova.init, tova.update, tova.get_kv, tova.nbytes)
TurboQuantMseState = turboquant_mse.State
turboquant_mse_init, turboquant_mse_update, turboquant_mse_get_kv, turboquant_mse_bytes = (
    turboquant_mse.init, turboquant_mse.update, turboquant_mse.get_kv, turboquant_mse.nbytes)
TurboQuantProdState = turboquant_prod.State
turboquant_prod_init, turboquant_prod_update, turboquant_prod_get_kv, turboquant_prod_bytes = (
    turboquant_prod.init, turboquant_prod.update, turboquant_prod.get_kv, turboquant_prod.nbytes)
TurboQuantRvqState = turboquant_rvq.State
turboquant_rvq_init, turboquant_rvq_update, turboquant_rvq_get_kv, turboquant_rvq_bytes = (
    turboquant_rvq.init, turboquant_rvq.update, turboquant_rvq.get_kv, turboquant_rvq.nbytes)
VecInferState = vecinfer.State
vecinfer_init, vecinfer_update, vecinfer_get_kv, vecinfer_bytes = (
    vecinfer.init, vecinfer.update, vecinfer.get_kv, vecinfer.nbytes)
XKVState = xkv.State
xkv_init, xkv_update, xkv_get_kv, xkv_bytes = (
    xkv.init, xkv.update, xkv.get_kv, xkv.nbytes)
XQuantState = xquant.State
xquant_init, xquant_update, xquant_get_kv, xquant_bytes = (
    xquant.init, xquant.update, xquant.get_kv, xquant.nbytes)
ZipCacheState = zipcache.State
zipcache_init, zipcache_update, zipcache_get_kv, zipcache_bytes = (
    zipcache.init, zipcache.update, zipcache.get_kv, zipcache.nbytes)
__all__ += [
    "a2ats", "A2atsState", "a2ats_init", "a2ats_update", "a2ats_get_kv", "a2ats_bytes", "adakv",
    "AdaKVState", "adakv_init", "adakv_update", "adakv_get_kv", "adakv_bytes", "age_tiered",
    "AgeTieredState", "age_tiered_init", "age_tiered_update", "age_tiered_get_kv",
    "age_tiered_bytes", "amc", "AMCState", "amc_init", "amc_update", "amc_get_kv", "amc_bytes",
    "anchorkv", "AnchorKVState", "anchorkv_init", "anchorkv_update", "anchorkv_get_kv",
    "anchorkv_bytes", "cachegen", "CacheGenState", "cachegen_init", "cachegen_update",
    "cachegen_get_kv", "cachegen_bytes", "cam", "CaMState", "cam_init", "cam_update", "cam_get_kv",
    "cam_bytes", "chunkkv", "ChunkKVState", "chunkkv_init", "chunkkv_update", "chunkkv_get_kv",
    "chunkkv_bytes", "curdkv", "CurDKVState", "curdkv_init", "curdkv_update", "curdkv_get_kv",
    "curdkv_bytes", "gear", "GearState", "gear_init", "gear_update", "gear_get_kv", "gear_bytes",
    "h2o", "H2OState", "h2o_init", "h2o_update", "h2o_get_kv", "h2o_bytes", "keyformer",
    "KeyformerState", "keyformer_init", "keyformer_update", "keyformer_get_kv", "keyformer_bytes",
    "kitty", "KittyState", "kitty_init", "kitty_update", "kitty_get_kv", "kitty_bytes", "kivi",
    "KiviState", "kivi_init", "kivi_update", "kivi_get_kv", "kivi_bytes", "kivi_sink",
    "KiviSinkState", "kivi_sink_init", "kivi_sink_update", "kivi_sink_get_kv", "kivi_sink_bytes",
    "knorm", "KNormState", "knorm_init", "knorm_update", "knorm_get_kv", "knorm_bytes", "kvquant",
    "KVQuantState", "kvquant_init", "kvquant_update", "kvquant_get_kv", "kvquant_bytes", "kvtc",
    "KVTCState", "kvtc_init", "kvtc_update", "kvtc_get_kv", "kvtc_bytes", "kvzip", "KVzipState",
    "kvzip_init", "kvzip_update", "kvzip_get_kv", "kvzip_bytes", "minicache", "MiniCacheState",
    "minicache_init", "minicache_update", "minicache_get_kv", "minicache_bytes", "morphkv",
    "MorphKVState", "morphkv_init", "morphkv_update", "morphkv_get_kv", "morphkv_bytes",
    "nestedkv", "NestedKVState", "nestedkv_init", "nestedkv_update", "nestedkv_get_kv",
    "nestedkv_bytes", "nsnquant", "NSNQuantState", "nsnquant_init", "nsnquant_update",
    "nsnquant_get_kv", "nsnquant_bytes", "palu", "PaluState", "palu_init", "palu_update",
    "palu_get_kv", "palu_bytes", "polar", "PolarState", "polar_init", "polar_update",
    "polar_get_kv", "polar_bytes", "pyramidkv", "PyramidKVState", "pyramidkv_init",
    "pyramidkv_update", "pyramidkv_get_kv", "pyramidkv_bytes", "qfilters", "QFiltersState",
    "qfilters_init", "qfilters_update", "qfilters_get_kv", "qfilters_bytes", "qjl", "QJLState",
    "qjl_init", "qjl_update", "qjl_get_kv", "qjl_bytes", "rocketkv", "RocketKVState",
    "rocketkv_init", "rocketkv_update", "rocketkv_get_kv", "rocketkv_bytes", "skvq", "SKVQState",
    "skvq_init", "skvq_update", "skvq_get_kv", "skvq_bytes", "snapkv", "SnapKVState",
    "snapkv_init", "snapkv_update", "snapkv_get_kv", "snapkv_bytes", "spectral", "SpectralState",
    "spectral_init", "spectral_update", "spectral_get_kv", "spectral_bytes", "squeeze",
    "SqueezeState", "squeeze_init", "squeeze_update", "squeeze_get_kv", "squeeze_bytes",
    "streaming_llm", "StreamingLLMState", "streaming_llm_init", "streaming_llm_update",
    "streaming_llm_get_kv", "streaming_llm_bytes", "svdq", "SVDqState", "svdq_init", "svdq_update",
    "svdq_get_kv", "svdq_bytes", "tova", "TovaState", "tova_init", "tova_update", "tova_get_kv",
    "tova_bytes", "turboquant_mse", "TurboQuantMseState", "turboquant_mse_init",
    "turboquant_mse_update", "turboquant_mse_get_kv", "turboquant_mse_bytes", "turboquant_prod",
    "TurboQuantProdState", "turboquant_prod_init", "turboquant_prod_update",
    "turboquant_prod_get_kv", "turboquant_prod_bytes", "turboquant_rvq", "TurboQuantRvqState",
    "turboquant_rvq_init", "turboquant_rvq_update", "turboquant_rvq_get_kv",
    "turboquant_rvq_bytes", "vecinfer", "VecInferState", "vecinfer_init", "vecinfer_update",
    "vecinfer_get_kv", "vecinfer_bytes", "xkv", "XKVState", "xkv_init", "xkv_update", "xkv_get_kv",
    "xkv_bytes", "xquant", "XQuantState", "xquant_init", "xquant_update", "xquant_get_kv",
    "xquant_bytes", "zipcache", "ZipCacheState", "zipcache_init", "zipcache_update",
    "zipcache_get_kv", "zipcache_bytes",
]
# --- end generated exports ---
