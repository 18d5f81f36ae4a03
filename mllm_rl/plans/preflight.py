"""Checks that run before a run starts: nothing of the run exists yet when they refuse.

Each raises ``ValueError`` (or ``CheckpointError``, a ``ValueError``) with one line naming the flag
and the file; ``mllm_rl.run`` turns it into exit code 2. None of them imports jax or torch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mllm_rl.checkpoint.model_dir import CheckpointError
from mllm_rl.checkpoint.resolve import CKPT_DIR, RLCheckpoint, find_resumable


def check_run_dir(run_dir: Path) -> None:
    """``run_dir`` (which may not exist yet) can be created and written: neither it nor an ancestor
    is a file, and the nearest existing directory takes a new file (tried, then removed: ``os.access``
    says yes to root on a read-only file system)."""
    existing = run_dir
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == run_dir else f"is inside {existing}, a file"
        raise ValueError(f"--run-dir {run_dir}: {what}, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mllm_rl-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = "" if existing == run_dir else f" ({existing} is not)"
        raise ValueError(f"--run-dir {run_dir}: not writable{where}: {e.strerror}") from None


def check_fresh(run_dir: Path, phase_file: str) -> None:
    """A new run must not append to another run's phase log."""
    path = run_dir / phase_file
    if path.is_file() and path.stat().st_size > 0:
        raise ValueError(
            f"--run-dir {run_dir} already holds a run ({path.name}); pass --resume to continue it "
            f"or choose another --run-dir"
        )


def resolve_resume(
    run_dir: Path, expect: dict[str, object], or_start: bool
) -> tuple[RLCheckpoint | None, list[str]]:
    """The checkpoint ``--resume`` continues from, and one line per newer checkpoint it skipped.

    Refused (``CheckpointError``): a run directory that does not exist, one with no checkpoint
    (unless ``or_start``: then ``(None, [])``, a run from step 0), one whose checkpoints are all
    invalid (each reason in the line; never "start fresh" over them).
    """
    fresh = "; --resume-or-start starts a new run when there is nothing to resume"
    if not run_dir.is_dir():
        if or_start:
            return None, []
        raise CheckpointError(f"--resume: {run_dir}: no such run directory{fresh}")
    found, skipped = find_resumable(run_dir, expect)
    lines = [f"resume: skipped {d.name}: {why}" for d, why in skipped]
    if found is not None:
        if not found.verified:
            lines.append(
                f"resume: {found.path.name} has no file manifest (written before checksums): not verified"
            )
        return found, lines
    if skipped:
        reasons = "; ".join(f"{d.name}: {why}" for d, why in skipped)
        raise CheckpointError(f"--resume: no valid checkpoint in {run_dir / CKPT_DIR}: {reasons}")
    if or_start:
        return None, []
    raise CheckpointError(f"--resume: nothing to resume in {run_dir} (no {CKPT_DIR}/step_*){fresh}")


def known_phases() -> set[str]:
    """Every phase name a plan records (``--phase-timeout PHASE=SECONDS`` must name one)."""
    from mllm_rl.lifecycle import SETUP_PHASES, STEP_PHASES
    from mllm_rl.plans import rl, swap

    names = {*SETUP_PHASES, "check_weights", *rl.SETUP_PHASES, *rl.FINAL_PHASES, *swap.PHASES}
    names |= {p for phases in STEP_PHASES.values() for p in phases}
    return {n for n in names if "{" not in n} | {"jax_ready", "torch_ready"}
