"""Calibration artifacts: arrays a method fits once on a real model, with their provenance.

A method that calibrates registers a ``calibrate(state, arrays) -> state`` hook
(``velox.registry.register``) that installs one layer's arrays into a fresh state, and a fitter
here (:data:`FITTERS`): ``fit(keys, params) -> {name: array}`` for one layer, from its post-RoPE
keys ``[tokens, kv_heads, head_dim]`` (``velox.adapters.calibration.capture_qk``); the artifact
stacks the layers (``[layers, ...]``).

* :func:`calibrate` runs the model over a text and fits (``velox calibrate --method spectral
  --out FILE`` on the embedded SmolLM2);
* :func:`save_artifact` writes a safetensors file: the arrays, and a ``velox`` metadata entry
  (JSON) with the format, the method, the model, the text's source and token count, the velox
  version, the parameters and the dims (layers, kv heads, head dim);
* :func:`load_artifact` reads one back and checks it: its format and method, and (given the
  model) the layer count, kv heads and head dim; any mismatch is a ``ValueError`` that names it;
* ``make_cache(model, key, artifacts=FILE)`` (``velox.adapters.mlxlm``) loads, checks and
  installs layer ``i``'s arrays into layer ``i``'s state.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["FORMAT", "FITTERS", "fit_spectral", "calibrate", "save_artifact", "load_artifact",
           "model_dims", "layer_arrays"]

FORMAT = "velox-artifact-1"


def fit_spectral(keys: np.ndarray, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """SpectralQuant's calibration of one layer (``velox.codecs.spectral.calibrate``, every kv
    head's keys pooled): the PCA rotation (rows by decreasing eigenvalue), each rotated
    coordinate's spread, the eigenvalues and the participation ratio (the measured number of
    signal dimensions). ``keys`` is ``[tokens, kv_heads, head_dim]``."""
    from velox.codecs.spectral import calibrate as fit, participation_ratio, pca_rotation

    x = np.asarray(keys, np.float64).reshape(-1, keys.shape[-1])
    out = fit(x)
    _, eigenvalues = pca_rotation(x)
    return {"rotation": np.asarray(out["rotation"], np.float32),
            "scales": np.asarray(out["scales"], np.float32),
            "eigenvalues": np.asarray(eigenvalues, np.float32),
            "participation_ratio": np.array(participation_ratio(eigenvalues), np.float32)}


#: method key -> fitter of its artifact from every layer's keys.
FITTERS: dict[str, Callable[[np.ndarray, dict[str, Any]], dict[str, np.ndarray]]] = {
    "spectral": fit_spectral,
}


def model_dims(model) -> dict[str, int]:
    """``layers``, ``kv_heads`` and ``head_dim`` of an mlx-lm model's attention layers."""
    attn = [layer.self_attn for layer in model.layers]
    a = attn[0]
    head_dim = getattr(a, "head_dim", None) or a.k_proj.weight.shape[0] // a.n_kv_heads
    return {"layers": len(attn), "kv_heads": int(a.n_kv_heads), "head_dim": int(head_dim)}


def calibrate(method: str, model, tokenizer, text: str, *, model_name: str, source: str,
              params: dict[str, Any] | None = None, progress: bool = True) -> tuple[dict, dict]:
    """Fit ``method``'s artifact on ``model`` over ``text``: ``(arrays, provenance)``."""
    from velox import __version__
    from velox.adapters.calibration import capture_qk

    if method not in FITTERS:
        raise ValueError(f"{method} has no calibration (calibrated methods: {', '.join(sorted(FITTERS))})")
    tokens = tokenizer.encode(text)
    _say(progress, f"calibrating {method}: capturing keys over {len(tokens)} tokens")
    _, keys = capture_qk(model, tokens)
    per_layer = []
    for i, k in enumerate(keys):
        per_layer.append(FITTERS[method](k, dict(params or {})))
        _bar(progress, i + 1, len(keys))
    arrays = {name: np.stack([p[name] for p in per_layer]) for name in per_layer[0]}
    _say(progress, f"fitted {', '.join(f'{k} {tuple(v.shape)}' for k, v in arrays.items())}")
    info = {"format": FORMAT, "method": method, "model": model_name, "source": source,
            "tokens": len(tokens), "velox": __version__, "params": dict(params or {}),
            **model_dims(model)}
    return arrays, info


def save_artifact(path: str | Path, arrays: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    """Write ``arrays`` (each ``[layers, ...]``) and the provenance ``info`` as safetensors."""
    mx.save_safetensors(str(path), {k: mx.array(np.ascontiguousarray(v)) for k, v in arrays.items()},
                        metadata={"velox": json.dumps(info, sort_keys=True)})


def load_artifact(path: str | Path, *, method: str, model=None) -> tuple[dict, dict]:
    """``(arrays, info)`` of the artifact at ``path``, checked against ``method`` and, given,
    ``model``'s dims."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no artifact at {path}")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # not a safetensors file
        raise ValueError(f"{path} is not a velox artifact ({e})") from None
    try:
        info = json.loads(meta["velox"])
    except (KeyError, ValueError):
        raise ValueError(f"{path} has no velox provenance: not a velox artifact") from None
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: format {info.get('format')!r}, expected {FORMAT!r}")
    if info.get("method") != method:
        raise ValueError(f"{path} is an artifact of {info.get('method')!r}, not {method!r}")
    if model is not None:
        dims = model_dims(model)
        for k, v in dims.items():
            if info.get(k) != v:
                raise ValueError(f"{path} was fitted on {info.get('model')!r} with {k}="
                                 f"{info.get(k)}; this model has {k}={v}")
    out = {k: np.array(v) for k, v in arrays.items()}
    for k, v in out.items():
        if v.shape[0] != info.get("layers"):
            raise ValueError(f"{path}: {k} holds {v.shape[0]} layers, its provenance says {info.get('layers')}")
    return out, info


def layer_arrays(arrays: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """Layer ``layer``'s slice of every array."""
    return {k: v[layer] for k, v in arrays.items()}


def _bar(progress: bool, done: int, total: int, width: int = 30) -> None:
    if progress:
        filled = width * done // total
        end = "\n" if done == total else ""
        print(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} layers", end=end,
              file=sys.stderr, flush=True)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)
