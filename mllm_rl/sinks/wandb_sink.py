"""Weights & Biases sink (offline by default).

One ``wandb.log`` per phase record (keys per docs/DESIGN.md, "The phase record": ``mem/...``,
``phase/...``, ``time/...``; x-axis ``phase/idx``) and one per step of RL metrics (``rl/step``,
``train/<metric>``). A multi-task run logs ``<task>/rl/step`` and ``<task>/train/<metric>``, each
task on its own step axis so tasks at different steps never overwrite a point. ``close`` tears the
wandb service down explicitly: it must end before sglang-jax's ``shutdown()`` SIGKILLs every child
process (the service is one), and an atexit teardown can hit ``BrokenPipeError``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from mllm_rl.phases.recorder import Sink

MEM_KEYS = ("bytes_in_use", "peak_bytes_in_use", "phase_peak_bytes", "bytes_limit")


def _one_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), at most 300 chars."""
    text = str(e).strip()
    first = text.splitlines()[0] if text and text != "<no message>" else ""
    return f"{type(e).__name__}: {first}"[:300] if first else type(e).__name__


def flatten_record(record: dict[str, Any], t0: float) -> dict[str, Any]:
    """The W&B row for one phase record (``None`` values are left out, never logged as 0)."""
    backend = record["backend"]
    row: dict[str, Any] = {
        "phase/idx": record["idx"],
        "phase/name": record["phase"],
        "time/elapsed_s": record["t_end"] - t0,
        "time/phase_s": record["t_end"] - record["t_start"],
    }
    host = record["memory"]["host"]
    for k in ("rss_bytes", "rss_peak_bytes"):
        if host.get(k) is not None:
            row[f"mem/process/{k}"] = host[k]
    devices = record["memory"]["devices"]
    for key in MEM_KEYS:
        vals = [d[key] for d in devices if d.get(key) is not None]
        for i, d in enumerate(devices):
            if d.get(key) is not None:
                row[f"mem/{backend}/device{i}/{key}"] = d[key]
        if vals:
            row[f"mem/{backend}/{key}_sum"] = sum(vals)
            row[f"mem/{backend}/{key}_min"] = min(vals)
            row[f"mem/{backend}/{key}_max"] = max(vals)
    if record.get("step") is not None:
        row["phase/step"] = record["step"]
    return row


class WandbSink(Sink):
    """One W&B run (``mode`` ``"offline"`` or ``"online"``) in ``run_dir/wandb``.

    Online, ``wandb.init`` is bounded by ``init_timeout`` and skipped without a credential (wandb
    would prompt). On failure ``fallback="offline"`` starts an offline run with one ``warning:``
    line, ``fallback="error"`` raises a one-line ``RuntimeError``; no wandb exception escapes.
    ``mode`` is the mode the run has, ``fallback_reason`` why it fell back (or ``None``)."""

    def __init__(
        self,
        mode: str,
        run_dir: str | Path,
        run_id: str,
        project: str = "mllm_rl",
        name: str | None = None,
        config: dict[str, Any] | None = None,
        resume: bool = False,
        fallback: str = "offline",
        init_timeout: float = 60.0,
    ) -> None:
        if mode not in ("offline", "online"):
            raise ValueError(f"--wandb {mode!r}: use disabled, offline or online")
        if fallback not in ("offline", "error"):
            raise ValueError(f"--wandb-fallback {fallback!r}: use offline or error")
        if not init_timeout > 0:
            raise ValueError(f"init_timeout must be > 0 seconds, got {init_timeout}")
        import wandb

        self._wandb = wandb
        os.environ.setdefault("WANDB_SILENT", "true")
        self.mode = mode
        self.fallback_reason: str | None = None
        kwargs: dict[str, Any] = dict(
            project=project,
            name=name or run_id,
            id=run_id,
            dir=str(run_dir),
            config=config or {},
            resume="allow" if resume else None,
        )
        if mode == "offline":
            self.run = wandb.init(
                mode="offline", settings=wandb.Settings(console="off", x_disable_stats=True), **kwargs
            )
        else:
            self.run = self._init_online(wandb, kwargs, run_dir, fallback, init_timeout)
        self.run.define_metric("phase/idx")
        for pattern in ("mem/*", "time/*", "phase/name", "phase/step"):
            self.run.define_metric(pattern, step_metric="phase/idx")
        self.run.define_metric("rl/step")
        self.run.define_metric("train/*", step_metric="rl/step")
        self._t0: float | None = None
        self._closed = False
        self._tasks: set[str] = set()  # tasks whose step axis is defined

    def _init_online(
        self, wandb: Any, kwargs: dict[str, Any], run_dir: str | Path, fallback: str, init_timeout: float
    ) -> Any:
        """``wandb.init`` online, or what ``fallback`` says when it cannot be (see the class)."""
        from mllm_rl.sinks.wandb_check import FIX, logged_in, offline_glob

        settings: dict[str, Any] = dict(console="off", x_disable_stats=True)
        fields = getattr(wandb.Settings, "model_fields", {"init_timeout": None})
        if "init_timeout" in fields:
            settings["init_timeout"] = float(init_timeout)
        if "finish_timeout" in fields:  # a network lost mid-run must not hold the run's end forever
            settings["finish_timeout"] = float(
                max(60.0, 2 * init_timeout)
            )  # the rest stays on disk for wandb sync
        reason = None
        try:
            logged_in(wandb)
        except ValueError as e:
            reason = str(e).removeprefix("--wandb online: ").removesuffix(f"; {FIX}")
        if reason is None:
            t0 = time.monotonic()
            try:
                return wandb.init(mode="online", settings=wandb.Settings(**settings), **kwargs)
            except (
                Exception
            ) as e:  # wandb's errors (UsageError, CommError, ...) and any other; not SystemExit
                took = time.monotonic() - t0
                reason = f"wandb.init failed after {took:.1f} s (limit {init_timeout:g} s): {_one_line(e)}"
        if fallback == "error":
            raise RuntimeError(
                f"--wandb online: {reason}; --wandb offline logs locally (upload later with wandb sync)"
            )
        self.mode, self.fallback_reason = "offline", reason
        try:
            # the failed run's id is still held by the service ("run ID ... is in use"): a fresh one
            wandb.teardown(1)
            run = wandb.init(
                mode="offline", settings=wandb.Settings(console="off", x_disable_stats=True), **kwargs
            )
        except Exception as e:
            raise RuntimeError(
                f"--wandb online: {reason}; the offline fallback failed too: {_one_line(e)}"
            ) from e
        where = str(run.dir).rsplit("/files", 1)[0] if getattr(run, "dir", None) else offline_glob(run_dir)
        print(
            f"warning: --wandb online: {reason}; logging offline (sync later: wandb sync {where})",
            file=sys.stderr,
            flush=True,
        )
        return run

    @property
    def offline_dir(self) -> str:
        return str(self.run.dir).rsplit("/files", 1)[0]

    def write(self, record: dict[str, Any]) -> None:
        if self._closed:
            return
        if self._t0 is None:
            self._t0 = record["t_start"]
        self.run.log(flatten_record(record, self._t0))

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """One row per RL step: numeric metrics as ``train/<name>``."""
        if self._closed:
            return
        row: dict[str, Any] = {"rl/step": step}
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[f"train/{k}"] = v
        self.run.log(row)

    def log_task_metrics(self, task: str, step: int, metrics: dict[str, Any]) -> None:
        """One row per RL step of ``task``: ``<task>/train/<name>`` over ``<task>/rl/step``."""
        if self._closed:
            return
        if task not in self._tasks:
            self.run.define_metric(f"{task}/rl/step")
            self.run.define_metric(f"{task}/train/*", step_metric=f"{task}/rl/step")
            self._tasks.add(task)
        row: dict[str, Any] = {f"{task}/rl/step": step}
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[f"{task}/train/{k}"] = v
        self.run.log(row)

    def log_report(self, report: Any) -> None:
        """The run's memory report as W&B tables, charts and summary values
        (``mllm_rl.report.wandb_extras``); nothing once the run is closed."""
        if self._closed:
            return
        from mllm_rl.report.wandb_extras import log_report

        log_report(self.run, report)

    def close(self, exit_code: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        self.run.finish(exit_code=exit_code)
        self._wandb.teardown(exit_code)
