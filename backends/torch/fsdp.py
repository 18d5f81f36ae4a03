"""FSDP2 for the torch trainer: parameters, gradients and AdamW state sharded over the processes
(``Shard(0)`` DTensors, weights gathered per forward). Mixed precision gives the unsharded
trainer's numbers up to summation order. Gradients are summed, not FSDP2's mean: the loss is already
normalised by the whole mini-batch. ``full`` and ``save``/``load`` (DCP; a load reshards) are collectives.
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
    """A 1-D device mesh ``("fsdp",)`` of ``world`` processes (made outside a fake-tensor mode)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))


def shard(model: torch.nn.Module, mesh: Any, compute_dtype: torch.dtype | None) -> None:
    """``fully_shard`` every decoder layer of ``model``, then the model, over ``mesh``;
    ``compute_dtype``: the mixed-precision param dtype (None: the params'). Sets ``model.sharded``."""
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
    """The global L2 norm (float32 scalar) of sharded gradients."""
    import torch.distributed as dist

    sq = torch.stack([torch.linalg.vector_norm(local(g).float()) for g in grads]).pow(2).sum()
    dist.all_reduce(sq)
    return sq.sqrt()


def save(state: dict[str, Any], path: Path) -> None:
    """``state`` into ``path/dcp``: every process writes its shards (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(Path(path) / DCP_DIR))


def load(state: dict[str, Any], path: Path) -> None:
    """Fill ``state``'s tensors in place from ``path/dcp``, resharded to their placements."""
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
    """Whether the trainer shards (``--fsdp`` 0: every process, 1: none); ValueError naming the flag."""
    size = fsdp or world
    if size not in (1, world):
        raise ValueError(
            f"--fsdp {fsdp}: the torch trainer shards over every process ({world}; 0 says so) or "
            "over none (1: data parallel, every process holds the whole trainer)"
        )
    return world > 1 and size == world
