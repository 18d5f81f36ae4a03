"""JAX memory probe: ``memory_stats()`` per local device, or live-array bytes on JAX CPU; and the
XLA compiles of this process, which the recorder puts in each phase's record."""

from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from typing import Any

import jax
import numpy as np

from mllm_rl.phases.probe import DeviceMemory


def live_array_bytes(devices: list[jax.Device], memory_kind: str = "device") -> list[int]:
    """Bytes of live (not deleted) jax arrays of ``memory_kind`` on each device, per addressable
    shard, each distinct buffer once (a ``device_put`` to where an array lives aliases it)."""
    index = {d: i for i, d in enumerate(devices)}
    out = [0] * len(devices)
    seen: set[tuple[int, int]] = set()
    for arr in jax.live_arrays():
        try:
            if arr.is_deleted():
                continue
            kind, shards = _layout(arr)
            if kind != memory_kind:
                continue
            for device, key, nbytes in shards:
                i = index.get(device)
                if i is None or (i, key) in seen:
                    continue
                seen.add((i, key))
                out[i] += nbytes
        except Exception:  # an array deleted by another thread between checks
            continue
    return out


# id(array) -> (weak reference, memory kind, shards): what an array holds does not change while
# it lives, and reading it (a Python object per shard) is most of a sample's cost on JAX CPU
_LAYOUTS: dict[int, tuple[Any, str, tuple[tuple[jax.Device, int, int], ...]]] = {}


def _layout(arr: jax.Array) -> tuple[str, tuple[tuple[jax.Device, int, int], ...]]:
    """``arr``'s memory kind and ``(device, buffer key, bytes)`` per addressable shard; kept for an
    array whose buffers are ready. The key is the buffer's address: ``unsafe_buffer_pointer()`` of
    a pending buffer blocks holding the GIL (a deadlock on JAX CPU), so one is keyed by its Array."""
    got = _LAYOUTS.get(id(arr))
    if got is not None and got[0]() is arr:
        return got[1], got[2]
    kind = arr.sharding.memory_kind or "device"
    shards, ready = [], True
    for shard in arr.addressable_shards:
        data = shard.data
        if data.is_ready():
            shards.append((shard.device, data.unsafe_buffer_pointer(), data.nbytes))
        else:
            ready = False
            shards.append((shard.device, -id(data), data.nbytes))
    layout = tuple(shards)
    if ready:  # forgotten when the array is freed, before its id can name another
        key = id(arr)
        _LAYOUTS[key] = (weakref.ref(arr, lambda _: _LAYOUTS.pop(key, None)), kind, layout)
    return kind, layout


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax/_src/dispatch.py
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # jax/_src/compiler.py


class CompileCounter:
    """XLA compiles since this process made it, from ``jax.monitoring`` (any thread's: sglang-jax
    compiles in its own): how many, their seconds, and how many the persistent cache answered.
    One per process (``compile_counter``): listeners cannot be taken back one by one in every JAX."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count, self.seconds, self.cache_hits = 0, 0.0, 0
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration_secs: float, **_: object) -> None:
        if event == BACKEND_COMPILE:
            with self._lock:
                self.count += 1
                self.seconds += duration_secs

    def _on_event(self, event: str, **_: object) -> None:
        if event == CACHE_HIT:
            with self._lock:
                self.cache_hits += 1

    def totals(self) -> tuple[int, float, int]:
        """(compiles, seconds, persistent-cache hits) so far."""
        with self._lock:
            return self.count, self.seconds, self.cache_hits


_COUNTER: list[CompileCounter] = []


def compile_counter() -> CompileCounter:
    """This process's ``CompileCounter``, made on first use."""
    if not _COUNTER:
        _COUNTER.append(CompileCounter())
    return _COUNTER[0]


class JaxMemoryProbe:
    """Snapshots of ``jax.local_devices()`` (device truth where the runtime has it)."""

    def __init__(self) -> None:
        self.devices = list(jax.local_devices())
        self._compiles = compile_counter()
        stats = self.devices[0].memory_stats() if self.devices else None
        self.has_stats = bool(stats)
        if self.devices and not self.has_stats and self.devices[0].platform != "cpu":
            d = self.devices[0]
            print(
                f"warning: {d.platform} device {d.device_kind!r} reports no memory_stats(): device memory is "
                "the sum of live arrays (records say source live_arrays; the allocator's own use is not seen)",
                file=sys.stderr,
                flush=True,
            )

    def compiles(self) -> tuple[int, float, int]:
        """``CompileCounter.totals`` of this process: the recorder's per-phase ``compiles``."""
        return self._compiles.totals()

    def in_use(self) -> list[int | None]:
        if self.has_stats:
            return [(d.memory_stats() or {}).get("bytes_in_use") for d in self.devices]
        return list(live_array_bytes(self.devices))

    def snapshot(self) -> list[DeviceMemory]:
        if not self.has_stats:
            used = live_array_bytes(self.devices)
            host = live_array_bytes(self.devices, "pinned_host")
            raw = [{"live_arrays_bytes": u, "pinned_host_bytes": h} for u, h in zip(used, host, strict=True)]
            return [
                DeviceMemory(d.id, d.platform, used[i], None, None, "live_arrays", raw[i])
                for i, d in enumerate(self.devices)
            ]
        out = []
        for d in self.devices:
            stats = d.memory_stats() or {}
            raw = {k: int(v) for k, v in stats.items() if isinstance(v, (int, np.integer))}
            used, peak, limit = (raw.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"))
            out.append(DeviceMemory(d.id, d.platform, used, peak, limit, "memory_stats", raw))
        return out


def per_device_counts() -> dict[str, int]:
    """Number of local devices per platform (for ``jax_ready`` info)."""
    return dict(Counter(d.platform for d in jax.local_devices()))
