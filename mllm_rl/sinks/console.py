"""Console sink (``--console``): ``steps`` (default) prints a stderr line per RL step, one when setup
is done and any failed phase's; ``phases`` adds a stdout line per record, ``full`` a JSON line."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from mllm_rl.phases.jsonsafe import dumps
from mllm_rl.phases.recorder import Sink
from mllm_rl.progress import write
from mllm_rl.report.memory import device_sum
from mllm_rl.summary import gib

MODES = ("steps", "phases", "full")  # ``--console`` values that make a ConsoleSink (``off``: none)
# the step line's figures, by their names in metrics.jsonl (eval_reward_mean: steps with --eval-every)
STEP_METRICS = ("reward_mean", "eval_reward_mean", "kl", "clip_frac", "grad_norm", "loss")


class ConsoleSink(Sink):
    """Prints a run's progress; ``steps``: the run's step count, shown as ``(i/N)`` (None: not shown)."""

    def __init__(
        self,
        mode: str = "steps",
        steps: int | None = None,
        stream: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"console mode {mode!r}: choose one of {', '.join(MODES)}")
        self.mode, self.steps = mode, steps
        self.stream, self.err = stream or sys.stdout, err or sys.stderr  # phase records, step lines
        self._setup: list[dict[str, Any]] = []  # run-level records before the first step's
        self._setup_said = False
        self._open: dict[tuple[str | None, int], list[dict[str, Any]]] = {}  # (task, step) -> records

    def write(self, record: dict[str, Any]) -> None:
        step, task = record.get("step"), record.get("task")
        if step is None:
            if not self._setup_said:
                self._setup.append(record)
        else:
            if not self._setup_said and self._setup and self.mode == "steps":
                write(setup_line(self._setup), self.err)
            self._setup_said = True
            self._setup = []
            self._open.setdefault((task, step), []).append(record)
        if self.mode == "phases":
            write(compact_line(record), self.stream)
        elif self.mode == "full":
            write("phase " + dumps(record, separators=(",", ":")), self.stream)
        elif record["info"].get("error"):  # steps: a failed phase is shown where it happened
            write(compact_line(record), self.err)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """One line for the step (its records' time and peaks included)."""
        task = metrics.get("task")
        records = self._open.pop((task, step), [])
        write(step_line(step, metrics, records, None if task else self.steps), self.err)

    def close(self, exit_code: int = 0) -> None:
        self._open.clear()
        self.stream.flush()
        self.err.flush()


def fmt(v: float) -> str:
    """A metric with 3 significant digits: a small GRPO loss reads ``-0.0014``, not ``0.0000``."""
    return f"{v:.3g}"


def step_line(
    step: int, metrics: dict[str, Any], records: list[dict[str, Any]], steps: int | None = None
) -> str:
    """``[task] step 3 (4/20): reward_mean=0.236 kl=0.00012 ... step_s=2.31 dev_peak=0.035GiB
    rss_peak=0.702GiB``: the metrics, the step's span, its device peak (summed) and RSS peak."""
    head = f"step {step}" + (f" ({step + 1}/{steps})" if steps else "")
    if metrics.get("task"):
        head = f"[{metrics['task']}] {head}"
    parts = [f"{k}={fmt(metrics[k])}" for k in STEP_METRICS if isinstance(metrics.get(k), (int, float))]
    if records:
        secs = span(records)
        parts.append(f"step_s={fmt(secs) if secs < 100 else f'{secs:.0f}'}")
        parts += peaks(records)
    return f"{head}: " + " ".join(parts)


def span(records: list[dict[str, Any]]) -> float:
    return max(r["t_end"] for r in records) - min(r["t_start"] for r in records)


def peaks(records: list[dict[str, Any]]) -> list[str]:
    """``dev_peak=...GiB rss_peak=...GiB`` over ``records`` (device peak left out when unknown)."""
    dev = [p for p in (device_sum(r, "phase_peak_bytes") for r in records) if p is not None]
    rss = max(r["memory"]["host"]["rss_peak_bytes"] for r in records)
    return ([f"dev_peak={gib(max(dev))}GiB"] if dev else []) + [f"rss_peak={gib(rss)}GiB"]


def setup_line(records: list[dict[str, Any]]) -> str:
    """``setup: 11 phases in 9.10s, dev_peak=0.034GiB rss_peak=0.581GiB``: the phases before step 1."""
    return f"setup: {len(records)} phases in {span(records):.2f}s, " + " ".join(peaks(records))


def compact_line(r: dict[str, Any]) -> str:
    """``phase  12 release_rollout  step 0  0.003s  dev 0.020 -> 0.004 GiB (peak 0.020)  rss 1.21 GiB``."""
    step = "" if r.get("step") is None else f" step {r['step']}"
    step = f" [{r['task']}]{step}" if r.get("task") else step  # multi-task runs (schema v2)
    err = f"  ERROR {r['info']['error'][:80]}" if r["info"].get("error") else ""
    return (
        f"phase {r['idx']:>4} {r['phase']:<22}{step:<9} {r['t_end'] - r['t_start']:7.3f}s  "
        f"dev {gib(device_sum(r, 'bytes_in_use_start'))} -> {gib(device_sum(r, 'bytes_in_use'))} GiB "
        f"(peak {gib(device_sum(r, 'phase_peak_bytes'))})  rss {gib(r['memory']['host']['rss_bytes'])} GiB{err}"
    )
