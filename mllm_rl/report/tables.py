"""Rows of the phase table (shared by the HTML page, ``summary.json`` and W&B)."""

from __future__ import annotations

from typing import Any

from mllm_rl.report.attempts import Attempt
from mllm_rl.report.memory import device_sum, diff, primary_devices, sources

PHASE_COLUMNS = (
    "run",
    "process",
    "attempt",
    "step",
    "phase",
    "idx",
    "seconds",
    "t_offset_s",
    "before_bytes",
    "after_bytes",
    "peak_bytes",
    "delta_bytes",
    "host_rss_bytes",
    "host_rss_peak_bytes",
    "source",
    "error",
)


def row_id(run_label: str, a: Attempt, attempts: int, r: dict[str, Any]) -> dict[str, Any]:
    """The columns that name a record in every per-record table: run, process, attempt (None when
    the process ran once), step, phase, idx."""
    return {
        "run": run_label,
        "process": a.process,
        "attempt": a.number if attempts > 1 else None,
        "step": r["step"],
        "phase": r["phase"],
        "idx": r["idx"],
    }


def phase_rows(run_label: str, attempts: dict[int, list[Attempt]], t0: float | None) -> list[dict[str, Any]]:
    """One row per record; device bytes are sums over the process's devices (most truthful source).

    ``secondary`` holds, per other source present (CUDA: ``torch_allocator`` next to
    ``mem_get_info``), the same sums.
    """
    rows = []
    for atts in attempts.values():
        for a in atts:
            for r in a.records:
                devs = r["memory"]["devices"]
                prim = primary_devices(devs)
                before = device_sum(r, "bytes_in_use_start")
                after = device_sum(r, "bytes_in_use")
                secondary = {
                    s: {
                        "before": device_sum(r, "bytes_in_use_start", s),
                        "after": device_sum(r, "bytes_in_use", s),
                        "peak": device_sum(r, "phase_peak_bytes", s),
                    }
                    for s in sources(devs)[1:]
                }
                host = r["memory"]["host"]
                rows.append(
                    {
                        **row_id(run_label, a, len(atts), r),
                        "seconds": r["t_end"] - r["t_start"],
                        "t_offset_s": None if t0 is None else r["t_start"] - t0,
                        "before_bytes": before,
                        "after_bytes": after,
                        "peak_bytes": device_sum(r, "phase_peak_bytes"),
                        "delta_bytes": diff(after, before),
                        "host_rss_bytes": host.get("rss_bytes"),
                        "host_rss_peak_bytes": host.get("rss_peak_bytes"),
                        "source": "+".join(sorted({str(d.get("source")) for d in prim})) or None,
                        "error": str(r["info"]["error"]) if r["info"].get("error") else None,
                        "secondary": secondary,
                    }
                )
    return rows
