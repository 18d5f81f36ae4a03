"""Weights & Biases: the preflight check of ``--wandb MODE`` and the sink (offline by default).

``WandbSink`` logs a row per phase record (docs/DESIGN.md) and per RL step (``[<task>/]train/<metric>``
over ``[<task>/]rl/step``); ``close`` tears wandb's service down before sglang-jax's ``shutdown()``
SIGKILLs every child (an atexit teardown can hit EPIPE)."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mllm_rl.phases.recorder import Sink

MODES = ("disabled", "offline", "online")
FALLBACKS = ("offline", "error")
FIX = "run wandb login, set WANDB_API_KEY, or pass --wandb offline"  # no backticks: a docs/ERRORS.md cell
OFFLINE_FIX = "--wandb offline logs locally (upload later with wandb sync)"
MEM_KEYS = ("bytes_in_use", "peak_bytes_in_use", "phase_peak_bytes", "bytes_limit")
QUIET = {"console": "off", "x_disable_stats": True}  # wandb.Settings of every run


def _check_args(mode: str, fallback: str, modes: tuple[str, ...] = MODES) -> None:
    if mode not in modes:
        raise ValueError(f"--wandb {mode!r}: use disabled, offline or online")
    if fallback not in FALLBACKS:
        raise ValueError(f"--wandb-fallback {fallback!r}: use offline or error")


def check_wandb(
    mode: str, fallback: str, timeout_s: float, *, run_dir: str | os.PathLike[str] | None = None
) -> tuple[str, list[str]]:
    """``(effective mode, warning lines)`` for ``--wandb mode``. ``online`` without a credential is a
    ``ValueError`` (a setup to fix); a server that does not verify the key within ``timeout_s`` gives
    ``("offline", [warning])`` with ``fallback="offline"``, else ``RuntimeError``."""
    _check_args(mode, fallback)
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"--wandb-timeout must be > 0 seconds, got {timeout_s}")
    if mode == "disabled":
        return mode, []
    try:
        import wandb
    except ImportError:
        msg = f"--wandb {mode}: the wandb package is not installed (pip install wandb, or --wandb disabled)"
        raise ValueError(msg) from None
    if mode == "offline":
        return mode, []
    url = logged_in(wandb)
    reason = verify(wandb, timeout_s)
    if reason is None:
        return "online", []
    t = f"{timeout_s:g}"
    if fallback == "error":
        msg = f"--wandb online: {url} unreachable ({reason}) within {t} s (--wandb-fallback error)"
        raise RuntimeError(f"{msg}; {OFFLINE_FIX}")
    return "offline", [
        f"warning: --wandb online: {url} unreachable ({reason}) within {t} s; "
        f"logging offline (sync later: wandb sync {offline_glob(run_dir)})"
    ]


def offline_glob(run_dir: str | os.PathLike[str] | None) -> str:
    """Where the offline W&B run of ``run_dir`` lands (``RUN_DIR/...`` when not known)."""
    return f"{run_dir if run_dir is not None else 'RUN_DIR'}/wandb/offline-run-*"


def logged_in(wandb: Any) -> str:
    """Log in from the credentials wandb finds (env, netrc, settings; no network, no prompt); the
    server's URL. ``ValueError`` (one line) when there is none to use."""
    os.environ.setdefault("WANDB_SILENT", "true")  # no "Loaded credentials" or logged-in lines
    try:
        found = wandb.login(prompt=False, verify=False)
    except Exception as e:  # AuthenticationError: a malformed key; ValidationError: a bad setting
        if callable(errors := getattr(e, "errors", None)):  # pydantic's: which setting, and why
            err = errors()[0]
            where = ".".join(map(str, err["loc"]))
            msg = f"wandb setting {where} {err.get('input')!r} is not valid ({err['msg']})"
            raise ValueError(f"--wandb online: {msg}") from None
        raise ValueError(f"--wandb online: {_one_line(e)}; {FIX}") from None
    url = str(wandb.sdk.wandb_setup.singleton().settings.base_url).rstrip("/")
    if not found:
        raise ValueError(f"--wandb online: no W&B API key for {url}; {FIX}")
    return url


def verify(wandb: Any, timeout_s: float) -> str | None:
    """``None`` if the server accepted the credentials within ``timeout_s`` (``wandb.Api()`` in a
    daemon thread, abandoned after it), else why not in a short phrase."""
    result: list[str | None] = []

    def run() -> None:
        try:
            wandb.Api(timeout=max(1, math.ceil(timeout_s)))
            result.append(None)
        except Exception as e:  # every failure is a reason
            result.append(_one_line(e))

    thread = threading.Thread(target=run, name="wandb-check-verify", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:  # left running: tearing wandb down now could wait on the same dead network
        return "no answer"
    wandb.teardown()  # no session, credentials or wandb service left behind
    return result[0]


def _one_line(e: BaseException, typed: bool = False) -> str:
    """The first line of ``e``'s message (after ``Type: `` when ``typed``), at most 300 chars."""
    text = str(e).strip()
    first = text.splitlines()[0] if text and text != "<no message>" else ""
    if typed and first:
        return f"{type(e).__name__}: {first}"[:300]
    return (first.rstrip(".") or type(e).__name__)[:300]


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
    """One W&B run in ``run_dir/wandb``. Online, ``wandb.init`` is bounded by ``init_timeout`` and
    skipped without a credential; on failure ``fallback`` starts an offline run (one ``warning:``
    line; ``mode`` and ``fallback_reason`` say so) or raises a one-line ``RuntimeError``."""

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
        _check_args(mode, fallback, ("offline", "online"))
        if not init_timeout > 0:
            raise ValueError(f"init_timeout must be > 0 seconds, got {init_timeout}")
        import wandb

        self._wandb = wandb
        os.environ.setdefault("WANDB_SILENT", "true")
        self.mode = mode
        self.fallback_reason: str | None = None
        kwargs: dict[str, Any] = dict(project=project, name=name or run_id, id=run_id, dir=str(run_dir))
        kwargs.update(config=config or {}, resume="allow" if resume else None)
        if mode == "offline":
            self.run = wandb.init(mode="offline", settings=wandb.Settings(**QUIET), **kwargs)
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
        try:
            logged_in(wandb)
        except ValueError as e:
            reason = str(e).removeprefix("--wandb online: ").removesuffix(f"; {FIX}")
        else:
            # finish_timeout: a network lost mid-run must not hold the run's end (wandb sync has the rest)
            finish = float(max(60.0, 2 * init_timeout))
            limits = {"init_timeout": float(init_timeout), "finish_timeout": finish}
            t0 = time.monotonic()
            try:
                return wandb.init(mode="online", settings=wandb.Settings(**QUIET, **limits), **kwargs)
            except Exception as e:  # wandb's errors (UsageError, CommError, ...) and any other
                took = f"{time.monotonic() - t0:.1f} s (limit {init_timeout:g} s)"
                reason = f"wandb.init failed after {took}: {_one_line(e, True)}"
        if fallback == "error":
            raise RuntimeError(f"--wandb online: {reason}; {OFFLINE_FIX}")
        self.mode, self.fallback_reason = "offline", reason
        try:
            # the failed run's id is still held by the service ("run ID ... is in use"): a fresh one
            wandb.teardown(1)
            run = wandb.init(mode="offline", settings=wandb.Settings(**QUIET), **kwargs)
        except Exception as e:
            msg = f"--wandb online: {reason}; the offline fallback failed too: {_one_line(e, True)}"
            raise RuntimeError(msg) from e
        where = str(run.dir).rsplit("/files", 1)[0] if getattr(run, "dir", None) else offline_glob(run_dir)
        msg = f"warning: --wandb online: {reason}; logging offline (sync later: wandb sync {where})"
        print(msg, file=sys.stderr, flush=True)
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

    def log_metrics(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        """One row per RL step: numeric metrics as ``<prefix>train/<name>`` over ``<prefix>rl/step``."""
        if self._closed:
            return
        row: dict[str, Any] = {f"{prefix}rl/step": step}
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[f"{prefix}train/{k}"] = v
        self.run.log(row)

    def log_task_metrics(self, task: str, step: int, metrics: dict[str, Any]) -> None:
        """One row per RL step of ``task``: ``<task>/train/<name>`` over ``<task>/rl/step``."""
        if task not in self._tasks and not self._closed:
            self.run.define_metric(f"{task}/rl/step")
            self.run.define_metric(f"{task}/train/*", step_metric=f"{task}/rl/step")
            self._tasks.add(task)
        self.log_metrics(step, metrics, f"{task}/")

    def log_report(self, report: Any) -> None:
        """The run's memory report as W&B tables, charts and summary values (nothing once closed)."""
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
