"""Host memory that grows step after step, found from the host RSS every phase record carries: the
leak that ends colocated runs after tens of steps (google/tunix#1149: sglang-jax runs OOM-killed).

Per process, the RSS at the end of each RL step from ``FIRST_STEP`` on (step 0's compile caches
stay). A ``host_growth`` warning needs ``MIN_STEPS`` steps, an average rise above
``MIN_MIB_PER_STEP`` MiB per step, and more than half that in each step (a compile of one new
shape is one jump, not a slope). The ``host_leak_mb`` fault exercises it."""

from __future__ import annotations

from typing import Any

from mllm_rl.report.issues import WARNING, Issue
from mllm_rl.report.load import Run

MIB = 2**20
FIRST_STEP = 1
MIN_STEPS = 4  # steps measured from FIRST_STEP on: three step-over-step rises
MIN_MIB_PER_STEP = 32


def step_rss(records: list[dict[str, Any]]) -> dict[int, int]:
    """Step -> host RSS bytes at the end of its last record (records in recording order)."""
    out: dict[int, int] = {}
    for r in records:
        step, host = r.get("step"), (r.get("memory") or {}).get("host") or {}
        if isinstance(step, int) and host.get("rss_bytes") is not None:
            out[step] = int(host["rss_bytes"])
    return out


def growth(rss: dict[int, int]) -> tuple[float, list[int]] | None:
    """(MiB per step, the steps) when ``rss`` (step -> bytes) grows like a leak (module docstring)."""
    steps = sorted(s for s in rss if s >= FIRST_STEP)
    if len(steps) < MIN_STEPS:
        return None
    vals = [rss[s] for s in steps]
    per_step = (vals[-1] - vals[0]) / MIB / (steps[-1] - steps[0])
    rising = all(b - a > MIN_MIB_PER_STEP * MIB / 2 for a, b in zip(vals, vals[1:], strict=False))
    return (per_step, steps) if rising and per_step > MIN_MIB_PER_STEP else None


def host_growth(run: Run) -> list[Issue]:
    issues = []
    for proc, records in run.records.items():
        rss = step_rss(records)
        found = growth(rss)
        if found is None:
            continue
        per_step, steps = found
        a, b = steps[0], steps[-1]
        issues.append(
            Issue(
                run.label,
                "host_growth",
                f"host RSS grew {per_step:.1f} MiB per step from step {a} to step {b} "
                f"({rss[a] / MIB:.1f} -> {rss[b] / MIB:.1f} MiB at the end of each step, rising in every one): "
                "host memory that is never freed, which ends a long run in the host's OOM killer",
                severity=WARNING,
                process=proc,
            )
        )
    return issues
