"""Split a process's records into attempts.

A process killed mid-run and restarted with ``--resume`` appends to the same phase file: its
records start over with the setup phases and then re-run the interrupted step. A new attempt
begins at a non-step record of the run's first phase (e.g. ``wandb_init``), or where ``idx``
is 0 again after other records (a restarted recorder counts from 0; it may also continue
counting, then the first phase alone marks the restart).
"""

from __future__ import annotations

from dataclasses import dataclass

from mllm_rl.report.load import Record


@dataclass
class Attempt:
    process: int
    number: int  # 1-based
    records: list[Record]
    is_last: bool

    def steps(self) -> list[int]:
        """Step numbers in order of first appearance."""
        return list(dict.fromkeys(r["step"] for r in self.records if r["step"] is not None))

    @property
    def last_step(self) -> int | None:
        """The step of the last step record: where this attempt was when it ended."""
        for r in reversed(self.records):
            if r["step"] is not None:
                return r["step"]
        return None


def split_records(records: list[Record], first_phase: str | None) -> list[list[Record]]:
    """The records of one process, split at each attempt's start (see the module doc)."""
    parts: list[list[Record]] = []
    for r in records:
        starts = first_phase is not None and r["step"] is None and r["phase"] == first_phase
        restarted = bool(parts) and r["idx"] == 0  # a fresh recorder counts from 0
        if not parts or starts or restarted:
            parts.append([])
        parts[-1].append(r)
    return parts


def split_attempts(process: int, records: list[Record], first_phase: str | None) -> list[Attempt]:
    parts = split_records(records, first_phase)
    return [Attempt(process, i + 1, p, i == len(parts) - 1) for i, p in enumerate(parts)]
