"""Memory numbers of one record: which device entry to trust, sums, and display units. A device
listed under several ``source``s (CUDA: ``mem_get_info`` and ``torch_allocator``) is summed and charted
by its most truthful entry (``SOURCE_PRIORITY``); the others are "secondary"."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mllm_rl.report.load import Record

SOURCE_PRIORITY = ("mem_get_info", "memory_stats", "torch_allocator", "live_arrays", "live_tensors", "host")
TRUTH = "mem_get_info"
_RANK = {s: i for i, s in enumerate(SOURCE_PRIORITY)}

Device = dict[str, Any]


def primary_devices(devices: list[Device]) -> list[Device]:
    """One entry per device id (the most truthful source), in order of first appearance."""
    best: dict[Any, Device] = {}
    for d in devices:
        cur = best.get(d.get("id"))
        if cur is None or _RANK.get(d.get("source"), 99) < _RANK.get(cur.get("source"), 99):
            best[d.get("id")] = d
    return list(best.values())


def sources(devices: list[Device]) -> list[str]:
    """The sources present, most truthful first."""
    return sorted({str(d.get("source")) for d in devices}, key=lambda s: _RANK.get(s, 99))


def total(values: Iterable[int | None]) -> int | None:
    """Sum, or ``None`` when there is nothing to sum or any value is unknown."""
    vals = list(values)
    return None if not vals or None in vals else sum(v for v in vals if v is not None)


def device_sum(rec: Record, key: str, source: str | None = None) -> int | None:
    """``key`` summed over the record's devices (primary entries, or one ``source``); ``None`` if unknown."""
    devs = rec["memory"]["devices"]
    chosen = primary_devices(devs) if source is None else [d for d in devs if d.get("source") == source]
    return total(d.get(key) for d in chosen)


def diff(a: int | None, b: int | None) -> int | None:
    """``a - b``, ``None`` when either is unknown."""
    return None if a is None or b is None else a - b


def device_name(d: Device) -> str:
    return f"{d.get('platform')}:{d.get('id')}"


# -- display ---------------------------------------------------------------------------------------

UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def pick_unit(max_bytes: float | None) -> tuple[int, str]:
    """The largest binary unit in which ``max_bytes`` is at least 1 (GiB for big runs, MiB for tiny)."""
    for div, name in UNITS:
        if max_bytes is not None and max_bytes >= div:
            return div, name
    return UNITS[1]


def fmt_bytes(v: int | float | None, unit: tuple[int, str], signed: bool = False) -> str:
    """``v`` in ``unit`` (3 significant decimals); ``-`` when unknown."""
    return "-" if v is None else f"{v / unit[0]:+.3f}" if signed else f"{v / unit[0]:.3f}"


def fmt_num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_seconds(v: float | None) -> str:
    """Seconds with 3 decimals; a nonzero duration below a millisecond in scientific notation (not 0.000)."""
    return "-" if v is None else f"{v:.1e}" if 0 < abs(v) < 0.0005 else f"{v:.3f}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"
