"""Torch memory probes (``mllm_rl.phases.probe.MemoryProbe``).

CUDA: two entries per device, in this order: ``mem_get_info`` (driver truth, ``total - free``, the
only number that sees torch_memory_saver / SGLang releases; ``raw`` adds this process's NVML bytes)
and ``torch_allocator`` (``memory_allocated`` / peak; ``raw``: allocator counters, ``paused_bytes``,
``largest_blocks``: the sizes of its largest allocated blocks, which name what an unplanned
remainder is, e.g. cuBLAS's workspaces of 32 MiB each on sm90).
CPU (``live_tensors``): bytes of the distinct storages in the ``held_tensors()`` of ``track``ed holders.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from mllm_rl.phases.probe import DeviceMemory

_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()


def track(holder: Any) -> None:
    """Count ``holder.held_tensors()`` (an iterable of tensors) in the CPU probe."""
    _HOLDERS.add(holder)


def tracked_cpu_bytes() -> tuple[int, int]:
    """(bytes of the distinct CPU storages the holders keep, number of tensors)."""
    storages: dict[int, int] = {}
    n = 0
    for holder in list(_HOLDERS):
        for t in list(holder.held_tensors()):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            n += 1
            st = t.untyped_storage()
            if st.nbytes():
                storages[st.data_ptr()] = max(st.nbytes(), storages.get(st.data_ptr(), 0))
    return sum(storages.values()), n


def paused_cuda_bytes(device: int) -> int | None:
    """Bytes the tracked holders have paused on CUDA ``device``, or None when none pauses there."""
    total: int | None = None
    for holder in list(_HOLDERS):
        paused = getattr(holder, "paused_device_bytes", None)
        got = paused() if paused is not None else None
        if got is not None and got[0] == device:
            total = (total or 0) + got[1]
    return total


class CpuTensorProbe:
    """torch on CPU: bytes of the tensors the engine and trainer hold (module docstring)."""

    def in_use(self) -> list[int | None]:
        return [tracked_cpu_bytes()[0]]

    def snapshot(self) -> list[DeviceMemory]:
        used, n = tracked_cpu_bytes()
        raw = {"live_tensors_bytes": used, "tensors": n}
        return [DeviceMemory(0, "cpu", used, None, None, "live_tensors", raw)]


def largest_blocks(segments: list[dict[str, Any]], device: int, n: int = 8) -> list[int]:
    """The ``n`` largest allocated block sizes (bytes, largest first) on ``device`` in a
    ``torch.cuda.memory_snapshot()`` (segments, each with its ``blocks`` and their ``state``)."""
    sizes = [
        int(b["size"])
        for seg in segments
        if seg.get("device") == device
        for b in seg.get("blocks", [])
        if b.get("state") == "active_allocated"
    ]
    return sorted(sizes, reverse=True)[:n]


class CudaMemoryProbe:
    """Every visible CUDA device: driver truth and torch allocator (see the module docstring)."""

    RAW_KEYS = tuple(
        "reserved_bytes.all.current reserved_bytes.all.peak active_bytes.all.current "
        "inactive_split_bytes.all.current allocated_bytes.all.current num_alloc_retries num_ooms".split()
    )

    def __init__(self) -> None:
        self.devices = list(range(torch.cuda.device_count()))
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # not installed, or no NVML on this host: raw simply lacks the key
            self._nvml = None

    def reset_peak(self) -> None:
        for d in self.devices:
            torch.cuda.reset_peak_memory_stats(d)

    def in_use(self) -> list[int | None]:
        out: list[int | None] = []
        for d in self.devices:
            free, total = torch.cuda.mem_get_info(d)
            out += [int(total - free), int(torch.cuda.memory_allocated(d))]
        return out

    def _nvml_process_bytes(self, d: int) -> int | None:
        if self._nvml is None:
            return None
        import os

        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(d)
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory is not None]
        return int(sum(mine)) if mine else None

    def snapshot(self) -> list[DeviceMemory]:
        out = []
        segments = torch.cuda.memory_snapshot()
        for d in self.devices:
            free, total = (int(x) for x in torch.cuda.mem_get_info(d))
            raw: dict[str, Any] = {"free": free, "total": total}
            nvml = self._nvml_process_bytes(d)
            if nvml is not None:
                raw["nvml_process_bytes"] = nvml
            out.append(DeviceMemory(d, "cuda", total - free, None, total, "mem_get_info", raw))
            stats = torch.cuda.memory_stats(d)
            alloc_raw = {k: int(stats[k]) for k in self.RAW_KEYS if k in stats}
            paused = paused_cuda_bytes(d)
            if paused is not None:
                alloc_raw["paused_bytes"] = paused
            alloc_raw["largest_blocks"] = largest_blocks(segments, d)
            used, peak = int(torch.cuda.memory_allocated(d)), int(torch.cuda.max_memory_allocated(d))
            out.append(DeviceMemory(d, "cuda", used, peak, total, "torch_allocator", alloc_raw))
        return out


def make_probe(device: torch.device) -> CpuTensorProbe | CudaMemoryProbe:
    return CudaMemoryProbe() if device.type == "cuda" else CpuTensorProbe()
