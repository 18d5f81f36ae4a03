"""PhaseRecorder: one record per lifecycle phase, to every sink (``with rec.phase(name, **info) as
ph``). A phase snapshots every device and the host before and after; its peak is the max of a
sampler thread's samples, both snapshots and the allocator's peak when it rose. ``tasks=True``:
schema ``mllm_rl.phase/2``, every record naming its task (``rec.for_task``)."""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mllm_rl.faults import injected_hang
from mllm_rl.phases.probe import DeviceMemory, MemoryProbe, NullProbe, host_rss
from mllm_rl.phases.schema import SCHEMA, SCHEMA_V2
from mllm_rl.phases.watchdog import PhaseStuck, Watchdog

SAMPLER_THREAD = "mllm_rl-mem-sampler"  # probes may rate-limit calls from this thread
PROBE_WAIT_S = 10.0  # the longest a phase-end snapshot waits for a sample in flight


class Sink(abc.ABC):
    """Receives phase records, each step's metrics and the memory report (the defaults take nothing)."""

    @abc.abstractmethod
    def write(self, record: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def close(self, exit_code: int = 0) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:  # noqa: B027 -- optional, not abstract
        """RL metrics of one step (default: not taken)."""

    def log_task_metrics(self, task: str, step: int, metrics: dict[str, Any]) -> None:
        """A task's metrics of one step (default: ``log_metrics`` with a ``task`` key)."""
        self.log_metrics(step, {"task": task, **metrics})

    def log_report(self, report: Any) -> None:  # noqa: B027 -- optional, not abstract
        """The run's memory report (``mllm_rl.report.ReportResult``; default: not taken)."""


@dataclass
class PhaseHandle:
    name: str
    step: int | None
    info: dict[str, Any] = field(default_factory=dict)
    compiles0: tuple[int, float, int] | None = None  # the probe's compile totals at the start


def _max(a: int | None, b: int | None) -> int | None:
    return max((x for x in (a, b) if x is not None), default=None)


class PhaseRecorder:
    def __init__(
        self,
        run_id: str,
        backend: str,
        sinks: Sequence[Sink] = (),
        process_index: int = 0,
        probe: MemoryProbe | None = None,
        sample_interval_s: float = 0.005,
        start_idx: int = 0,
        tasks: bool = False,
    ) -> None:
        self.run_id, self.backend = run_id, backend
        self.process_index, self.sinks = process_index, list(sinks)
        self.tasks = tasks  # schema v2: every record names its task (None: run-level)
        self.task: str | None = None
        self.probe: MemoryProbe = probe or NullProbe()
        self.records: list[dict[str, Any]] = []
        self.start_idx = start_idx  # a resumed run continues the idx of its phase file
        self._interval = sample_interval_s
        self._lock = threading.Lock()
        self._probing = threading.Lock()  # serialises probe calls (``_probe``)
        self._active = False
        self._dev_peak: list[int | None] = []
        self._host_peak = 0
        self._high_point = -1  # the most bytes in flight at a high point of this phase
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self.sample_errors = 0
        self.watchdog: Watchdog | None = None  # armed for every phase when set (``phases/watchdog.py``)
        # --profile: while a step is traced, every phase is a named range of the trace (mllm_rl.profiling)
        self.annotate: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None
        self._open: tuple[PhaseHandle, float, list[DeviceMemory], int] | None = None

    def set_probe(self, probe: MemoryProbe) -> None:
        """Install the backend's probe once its runtime is up (inside a phase: from its end on)."""
        self.probe = probe

    def sample(self) -> None:
        """Fold the current device/host usage into the active phase's peak."""
        if not self._active:
            return
        try:
            with self._probe():
                if not self._active:
                    return
                used = self.probe.in_use()
                rss = host_rss()
        except Exception:  # a sampler must never kill the run; counted, reported in info
            self.sample_errors += 1
            return
        with self._lock:
            if not self._active:
                return
            if len(self._dev_peak) < len(used):
                self._dev_peak += [None] * (len(used) - len(self._dev_peak))
            for i, u in enumerate(used):
                self._dev_peak[i] = _max(self._dev_peak[i], u)
            self._host_peak = max(self._host_peak, rss)

    def sample_high_point(self, nbytes: int) -> None:
        """``sample()`` when ``nbytes`` in flight is more than at any earlier high point of this phase
        (an update peaks at its largest tensor: a few samples find it, not one per tensor; what else
        is resident does not change during an update, so a tie would find the same peak)."""
        if nbytes <= self._high_point:
            return
        self._high_point = nbytes
        self.sample()

    @contextlib.contextmanager
    def _probe(self) -> Iterator[None]:
        """Probe calls one at a time (a sample in flight holds the arrays it scanned), waiting at
        most ``PROBE_WAIT_S`` (a hung device must not stop the watchdog's last record)."""
        got = self._probing.acquire(timeout=PROBE_WAIT_S)
        try:
            yield
        finally:
            if got:
                self._probing.release()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._active:
                t0 = time.perf_counter()
                self.sample()
                # at most a third of a core on sampling; ``close`` ends the wait
                self._stop.wait(max(self._interval, 2 * (time.perf_counter() - t0)))
            else:
                self._wake.wait(0.1)
                self._wake.clear()

    def _ensure_thread(self) -> None:
        if self._interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=SAMPLER_THREAD, daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def for_task(self, task: str | None) -> Iterator[None]:
        """Records made inside belong to ``task`` (multi-task runs; needs ``tasks=True``)."""
        if not self.tasks:
            raise RuntimeError("for_task needs a recorder made with tasks=True (schema v2)")
        prev, self.task = self.task, task
        try:
            yield
        finally:
            self.task = prev

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None, **info: Any) -> Iterator[PhaseHandle]:
        """Record one phase; on an exception the record carries ``info.error`` and it re-raises."""
        if self._active:
            raise RuntimeError(f"phase {name!r} started inside another phase")
        handle = PhaseHandle(name, step, dict(info))
        if (compiles := getattr(self.probe, "compiles", None)) is not None:
            handle.compiles0 = compiles()
        if (reset := getattr(self.probe, "reset_peak", None)) is not None:
            reset()
        with self._probe():
            before = self.probe.snapshot()
        rss0 = host_rss()
        with self._lock:
            self._dev_peak, self._host_peak, self._high_point = [d.bytes_in_use for d in before], rss0, -1
            self._active = True
        self._ensure_thread()
        self._wake.set()
        t0, errors0 = time.time(), self.sample_errors
        with self._lock:
            self._open = (handle, t0, before, rss0)
        if self.watchdog is not None:
            self.watchdog.enter(name, step)
        try:
            injected_hang(name)
            with self.annotate(name) if self.annotate is not None else contextlib.nullcontext():
                yield handle
        except BaseException as e:
            handle.info["error"] = f"{type(e).__name__}: {e}"[:2000]
            if isinstance(e, PhaseStuck):
                handle.info["stuck"] = e.info
            raise
        finally:
            if self.watchdog is not None:
                self.watchdog.leave()
            with self._lock:
                mine, self._open = self._open is not None and self._open[0] is handle, None
            if mine:  # else ``abandon`` already wrote it
                self._finish(handle, t0, before, rss0, errors0)

    def _finish(
        self, handle: PhaseHandle, t0: float, before: list[DeviceMemory], rss0: int, errors0: int
    ) -> None:
        t1 = time.time()
        self.sample()
        with self._lock:
            self._active = False
            dev_peak, host_peak = list(self._dev_peak), self._host_peak
        with self._probe():
            after = self.probe.snapshot()
        rss1 = host_rss()
        if self.sample_errors > errors0:
            handle.info["sample_errors"] = self.sample_errors - errors0
        if handle.compiles0 is not None:  # XLA compiles in the phase (a probe that counts them)
            (n0, s0, h0), (n1, s1, h1) = handle.compiles0, self.probe.compiles()  # type: ignore[attr-defined]
            if n1 > n0:
                handle.info.update(compiles=n1 - n0, compile_s=round(s1 - s0, 3), compile_cache_hits=h1 - h0)
        self._emit(handle, (t0, t1), before, after, dev_peak, (rss0, max(host_peak, rss1), rss1))

    def abandon(self, error: BaseException, **info: Any) -> bool:
        """Write the record of a phase open in a thread that will never end (the watchdog's hard
        exit), with ``info.error``; False when none is open."""
        with self._lock:
            opened, self._open = self._open, None
        if opened is None:
            return False
        handle, t0, before, rss0 = opened
        handle.info.update(info, error=f"{type(error).__name__}: {error}"[:2000])
        self._finish(handle, t0, before, rss0, self.sample_errors)
        return True

    def _emit(self, h: PhaseHandle, times: tuple[float, float], before: list[DeviceMemory],
              after: list[DeviceMemory], dev_peak: list[int | None], rss: tuple[int, int, int]) -> None:  # fmt: skip
        """Write the record: ``times`` start and end, ``rss`` at the start, its peak and at the end."""
        (t0, t1), (rss0, host_peak, rss1) = times, rss
        devices = []
        for i, d in enumerate(after):
            b = before[i] if i < len(before) else None
            peak = _max(dev_peak[i] if i < len(dev_peak) else None, d.bytes_in_use)
            was, now = (b.peak_bytes_in_use if b is not None else None), d.peak_bytes_in_use
            rose = was is not None and now is not None and now > was
            if rose or getattr(self.probe, "reset_peak", None) is not None:
                peak = _max(peak, d.peak_bytes_in_use)
            devices.append(
                {
                    "id": d.id,
                    "platform": d.platform,
                    "bytes_in_use": d.bytes_in_use,
                    "bytes_in_use_start": b.bytes_in_use if b is not None else None,
                    "peak_bytes_in_use": d.peak_bytes_in_use,
                    "phase_peak_bytes": peak,
                    "bytes_limit": d.bytes_limit,
                    "source": d.source,
                    "raw": d.raw,
                }
            )
        record = {
            "schema": SCHEMA_V2 if self.tasks else SCHEMA,
            **({"task": self.task} if self.tasks else {}),
            "run_id": self.run_id,
            "backend": self.backend,
            "process_index": self.process_index,
            "idx": self.start_idx + len(self.records),
            "phase": h.name,
            "step": h.step,
            "t_start": t0,
            "t_end": t1,
            "memory": {
                "host": {"rss_bytes": rss1, "rss_peak_bytes": host_peak, "rss_start_bytes": rss0},
                "devices": devices,
            },
            "info": h.info,
        }
        self.records.append(record)
        for sink in self.sinks:
            sink.write(record)

    def log_metrics(self, step: int, metrics: dict[str, Any], task: str | None = None) -> None:
        """One step's RL metrics to every sink (with ``task``: ``log_task_metrics``)."""
        for sink in self.sinks:
            if task is None:
                sink.log_metrics(step, metrics)
            else:
                sink.log_task_metrics(task, step, metrics)

    def log_report(self, report: Any) -> None:
        """The run's memory report (``mllm_rl.report.ReportResult``) to every sink."""
        for sink in self.sinks:
            sink.log_report(report)

    def close(self, exit_code: int = 0) -> None:
        """Stop the sampler and close every sink (W&B is finished and torn down here)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for sink in self.sinks:
            sink.close(exit_code)
        self.sinks = []
