"""Calibration on a real mlx-lm model: capture post-RoPE queries and keys, compute Q-Filters.

:func:`capture_qk` runs a model over a text with every attention layer's ``rope`` wrapped
(restored afterwards) and returns each layer's post-RoPE queries and keys.
:func:`calibrate_qfilters` turns the queries into Q-Filters with
:func:`velox.methods.qfilters.qfilters_from_queries`; :func:`save_qfilters` /
:func:`load_qfilters` write and read the artifact (``.npz``: ``filters [layers, kv_heads,
head_dim]`` float32 plus metadata naming the model). ``python -m velox.adapters.calibration``
rebuilds the shipped SmolLM2 artifact from :data:`CALIBRATION_TEXT`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from velox.methods.qfilters import qfilters_from_queries

__all__ = ["CALIBRATION_TEXT", "SMOLLM2_ARTIFACT", "capture_qk", "capture_qkv", "capture_inputs",
           "calibrate_qfilters", "save_qfilters", "load_qfilters"]

#: The shipped SmolLM2-135M-Instruct filters (inside the ``velox.adapters`` package).
SMOLLM2_ARTIFACT = "qfilters_smollm2.npz"

#: Calibration text: the opening of Charles Dickens, "A Tale of Two Cities" (1859), and
#: Abraham Lincoln's Gettysburg Address (1863), both in the public domain.
CALIBRATION_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
    "was the season of Light, it was the season of Darkness, it was the spring of hope, it "
    "was the winter of despair, we had everything before us, we had nothing before us, we "
    "were all going direct to Heaven, we were all going direct the other way - in short, the "
    "period was so far like the present period, that some of its noisiest authorities "
    "insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only.\n\n"
    "There were a king with a large jaw and a queen with a plain face, on the throne of "
    "England; there were a king with a large jaw and a queen with a fair face, on the throne "
    "of France. In both countries it was clearer than crystal to the lords of the State "
    "preserves of loaves and fishes, that things in general were settled for ever.\n\n"
    "Four score and seven years ago our fathers brought forth on this continent, a new "
    "nation, conceived in Liberty, and dedicated to the proposition that all men are created "
    "equal. Now we are engaged in a great civil war, testing whether that nation, or any "
    "nation so conceived and so dedicated, can long endure. We are met on a great "
    "battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is "
    "altogether fitting and proper that we should do this. But, in a larger sense, we can not "
    "dedicate - we can not consecrate - we can not hallow - this ground. The brave men, "
    "living and dead, who struggled here, have consecrated it, far above our poor power to "
    "add or detract. The world will little note, nor long remember what we say here, but it "
    "can never forget what they did here. It is for us the living, rather, to be dedicated "
    "here to the unfinished work which they who fought here have thus far so nobly advanced. "
    "It is rather for us to be here dedicated to the great task remaining before us - that "
    "from these honored dead we take increased devotion to that cause for which they gave "
    "the last full measure of devotion - that we here highly resolve that these dead shall "
    "not have died in vain - that this nation, under God, shall have a new birth of freedom "
    "- and that government of the people, by the people, for the people, shall not perish "
    "from the earth."
)


class _Capture(nn.Module):
    """Stands in for an attention layer's ``rope``: applies it, records what it returns.

    mlx-lm attention layers rotate the queries, then the keys, once per forward; even calls
    are queries, odd calls keys.
    """

    def __init__(self, rope: nn.Module, n_heads: int):
        super().__init__()
        self.rope = rope
        self.n_heads = n_heads
        self.out: list[mx.array] = []

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        y = self.rope(x, *args, **kwargs)
        if len(self.out) % 2 == 0 and x.shape[1] != self.n_heads:
            raise ValueError(f"expected queries with {self.n_heads} heads first, got shape {x.shape}")
        self.out.append(y)
        return y


def capture_qk(model: nn.Module, tokens: list[int] | mx.array) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Post-RoPE queries ``[t, q_heads, d]`` and keys ``[t, kv_heads, d]`` of every layer.

    Runs ``model`` once over ``tokens`` (no cache) with each layer's ``self_attn.rope``
    wrapped; the originals are restored even if the forward fails.
    """
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    layers = [layer.self_attn for layer in model.layers]
    originals = [attn.rope for attn in layers]
    captures = [_Capture(rope, attn.n_heads) for rope, attn in zip(originals, layers)]
    try:
        for attn, cap in zip(layers, captures):
            attn.rope = cap
        mx.eval(model(tokens[None]))
    finally:
        for attn, rope in zip(layers, originals):
            attn.rope = rope
    queries, keys = [], []
    for cap in captures:
        if len(cap.out) != 2:
            raise ValueError(f"a layer's rope ran {len(cap.out)} times in one forward, expected 2")
        q, k = (np.array(x[0].astype(mx.float32)).transpose(1, 0, 2) for x in cap.out)
        queries.append(q)
        keys.append(k)
    return queries, keys


class _ValueCapture(nn.Module):
    """Stands in for an attention layer's ``v_proj``: applies it, records what it returns."""

    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj = proj
        self.out: list[mx.array] = []

    def __call__(self, x: mx.array) -> mx.array:
        y = self.proj(x)
        self.out.append(y)
        return y


def capture_qkv(model: nn.Module, tokens: list[int] | mx.array
                ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """:func:`capture_qk`'s queries and keys and each layer's values ``[t, kv_heads, d]``
    (``self_attn.v_proj``'s output, wrapped for the forward and restored afterwards)."""
    layers = [layer.self_attn for layer in model.layers]
    originals = [attn.v_proj for attn in layers]
    captures = [_ValueCapture(p) for p in originals]
    try:
        for attn, cap in zip(layers, captures):
            attn.v_proj = cap
        queries, keys = capture_qk(model, tokens)
    finally:
        for attn, proj in zip(layers, originals):
            attn.v_proj = proj
    values = []
    for cap, k in zip(captures, keys):
        if len(cap.out) != 1:
            raise ValueError(f"a layer's v_proj ran {len(cap.out)} times in one forward, expected 1")
        values.append(np.array(cap.out[0][0].astype(mx.float32)).reshape(k.shape))
    return queries, keys, values


class _InputCapture(nn.Module):
    """Stands in for an attention layer's ``k_proj``: records its input, applies it."""

    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj = proj
        self.out: list[mx.array] = []

    def __call__(self, x: mx.array) -> mx.array:
        self.out.append(x)
        return self.proj(x)


def capture_inputs(model: nn.Module, tokens: list[int] | mx.array) -> list[np.ndarray]:
    """Each layer's attention input ``[t, hidden]`` (float32): what its ``k_proj`` and
    ``v_proj`` read, recorded at ``k_proj`` (wrapped for one forward, restored afterwards)."""
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    layers = [layer.self_attn for layer in model.layers]
    originals = [attn.k_proj for attn in layers]
    captures = [_InputCapture(p) for p in originals]
    try:
        for attn, cap in zip(layers, captures):
            attn.k_proj = cap
        mx.eval(model(tokens[None]))
    finally:
        for attn, proj in zip(layers, originals):
            attn.k_proj = proj
    out = []
    for cap in captures:
        if len(cap.out) != 1:
            raise ValueError(f"a layer's k_proj ran {len(cap.out)} times in one forward, expected 1")
        out.append(np.array(cap.out[0][0].astype(mx.float32)))
    return out


def calibrate_qfilters(model: nn.Module, tokens: list[int] | mx.array) -> np.ndarray:
    """Q-Filters ``[layers, kv_heads, head_dim]`` (float32) from the model's queries on ``tokens``."""
    queries, keys = capture_qk(model, tokens)
    return np.stack([qfilters_from_queries(q, k.shape[1]) for q, k in zip(queries, keys)])


def save_qfilters(path: str | Path, filters: np.ndarray, *, model: str, **meta: Any) -> None:
    """Write ``filters [layers, kv_heads, head_dim]`` and JSON metadata (``model`` and ``meta``)."""
    info = {"model": model, "method": "qfilters", "layers": int(filters.shape[0]),
            "kv_heads": int(filters.shape[1]), "head_dim": int(filters.shape[2]), **meta}
    np.savez(path, filters=np.asarray(filters, np.float32), metadata=np.array(json.dumps(info)))


def load_qfilters(path: str | Path | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """``(filters, metadata)`` from an artifact; ``None`` loads the shipped SmolLM2 filters."""
    if path is None:
        with resources.as_file(resources.files("velox.adapters") / "data" / SMOLLM2_ARTIFACT) as p:
            return _read(p)
    return _read(Path(path))


def _read(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    with np.load(path) as data:
        filters, info = data["filters"], json.loads(str(data["metadata"]))
    if filters.ndim != 3 or info.get("method") != "qfilters":
        raise ValueError(f"{path} is not a Q-Filters artifact")
    return filters, info


def _main() -> None:
    from velox.adapters.smollm2 import MODEL_DIRNAME, load_default_model

    model, tokenizer = load_default_model()
    tokens = tokenizer.encode(CALIBRATION_TEXT)
    filters = calibrate_qfilters(model, tokens)
    out = Path(__file__).parent / "data" / SMOLLM2_ARTIFACT
    out.parent.mkdir(exist_ok=True)
    save_qfilters(out, filters, model=MODEL_DIRNAME, tokens=len(tokens),
                  text="A Tale of Two Cities (opening) + Gettysburg Address",
                  rule="top right singular vector of the kv head's post-RoPE queries, "
                       "signed so they project positively")
    print(f"wrote {out}: filters {filters.shape} from {len(tokens)} tokens")


if __name__ == "__main__":
    _main()
