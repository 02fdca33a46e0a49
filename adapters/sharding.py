"""mlx-lm's tensor-parallel models, read for velox caches.

mlx-lm shards a model over an ``mx.distributed`` group (``model.shard(group)``, which
``mlx_lm.utils.sharded_load`` calls): every attention layer's ``q_proj``, ``k_proj`` and
``v_proj`` become ``AllToShardedLinear`` layers over the group (each process computes a
contiguous slice of the heads: process ``r`` of ``n`` the kv heads ``[r h, (r + 1) h)``),
``o_proj`` a ``ShardedToAllLinear`` (an ``all_sum``), and ``n_heads``, ``n_kv_heads`` are
divided by ``n``. A cache of such a layer sees its process's ``h`` kv heads.

:func:`model_heads` finds the group from the projections and returns the
:class:`velox.distributed.Heads` record every cache of the model is made with (``make_cache``
hands it to each state's ``init``); it refuses, naming the numbers, a model whose heads do
not divide among the processes (mlx-lm's ``shard`` divides the head counts without checking)
or whose layers are sharded over different groups. :func:`check_method` refuses what a
method cannot do there. Nothing here changes the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear

from velox.distributed import LOCAL, Heads, heads_of
from velox.registry import Method

__all__ = ["model_heads", "pipeline_stages", "check_method", "shard_artifact", "launched_group",
           "load_sharded"]

_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)


def _attention(layer: nn.Module) -> Any:
    return getattr(layer, "self_attn", None)


def _group(proj: Any) -> Any:
    return proj.group if isinstance(proj, _SHARDED) else None


def _out_dims(proj: Any) -> int:
    """Output features a projection computes here (a quantized one packs its weight's
    columns, never its rows)."""
    return int(proj.weight.shape[0])


def model_heads(model) -> Heads:
    """The kv heads this process holds of every attention layer of ``model``:
    :data:`velox.distributed.LOCAL` for a model that is not tensor-parallel, else the record
    of its shard (``model.shard(group)``). A ``ValueError`` where the model's sharding cannot
    hold a velox cache (heads that do not divide among the processes, layers over different
    groups)."""
    found: list[tuple[int, Any]] = []
    for i, layer in enumerate(model.layers):
        attn = _attention(layer)
        if attn is None:
            continue
        groups = [_group(getattr(attn, p, None)) for p in ("q_proj", "k_proj", "v_proj")]
        if all(g is None for g in groups):
            continue
        if any(g is None for g in groups):
            raise ValueError(f"layer {i}: q_proj, k_proj and v_proj are not sharded alike "
                             "(velox caches take models sharded by mlx-lm's model.shard)")
        sizes = {int(g.size()) for g in groups}
        ranks = {int(g.rank()) for g in groups}
        if len(sizes) > 1 or len(ranks) > 1:
            raise ValueError(f"layer {i}: its projections are sharded over different groups")
        found.append((i, groups[1], attn))
    if not found:
        return LOCAL
    i, group, _ = found[0]
    n, r = int(group.size()), int(group.rank())
    for j, g, _ in found[1:]:
        if int(g.size()) != n or int(g.rank()) != r:
            raise ValueError(f"layers {i} and {j} are sharded over different groups "
                             f"({n} and {int(g.size())} processes): one group holds every layer")
    if len(found) != sum(_attention(layer) is not None for layer in model.layers):
        raise ValueError("some attention layers of the model are sharded and some are not")
    args = getattr(model, "args", None)
    for j, _, attn in found:
        _check_heads(j, attn, n, args)
    return heads_of(group)


def _check_heads(i: int, attn: Any, n: int, args: Any) -> None:
    """Layer ``i``'s heads divide among ``n`` processes, every process computing whole heads
    (mlx-lm's ``shard`` divides ``n_heads`` and ``n_kv_heads`` without checking)."""
    kv, q = int(attn.n_kv_heads), int(attn.n_heads)
    total_kv = getattr(args, "num_key_value_heads", None) or kv * n
    total_q = getattr(args, "num_attention_heads", None) or q * n
    head_dim = getattr(attn, "head_dim", None) or (_out_dims(attn.k_proj) // kv if kv else 0)
    rows = _out_dims(attn.k_proj)
    if total_kv % n or total_q % n or kv * n != total_kv or q * n != total_q or kv * head_dim != rows:
        raise ValueError(
            f"layer {i}: the model's {total_kv} kv heads and {total_q} query heads do not divide "
            f"among {n} processes (this one computes {rows} key features, {rows / max(head_dim, 1):g} "
            f"heads of {head_dim}): a velox cache holds whole kv heads; shard the model over a "
            f"number of processes that divides {total_kv}")


def pipeline_stages(model) -> int:
    """The pipeline stages ``model`` runs over (mlx-lm's ``model.model.pipeline(group)``: each
    process holds some of the layers); 1 where it is not pipelined."""
    inner = getattr(model, "model", None)
    return int(getattr(inner, "pipeline_size", 1) or 1)


def check_method(m: Method, heads: Heads, stages: int) -> None:
    """A ``ValueError`` where method ``m`` cannot hold caches of a sharded model: a method
    whose state cannot be split by heads (its spec's ``heads = "unshardable"``) on a
    tensor-parallel shard, a cross-layer method on a pipelined model (its model-level record
    spans layers that other processes hold)."""
    if heads.shards > 1 and m.spec.heads == "unshardable":
        raise ValueError(f"{m.key} cannot run on a tensor-parallel model ({heads.shards} processes "
                         f"hold each layer's kv heads): {m.spec.heads_note}")
    if stages > 1 and m.layer_update is not None:
        raise ValueError(f"{m.key} threads a record through every layer of the model; a "
                         f"pipelined model ({stages} stages) holds some layers a process")


def shard_artifact(arrays: dict, heads: Heads, kv_heads: int) -> dict:
    """One layer's calibration arrays (``[kv_heads of the layer, ...]``, one fit a kv head)
    cut to the ``kv_heads`` a shard holds."""
    if heads.shards == 1:
        return arrays
    first = heads.shard * kv_heads
    return {k: v[first:first + kv_heads] for k, v in arrays.items()}


def launched_group() -> Any:
    """The group of the processes ``mlx.launch`` started this one with (``mx.distributed.init()``:
    ring, MPI, NCCL or JACCL, whichever its environment names), or ``None`` for a process on
    its own."""
    group = mx.distributed.init()
    return group if int(group.size()) > 1 else None


def load_sharded(path_or_repo: str | None, group: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a model folder (``None``: the embedded SmolLM2; or a cached
    hub repo) sharded tensor-parallel over ``group`` by mlx-lm's ``sharded_load`` (each
    process loads its slice of the weights). The embedded model is converted by process 0
    first, the others waiting (one folder, written once)."""
    from mlx_lm.utils import sharded_load

    from velox.adapters import smollm2

    if path_or_repo is None:
        root = smollm2.default_cache_dir()
        if group.rank() == 0:
            folder = smollm2._ensure_converted(root, True)
        mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))  # converted
        if group.rank() != 0:
            folder = smollm2._ensure_converted(root, False)
    else:
        folder = Path(path_or_repo).expanduser()
        if not folder.exists():
            from mlx_lm.utils import hf_repo_to_path

            folder = hf_repo_to_path(str(path_or_repo))
    return sharded_load(str(folder), tensor_group=group)
