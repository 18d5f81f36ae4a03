"""A human-readable table of phase records (printed at the end of ``mllm_rl.run``)."""

from __future__ import annotations

from typing import Any

from mllm_rl.report.memory import primary_devices


def gib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**30:.3f}"


def _sum(devices: list[dict[str, Any]], key: str) -> int | None:
    """``key`` summed over one entry per device (CUDA records list a device twice: driver truth and
    allocator; see ``report.memory.primary_devices``), skipping unknown values."""
    vals = [d[key] for d in primary_devices(devices) if d.get(key) is not None]
    return sum(vals) if vals else None


def phase_table(records: list[dict[str, Any]]) -> str:
    """One line per phase: seconds, device bytes at start/end/peak (summed over devices, GiB),
    host RSS and its peak (GiB), and an error marker."""
    head = f"{'phase':<22} {'step':>4} {'sec':>7} {'dev start':>10} {'dev end':>9} {'dev peak':>9} {'rss':>7} {'rss peak':>8}"
    lines = [head, "-" * len(head)]
    for r in records:
        devs = r["memory"]["devices"]
        host = r["memory"]["host"]
        step = "-" if r.get("step") is None else str(r["step"])
        err = "  ERROR: " + r["info"]["error"][:60] if r["info"].get("error") else ""
        lines.append(
            f"{r['phase']:<22} {step:>4} {r['t_end'] - r['t_start']:>7.2f} {gib(_sum(devs, 'bytes_in_use_start')):>10} "
            f"{gib(_sum(devs, 'bytes_in_use')):>9} {gib(_sum(devs, 'phase_peak_bytes')):>9} "
            f"{gib(host['rss_bytes']):>7} {gib(host['rss_peak_bytes']):>8}{err}"
        )
    return "\n".join(lines)


def step_table(records: list[dict[str, Any]]) -> str:
    """Step phases aggregated by name over every step: count, mean/max seconds, the largest
    device peak (summed over devices, GiB) and the largest host RSS peak."""
    order: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        order.setdefault(r["phase"], []).append(r)
    head = f"{'step phase':<22} {'n':>4} {'sec mean':>9} {'sec max':>8} {'dev peak max':>13} {'rss peak max':>13}"
    lines = [head, "-" * len(head)]
    for name, rs in order.items():
        secs = [r["t_end"] - r["t_start"] for r in rs]
        peaks = [p for p in (_sum(r["memory"]["devices"], "phase_peak_bytes") for r in rs) if p is not None]
        rss = max(r["memory"]["host"]["rss_peak_bytes"] for r in rs)
        errs = sum(1 for r in rs if r["info"].get("error"))
        lines.append(
            f"{name:<22} {len(rs):>4} {sum(secs) / len(secs):>9.3f} {max(secs):>8.3f} "
            f"{gib(max(peaks) if peaks else None):>13} {gib(rss):>13}" + (f"  ERRORS: {errs}" if errs else "")
        )
    return "\n".join(lines)
