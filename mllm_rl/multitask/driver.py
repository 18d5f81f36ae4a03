"""The lease schedule and the driver that runs it, one lease at a time, on every process.

The schedule is a pure function of the task list, the same on every process (docs/MULTITASK.md,
"The lease order"). Inside a lease a ``TaskRuntime`` runs its phase group and ends holding nothing
on the devices (``fail`` releases everything after an exception). The handoff is a ``gather`` named
after the lease: a task failed on any process is failed on all; ``fail_fast`` stops the run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mllm_rl.coordination import Coordinator, LocalCoordinator, ScheduleMismatch

SETUP, ROLLOUT, TRAIN, FINAL = "setup", "rollout", "train", "final"  # the kinds of lease


@dataclasses.dataclass(frozen=True)
class Lease:
    index: int  # position in the schedule
    task: str
    kind: str
    step: int | None  # None for setup and final

    @property
    def key(self) -> str:
        """A name unique in the run: ``<index>/<task>/<kind>[/<step>]`` (barrier names use it)."""
        tail = "" if self.step is None else f"/{self.step}"
        return f"{self.index}/{self.task}/{self.kind}{tail}"


@dataclasses.dataclass(frozen=True)
class TaskSteps:
    name: str
    first_step: int  # 0, or one past the step of the checkpoint a resumed task restores
    steps: int  # total steps of the task (it runs first_step .. steps - 1)


def lease_schedule(tasks: Sequence[TaskSteps]) -> list[Lease]:
    """Every lease of the run, in order (see the module doc)."""
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be unique, got {names}")
    todo = [t for t in tasks if t.first_step < t.steps]
    out: list[tuple[str, str, int | None]] = [(t.name, SETUP, None) for t in todo]
    rounds = max((t.steps - t.first_step for t in todo), default=0)
    for r in range(rounds):
        for t, s in ((t, t.first_step + r) for t in todo if t.first_step + r < t.steps):
            out += [(t.name, ROLLOUT, s), (t.name, TRAIN, s)]
            out += [(t.name, FINAL, None)] if s == t.steps - 1 else []
    return [Lease(i, name, kind, step) for i, (name, kind, step) in enumerate(out)]


def schedule_digest(leases: Sequence[Lease]) -> str:
    """A short hash of the whole schedule: processes compare it before the first lease."""
    text = json.dumps([dataclasses.astuple(x) for x in leases], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


OK = "ok"
PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"


class TaskRuntime(Protocol):
    name: str

    def run_lease(self, lease: Lease) -> None:
        """Run the phase group of ``lease`` and end holding nothing on the devices."""
        ...

    def fail(self, lease: Lease, error: BaseException) -> None:
        """After ``error`` inside ``lease``: free every device byte the task still holds."""
        ...


class TaskFailed(RuntimeError):
    """``--fail-fast``: a task failed (on some process), so the run stops."""

    def __init__(self, task: str, lease: Lease, error: str) -> None:
        super().__init__(f"task {task!r} failed in lease {lease.key}: {error}")
        self.task, self.lease, self.error = task, lease, error


@dataclasses.dataclass
class TaskStatus:
    status: str = PENDING
    error: str | None = None
    failed_lease: str | None = None
    leases: int = 0


def _outcome(error: BaseException | None) -> str:
    return OK if error is None else f"{type(error).__name__}: {error}"[:1000]


class Driver:
    """Runs ``schedule`` over ``tasks``. ``on_lease(entry)``: one JSON-able dict per lease (what
    ran, when, every process's outcome, device bytes after); ``on_status`` on each status change."""

    def __init__(
        self,
        schedule: Sequence[Lease],
        tasks: dict[str, TaskRuntime],
        coord: Coordinator | None = None,
        fail_fast: bool = False,
        on_lease: Callable[[dict[str, Any]], None] | None = None,
        on_status: Callable[[dict[str, TaskStatus]], None] | None = None,
        device_bytes: Callable[[], int | None] | None = None,
    ) -> None:
        missing = sorted({x.task for x in schedule} - set(tasks))
        if missing:
            raise ValueError(f"schedule names task(s) without a runtime: {missing}")
        self.schedule = list(schedule)
        self.tasks = tasks
        self.coord = coord or LocalCoordinator()
        self.fail_fast = fail_fast
        self.on_lease = on_lease or (lambda entry: None)
        self.on_status = on_status or (lambda statuses: None)
        self.device_bytes = device_bytes
        scheduled = {x.task for x in schedule}
        # A task with no lease (resumed after its last step) is done already.
        self.status = {name: TaskStatus() if name in scheduled else TaskStatus(DONE) for name in tasks}
        self.errors: dict[str, BaseException] = {}  # the exception, on the process where it happened
        self.ran: list[str] = []  # lease keys, in the order this process ran them

    def check_schedule(self) -> None:
        """Every process must have computed the same schedule (``ScheduleMismatch`` otherwise)."""
        digest = schedule_digest(self.schedule)
        seen = self.coord.gather("schedule", digest)
        if len(set(seen)) > 1:
            desc = ", ".join(f"process {i}: {d}" for i, d in enumerate(seen))
            raise ScheduleMismatch(f"processes computed different lease schedules ({desc})")

    def run(self) -> dict[str, TaskStatus]:
        self.check_schedule()
        self.on_status(self.status)
        last = {x.task: x.index for x in self.schedule}
        for lease in self.schedule:
            st = self.status[lease.task]
            if st.status == FAILED:
                continue
            if st.status == PENDING:
                st.status = RUNNING
                self.on_status(self.status)
            self._one(lease)
            if st.status == RUNNING and lease.index == last[lease.task]:
                st.status = DONE
                self.on_status(self.status)
        return self.status

    def _one(self, lease: Lease) -> None:
        task = self.tasks[lease.task]
        t0 = time.time()
        error: BaseException | None = None
        try:
            task.run_lease(lease)
        except Exception as e:  # a task's failure is its own; SIGTERM / KeyboardInterrupt stop the run
            error = e
            self.errors[lease.task] = e
            try:
                task.fail(lease, e)
            except Exception as e2:  # noqa: BLE001 - reported with the first error
                error = RuntimeError(f"{_outcome(e)}; releasing its memory then failed: {_outcome(e2)}")
        t1 = time.time()
        outcomes = self.coord.gather(f"lease/{lease.key}", _outcome(error))  # the handoff barrier
        self.ran.append(lease.key)
        st = self.status[lease.task]
        st.leases += 1
        failed = [(i, o) for i, o in enumerate(outcomes) if o != OK]
        entry = {
            "lease": lease.index,
            "task": lease.task,
            "kind": lease.kind,
            "step": lease.step,
            "process_index": self.coord.index,
            "t_start": t0,
            "t_end": t1,
            "outcomes": outcomes,
            "device_bytes": self.device_bytes() if self.device_bytes else None,
        }
        self.on_lease(entry)
        if not failed:
            return
        st.status, st.failed_lease = FAILED, lease.key
        st.error = "; ".join(f"process {i}: {o}" for i, o in failed) if self.coord.count > 1 else failed[0][1]
        self.on_status(self.status)
        if self.fail_fast:
            if error is not None:
                raise error
            raise TaskFailed(lease.task, lease, st.error)


def read_leases(path: Any) -> list[dict[str, Any]]:
    """The entries a run wrote to ``leases.jsonl`` (one JSON object per lease)."""
    from pathlib import Path

    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
