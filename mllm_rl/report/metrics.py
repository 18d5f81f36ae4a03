"""Per-step RL metrics carried in phase ``info`` (e.g. ``train_step``: ``reward_mean``, ``loss``).

Generic over phase names: every finite numeric ``info`` value of a step record is a series
``<phase>.<key>`` over steps, except byte counts (``*_bytes``, memory is charted elsewhere) and
bookkeeping keys; reward/loss/kl first, constant series last, at most ``MAX_SERIES``. Values come from the lowest process index; when a step was re-run by a
resumed attempt, the last value wins.
"""

from __future__ import annotations

import math
from typing import Any

from mllm_rl.report.load import Run

SKIP_KEYS = {"sample_errors", "tp", "process_index", "process_count", "idx"}
PREFERRED = (
    "reward_mean",
    "loss",
    "reward",
    "kl",
    "entropy",
    "grad_norm",
    "advantage",
    "clip",
    "completion_len",
    "response_len",
    "lr",
)
MAX_SERIES = 12


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rank(name: str, values: dict[int, float]) -> tuple[int, bool, str]:
    """Preferred keys first, then series that change, then constant ones; by name within."""
    key = name.split(".", 1)[1]
    pref = next((i for i, p in enumerate(PREFERRED) if key.startswith(p)), len(PREFERRED))
    return pref, len(set(values.values())) <= 1, name


def step_metrics(run: Run, limit: int = MAX_SERIES) -> list[dict[str, Any]]:
    """``[{"name": "train_step.loss", "points": [[step, value], ...]}, ...]``, preferred keys first."""
    if not run.records:
        return []
    series: dict[str, dict[int, float]] = {}
    for r in run.records[min(run.records)]:
        if r["step"] is None:
            continue
        for k, v in r["info"].items():
            if k in SKIP_KEYS or k.endswith("_bytes") or not _numeric(v):
                continue
            series.setdefault(f"{r['phase']}.{k}", {})[r["step"]] = float(v)
    names = sorted(series, key=lambda n: _rank(n, series[n]))[:limit]
    return [{"name": n, "points": [[s, series[n][s]] for s in sorted(series[n])]} for n in names]
