"""Reading phase records (schema ``mllm_rl.phase/1``, ``mllm_rl.phases.schema``).

Device truth: a record has, per local device, one entry per memory source; the first entry of
each device id is the device truth (``memory_stats`` on JAX TPU/GPU, ``live_arrays`` on JAX
CPU, ``mem_get_info`` on CUDA torch, ``live_tensors`` on torch CPU). ``truth`` picks those;
``allocator`` picks the torch allocator's entries (CUDA) when present.
"""

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
