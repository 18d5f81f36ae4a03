"""Multi-process torch (a process per GPU of a node, or N CPU processes) through ``torch.distributed``,
joined by torchrun's variables (``WORLD_SIZE`` unset or 1: untouched); NCCL for CUDA tensors, gloo
for CPU tensors and Python objects."""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping, Sequence
from typing import Any

from mllm_rl.coordination import ProcessCoordinator

ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_ENV = "MLLM_RL_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Procs:
    index: int = 0
    count: int = 1
    local_index: int = 0


_procs = Procs()


def config_from_env(env: Mapping[str, str] | None = None) -> Procs:
    """This process in the run per torchrun's variables; ValueError naming a bad one."""
    env = os.environ if env is None else env
    raw = env.get("WORLD_SIZE")
    if raw in (None, "", "1"):
        return Procs()

    def num(name: str, low: int) -> int:
        if name not in env:
            raise ValueError(f"{name} is not set (WORLD_SIZE={raw}: torchrun's variables {', '.join(ENV)})")
        try:
            value = int(env[name])
        except ValueError:
            raise ValueError(f"{name}={env[name]!r}: expected an integer") from None
        if value < low:
            raise ValueError(f"{name}={env[name]!r}: must be >= {low}")
        return value

    world, rank = num("WORLD_SIZE", 1), num("RANK", 0)
    if rank >= world:
        raise ValueError(f"RANK={rank}: must be < WORLD_SIZE={world}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            raise ValueError(f"{name} is not set (WORLD_SIZE={world}: torchrun's variables {', '.join(ENV)})")
    return Procs(rank, world, num("LOCAL_RANK", 0) if "LOCAL_RANK" in env else rank)


def init_distributed() -> Procs:
    """Join the run the environment describes (``torch.distributed.init_process_group``)."""
    global _procs
    procs = config_from_env()
    if procs.count == 1 or _joined():
        _procs = procs
        return procs
    import torch
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    try:
        dist.init_process_group(backend, rank=procs.index, world_size=procs.count, timeout=timeout)
    except Exception as e:  # noqa: BLE001 -- the store or a peer: one line
        raise RuntimeError(f"torch.distributed: process {procs.index} could not join the run: {e}") from None
    _procs = procs
    return procs


def _joined() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def procs() -> Procs:
    return _procs


def shutdown() -> None:
    """Leave the run (a barrier first, so no process exits while another still talks to it)."""
    if _procs.count == 1 or not _joined():
        return
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def gather_objects(value: Any) -> list[Any]:
    """Every process's ``value`` (picklable), in process order."""
    if _procs.count == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * _procs.count
    dist.all_gather_object(out, value)
    return out


def all_reduce_sum(tensors: Sequence[Any]) -> None:
    """Sum ``tensors`` over the processes in place (one flat buffer per dtype and device)."""
    if _procs.count == 1 or not tensors:
        return
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple[Any, Any], list[Any]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        flat = _flatten_dense_tensors(ts)
        dist.all_reduce(flat)
        with torch.no_grad():
            for t, r in zip(ts, _unflatten_dense_tensors(flat, ts), strict=True):
                t.copy_(r)


def gather_named(name: str, value: str) -> list[str]:
    """Every process's ``value`` for ``name`` (RuntimeError when processes are at different gathers)."""
    got = gather_objects((name, value))
    names = {n for n, _ in got}
    if names != {name}:
        raise RuntimeError(f"processes gathered different things at once: {sorted(names)}")
    return [v for _, v in got]


def coordination() -> ProcessCoordinator:
    """``mllm_rl.coordination.Coordinator`` over ``torch.distributed`` (rewards, checkpoints)."""
    return ProcessCoordinator(procs, gather_named)
