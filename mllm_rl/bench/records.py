"""Reading phase records (``mllm_rl.phases.schema``): per local device one entry per memory source,
the first of each device id the device truth (``memory_stats``, ``live_arrays``, ``mem_get_info``
or ``live_tensors``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def truth(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The device-truth entry of each device (the first entry per id)."""
    seen, out = set(), []
    for d in devices:
        if d["id"] not in seen:
            seen.add(d["id"])
            out.append(d)
    return out


def allocator(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The torch allocator's entries (CUDA), else []."""
    return [d for d in devices if d.get("source") == "torch_allocator"]


def max_of(values: Sequence[int | None]) -> int | None:
    """The max of the values that are not None (None when there are none)."""
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None
