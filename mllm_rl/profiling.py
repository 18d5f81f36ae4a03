"""``--profile STEPS``: a framework profiler's trace of chosen RL steps, in the run directory.

The core decides when (``Profiled``), the backend how (``Backend.profiler``); each phase is a
named range in the trace. Files: ``RUN_DIR/profile/step_<n>/`` and ``profile/index.json``."""

from __future__ import annotations

import abc
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROFILE_DIR = "profile"


def parse_steps(spec: str, steps: int) -> frozenset[int]:
    """``--profile`` ("2", "1,3", "2-4"; 0-based) -> the step numbers (``ValueError`` naming the flag;
    ``steps``: the run's --steps)."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(
                f"--profile {spec!r}: expected step numbers, e.g. 2, 1,3 or 2-4 (0-based)"
            ) from None
        if a < 0 or b < a:
            raise ValueError(f"--profile {spec!r}: {part!r} is not a step or an increasing range")
        if b >= steps:
            raise ValueError(
                f"--profile {spec!r}: step {b} is past the run's last step {steps - 1} (--steps {steps})"
            )
        out.update(range(a, b + 1))
    return frozenset(out)


class StepProfiler(abc.ABC):
    """One framework's profiler, started and stopped around a step (one trace at a time)."""

    @abc.abstractmethod
    def start(self, out_dir: Path, process_index: int) -> None:
        """Begin a trace that ``stop`` writes into ``out_dir`` (created)."""

    @abc.abstractmethod
    def stop(self) -> list[Path]:
        """End the trace and write it; the files written."""

    @abc.abstractmethod
    def annotate(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A named range in the trace (a phase)."""

    @abc.abstractmethod
    def how_to_open(self, profile_dir: Path) -> str:
        """One line: the command or viewer that opens the traces under ``profile_dir``."""


class Profiled:
    """The steps of a run to trace, and the traces written so far (``index.json``)."""

    def __init__(
        self,
        profiler: StepProfiler | None,
        steps: frozenset[int],
        run_dir: Path,
        backend: str,
        process_index: int = 0,
    ) -> None:
        self.profiler, self.steps, self.process_index = profiler, steps, process_index
        self.dir, self.backend = run_dir / PROFILE_DIR, backend
        self.written: dict[int, list[str]] = {}

    @contextlib.contextmanager
    def step(self, rec: Any, step: int) -> Iterator[None]:
        """Trace ``step`` when it is one of ``steps`` (phases as named ranges), written on the way out."""
        if self.profiler is None or step not in self.steps:
            yield
            return
        self.profiler.start(self.dir / f"step_{step}", self.process_index)
        rec.annotate = self.profiler.annotate
        try:
            yield
        finally:
            rec.annotate = None
            files = self.profiler.stop()
            self.written[step] = [str(f.relative_to(self.dir)) for f in files]
            self._write_index()

    def _write_index(self) -> None:
        if self.process_index:
            return
        doc = {"backend": self.backend, "steps": self.written, "open": self.how_to_open()}
        (self.dir / "index.json").write_text(json.dumps(doc, indent=2) + "\n")

    def how_to_open(self) -> str:
        return "" if self.profiler is None else self.profiler.how_to_open(self.dir)

    def lines(self) -> list[str]:
        """What the run's summary says of the traces."""
        if not self.written:
            return []
        steps = ", ".join(str(s) for s in sorted(self.written))
        return [f"profile: step(s) {steps} traced in {self.dir}; open: {self.how_to_open()}"]
