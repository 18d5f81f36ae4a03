"""A human-readable table of phase records (printed at the end of ``mllm_rl.run``)."""

from __future__ import annotations

from typing import Any

from mllm_rl.report.memory import primary_devices
from mllm_rl.text_table import aligned


def gib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**30:.3f}"


def _sum(devices: list[dict[str, Any]], key: str) -> int | None:
    """``key`` summed over one entry per device (``report.memory.primary_devices``), skipping unknowns."""
    vals = [d[key] for d in primary_devices(devices) if d.get(key) is not None]
    return sum(vals) if vals else None


def phase_table(records: list[dict[str, Any]]) -> str:
    """One line per phase: seconds, device bytes at start/end/peak (summed over devices, GiB),
    host RSS and its peak (GiB), and an error marker."""
    rows = [["phase", "step", "sec", "dev start", "dev end", "dev peak", "rss", "rss peak", ""]]
    for r in records:
        devs, host = r["memory"]["devices"], r["memory"]["host"]
        rows.append(
            [r["phase"], "-" if r.get("step") is None else str(r["step"]), f"{r['t_end'] - r['t_start']:.2f}"]
            + [gib(_sum(devs, k)) for k in ("bytes_in_use_start", "bytes_in_use", "phase_peak_bytes")]
            + [gib(host["rss_bytes"]), gib(host["rss_peak_bytes"])]
            + ["ERROR: " + r["info"]["error"][:60] if r["info"].get("error") else ""]
        )
    return "\n".join(aligned(rows, rule=True, free_last=True))


def step_table(records: list[dict[str, Any]]) -> str:
    """Step phases aggregated by name over every step: count, mean/max seconds, the largest
    device peak (summed over devices, GiB) and the largest host RSS peak."""
    order: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        order.setdefault(r["phase"], []).append(r)
    rows = [["step phase", "n", "sec mean", "sec max", "dev peak max", "rss peak max", ""]]
    for name, rs in order.items():
        secs = [r["t_end"] - r["t_start"] for r in rs]
        peaks = [p for p in (_sum(r["memory"]["devices"], "phase_peak_bytes") for r in rs) if p is not None]
        rss = max(r["memory"]["host"]["rss_peak_bytes"] for r in rs)
        errs = sum(1 for r in rs if r["info"].get("error"))
        rows.append(
            [name, str(len(rs)), f"{sum(secs) / len(secs):.3f}", f"{max(secs):.3f}",
             gib(max(peaks) if peaks else None), gib(rss), f"ERRORS: {errs}" if errs else ""]
        )  # fmt: skip
    return "\n".join(aligned(rows, rule=True, free_last=True))
