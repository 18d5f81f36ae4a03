"""Console sink: each phase record on stdout, as one JSON line (``phase {...}``) or one
short human line (``compact``); RL metrics as one line per step on stderr."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from mllm_rl.phases.jsonsafe import dumps
from mllm_rl.phases.recorder import Sink
from mllm_rl.report.memory import device_sum
from mllm_rl.summary import gib


class ConsoleSink(Sink):
    def __init__(self, stream: TextIO | None = None, full: bool = True, compact: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.full = full
        self.compact = compact

    def write(self, record: dict[str, Any]) -> None:
        if self.compact:
            self.stream.write(compact_line(record) + "\n")
            self.stream.flush()
            return
        rec = record
        if not self.full:  # drop per-device raw allocator stats
            mem = dict(record["memory"])
            mem["devices"] = [{k: v for k, v in d.items() if k != "raw"} for d in mem["devices"]]
            rec = {**record, "memory": mem}
        self.stream.write("phase " + dumps(rec, separators=(",", ":")) + "\n")
        self.stream.flush()

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """A one-line summary per RL step (to stderr: stdout carries the records)."""
        keys = ("reward_mean", "reward_max", "loss", "kl", "clip_frac", "grad_norm", "completion_len_mean")
        parts = [f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), (int, float))]
        print(f"step {step}: " + " ".join(parts), file=sys.stderr, flush=True)

    def close(self, exit_code: int = 0) -> None:
        self.stream.flush()


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
