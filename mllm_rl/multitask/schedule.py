"""The lease schedule: the order in which tasks hold the devices, decided once for every process.

A pure function of the task list (names in file order, each task's first and last step), so
every process of a run computes the same list and no process ever has to ask another whose
turn it is. Round-robin:

    setup(t0), setup(t1), ...                       each task's start-up, in file order
    round r: for each task t with a step s = first(t) + r left:
        rollout(t, s), train(t, s)                  the step's two leased phase groups
        final(t)                                    after t's last step (generate_result)

A task resumed at ``first == steps`` (already done) gets no lease at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

SETUP, ROLLOUT, TRAIN, FINAL = "setup", "rollout", "train", "final"
KINDS = (SETUP, ROLLOUT, TRAIN, FINAL)


@dataclasses.dataclass(frozen=True)
class Lease:
    index: int  # position in the schedule
    task: str
    kind: str  # one of KINDS
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
        for t in todo:
            s = t.first_step + r
            if s >= t.steps:
                continue
            out += [(t.name, ROLLOUT, s), (t.name, TRAIN, s)]
            if s == t.steps - 1:
                out.append((t.name, FINAL, None))
    return [Lease(i, name, kind, step) for i, (name, kind, step) in enumerate(out)]


def schedule_digest(leases: Sequence[Lease]) -> str:
    """A short hash of the whole schedule: processes compare it before the first lease."""
    text = json.dumps([dataclasses.astuple(x) for x in leases], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
