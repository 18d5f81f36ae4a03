"""FSDP2 for the torch trainer: parameters, gradients and AdamW state sharded over the processes.

``shard`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer, then the model, over
a 1-D mesh (``make_mesh``; the planner's: a fake process group): each parameter a ``Shard(0)``
``DTensor``, AdamW's moments following. Layers gather weights in their forward hook and free them
after (``reshard_after_forward=True``, the root too, so a no-grad forward leaves nothing gathered).

Mixed precision: ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)`` gives the
unsharded trainer's numbers up to summation order. Reduction is a sum, not FSDP2's default mean
(``set_gradient_divide_factor(1)``; gloo has no pre-multiplied sum), because the loss is already
normalised by the whole mini-batch's tokens.

``full`` and ``save``/``load`` (``torch.distributed.checkpoint``; a load reshards, so a checkpoint
resumes on another process count) are collectives: every process calls them in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

DCP_DIR = "dcp"  # a checkpoint's torch.distributed.checkpoint directory (``<step dir>/dcp``)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of ``t`` (``t`` itself when it is not a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole ``t`` on this process (an all-gather of a ``DTensor``: every process calls it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def make_mesh(world: int, device: torch.device) -> Any:
    """A 1-D device mesh ``("fsdp",)`` of ``world`` processes on ``device``'s type (made outside a
    fake-tensor mode: it reads real values)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))


def shard(model: torch.nn.Module, mesh: Any, compute_dtype: torch.dtype | None) -> None:
    """``fully_shard`` every decoder layer of ``model`` (a ``Qwen3``), then the model, over
    ``mesh`` (``make_mesh``); ``compute_dtype``: the mixed-precision policy's param dtype
    (``None``: compute in the params' own dtype). Sets ``model.sharded``."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    model.sharded = True


def grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm (float32 scalar) of sharded gradients: the shards' sums of squares,
    summed over the processes."""
    import torch.distributed as dist

    sq = torch.stack([torch.linalg.vector_norm(local(g).float()) for g in grads]).pow(2).sum()
    dist.all_reduce(sq)
    return sq.sqrt()


def save(state: dict[str, Any], path: Path) -> None:
    """``state`` (DTensors, tensors, Python values) into ``path/dcp``: every process writes its
    shards, process 0 the metadata (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(Path(path) / DCP_DIR))


def load(state: dict[str, Any], path: Path) -> None:
    """Fill ``state``'s tensors in place from ``path/dcp`` (resharded to their placements; a
    collective when the run has several processes)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    one = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # one process on purpose (a sharded checkpoint resumed unsharded)
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        dcp.load(state, checkpoint_id=str(Path(path) / DCP_DIR), no_dist=one)


def has_checkpoint(path: Path) -> bool:
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def resolve(fsdp: int, world: int) -> bool:
    """Whether the trainer shards (``--fsdp``: 0, every process; 1, none: every process holds the
    whole trainer, data parallel; else it must be the process count); ``ValueError`` naming the flag."""
    size = fsdp or world
    if size not in (1, world):
        raise ValueError(
            f"--fsdp {fsdp}: the torch trainer shards over every process ({world}; 0 says so) or "
            "over none (1: data parallel, every process holds the whole trainer)"
        )
    return world > 1 and size == world
