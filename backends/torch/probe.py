"""Torch memory probes (``mllm_rl.phases.probe.MemoryProbe``).

CUDA (``CudaMemoryProbe``): per device two entries with the same ``id``, in this order:

- ``source="mem_get_info"``: driver truth, ``bytes_in_use = total - free`` (everything on the
  device, other processes included; the only number that sees torch_memory_saver / SGLang
  releases, which happen below the torch allocator), ``bytes_limit = total``, no peak;
  ``raw`` has ``free``/``total`` and, when ``pynvml`` is importable, this process's bytes as
  NVML reports them (``nvml_process_bytes``);
- ``source="torch_allocator"``: ``memory_allocated`` / ``max_memory_allocated`` (reset per
  phase by ``reset_peak``), ``bytes_limit = total``; ``raw`` has the allocator's current
  reserved/active/inactive-split bytes and counters.

CPU (``CpuTensorProbe``): one entry ``id=0, platform="cpu", source="live_tensors"``: bytes of
the distinct storages (by ``data_ptr``) of every live CPU tensor, found by a scan of
``gc.get_objects()``. A scan costs about 50 ms with ~230k live Python objects (torch,
transformers and wandb imported; 2-core Xeon), so ``in_use()`` called from the recorder's
sampler thread is rate-limited: it rescans at most once per ``max(min_interval_s, 10 x the
last scan's duration)`` and returns the cached value otherwise (<= ~10 % of one core).
Calls from any other thread (``PhaseRecorder.sample()`` at a plan's known high points,
``snapshot()``) always rescan, so explicit samples are exact. Host RSS is recorded by the
core separately.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from typing import Any

import torch

from mllm_rl.phases.probe import DeviceMemory

SAMPLER_THREAD = "mllm_rl-mem-sampler"  # the name PhaseRecorder gives its sampler thread


def _tensor_types() -> set[type]:
    out, todo = set(), [torch.Tensor]
    while todo:
        t = todo.pop()
        if t not in out:
            out.add(t)
            todo.extend(t.__subclasses__())
    return out


def live_cpu_tensor_bytes() -> tuple[int, int]:
    """(bytes of distinct live CPU tensor storages, number of live tensors) of this process."""
    types = _tensor_types()
    objs = gc.get_objects()
    tensors = list(itertools.compress(objs, map(types.__contains__, map(type, objs))))
    del objs
    storages: dict[int, int] = {}
    for t in tensors:
        try:
            if t.device.type != "cpu" or t.is_sparse:
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # meta / wrapper tensors without storage
            continue
        if n:
            storages[ptr] = max(n, storages.get(ptr, 0))
    return sum(storages.values()), len(tensors)


class CpuTensorProbe:
    """torch on CPU: live tensor storage bytes (see the module docstring)."""

    def __init__(self, min_interval_s: float = 0.1) -> None:
        self.min_interval_s = min_interval_s
        self.last_scan_s = 0.0
        self._cached: int | None = None
        self._t_cached = 0.0
        self._lock = threading.Lock()

    def _scan(self) -> tuple[int, int]:
        t0 = time.perf_counter()
        used, n = live_cpu_tensor_bytes()
        t1 = time.perf_counter()
        with self._lock:
            self.last_scan_s = t1 - t0
            self._cached, self._t_cached = used, t1
        return used, n

    def in_use(self) -> list[int | None]:
        if threading.current_thread().name == SAMPLER_THREAD:
            with self._lock:
                fresh = time.perf_counter() - self._t_cached < max(self.min_interval_s, 10 * self.last_scan_s)
                cached = self._cached
            if fresh and cached is not None:
                return [cached]
        return [self._scan()[0]]

    def snapshot(self) -> list[DeviceMemory]:
        used, n = self._scan()
        raw = {"live_tensors_bytes": used, "live_tensors": n, "scan_ms": round(self.last_scan_s * 1e3, 3)}
        return [DeviceMemory(0, "cpu", used, None, None, "live_tensors", raw)]


class CudaMemoryProbe:
    """Every visible CUDA device: driver truth and torch allocator (see the module docstring)."""

    RAW_KEYS = (
        "reserved_bytes.all.current", "reserved_bytes.all.peak", "active_bytes.all.current",
        "inactive_split_bytes.all.current", "allocated_bytes.all.current", "num_alloc_retries", "num_ooms",
    )  # fmt: skip

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
        for d in self.devices:
            free, total = (int(x) for x in torch.cuda.mem_get_info(d))
            raw: dict[str, Any] = {"free": free, "total": total}
            nvml = self._nvml_process_bytes(d)
            if nvml is not None:
                raw["nvml_process_bytes"] = nvml
            out.append(DeviceMemory(d, "cuda", total - free, None, total, "mem_get_info", raw))
            stats = torch.cuda.memory_stats(d)
            alloc_raw = {k: int(stats[k]) for k in self.RAW_KEYS if k in stats}
            out.append(DeviceMemory(d, "cuda", int(torch.cuda.memory_allocated(d)),
                                    int(torch.cuda.max_memory_allocated(d)), total, "torch_allocator", alloc_raw))
        return out  # fmt: skip


def make_probe(device: torch.device) -> CpuTensorProbe | CudaMemoryProbe:
    return CudaMemoryProbe() if device.type == "cuda" else CpuTensorProbe()
