"""Memory probes: what a backend must provide, plus the host (process RSS) probe."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import psutil


@dataclasses.dataclass
class DeviceMemory:
    """One device at one instant. ``None`` = cannot be measured here."""

    id: int
    platform: str
    bytes_in_use: int | None
    peak_bytes_in_use: int | None  # the allocator's cumulative peak, if it has one
    bytes_limit: int | None
    source: str
    raw: dict[str, Any] = dataclasses.field(default_factory=dict)


class MemoryProbe(Protocol):
    """Per-backend view of the local devices: ``snapshot`` in ``jax.local_devices()`` / CUDA index
    order, ``in_use`` cheap per-device bytes in the same order (called by the sampler)."""

    def snapshot(self) -> list[DeviceMemory]: ...

    def in_use(self) -> list[int | None]: ...


class NullProbe:
    """No devices (used before a backend is up, and by core tests)."""

    def snapshot(self) -> list[DeviceMemory]:
        return []

    def in_use(self) -> list[int | None]:
        return []


_PROC = psutil.Process()


def host_rss() -> int:
    """Resident set size of this process, bytes."""
    return int(_PROC.memory_info().rss)
