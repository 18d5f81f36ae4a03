"""Checks before a run starts, fastest first (``prepare``; docs/ERRORS.md): each refuses with a
one-line ``ValueError`` or ``CheckpointError`` naming the flag or file (exit 2) while nothing of the
run exists yet. None imports jax or torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from mllm_rl.backend import Backend
from mllm_rl.checkpoint.model_dir import CheckpointError, ModelDir
from mllm_rl.checkpoint.resolve import CKPT_DIR, RLCheckpoint, find_resumable
from mllm_rl.option_error import OptionError, cli_flag
from mllm_rl.options.check import NAME_MAX, check_output_dir, from_args
from mllm_rl.options.schema import KV_AUTO
from mllm_rl.phases.watchdog import PhaseLimits
from mllm_rl.plans.base import Plan, all_plans, plan_of
from mllm_rl.run_files import check_free

RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
# The longest name derived from a run id: W&B's offline-run-<YYYYmmdd_HHMMSS>-<run id>[-p<i>] directory
RUN_ID_MAX = NAME_MAX - len("offline-run-20250101_000000-") - len("-p9999")
# Files only a run writes into its directory (``mllm_rl.run``, ``run_files``, checkpoints)
RUN_FILES = re.compile(r"run\.json|(phases|metrics)(\.p\d+)?\.jsonl|\.lock(\.p\d+)?|checkpoints")


def check_run_id(run_id: str | None) -> None:
    """``--run-id`` names a directory under ``runs/``: not a path, and short enough (``RUN_ID_MAX``)."""
    if run_id is None:
        return
    if len(run_id) > RUN_ID_MAX:
        raise ValueError(
            f"--run-id {run_id[:20]!r}...: {len(run_id)} characters; at most {RUN_ID_MAX} (a file name "
            f"is at most {NAME_MAX} bytes, and W&B names its directory offline-run-<time>-<run id>)"
        )
    if not RUN_ID.fullmatch(run_id):
        raise ValueError(
            f"--run-id {run_id!r}: letters, digits, '.', '_' and '-' only, not starting with "
            f"'.' (it names a directory under runs/)"
        )


def check_run_dir(run_dir: Path, resume: bool = False) -> None:
    """``run_dir`` can be written and is not something else's (a checkpoint, a home): a new run needs
    a new or empty one, ``resume`` a run's."""
    check_output_dir(run_dir, "--run-dir")
    if (run_dir / "config.json").is_file() and any(run_dir.glob("*.safetensors*")):
        raise ValueError(
            f"--run-dir {run_dir} holds a model checkpoint (config.json, *.safetensors); a run "
            f"writes its files into a directory of its own"
        )
    if not run_dir.is_dir():
        return
    check_free(run_dir)
    try:
        names = sorted(os.listdir(run_dir))
    except OSError as e:
        raise ValueError(f"--run-dir {run_dir}: not readable: {e.strerror or e}") from None
    if not names or any(RUN_FILES.fullmatch(n) for n in names):
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if resume:
        raise ValueError(
            f"--resume: {run_dir} is not a run directory (it holds {shown}; no run.json, phases.jsonl "
            f"or checkpoints/)"
        )
    raise ValueError(
        f"--run-dir {run_dir}: holds files that are not a run's ({shown}; no run.json, phases.jsonl or "
        f"checkpoints/); a new run needs a new or empty directory"
    )


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
    """The checkpoint ``--resume`` continues from, and a line per newer one skipped; ``CheckpointError``
    for no run directory or checkpoint (``or_start``: ``(None, [])``), or all invalid."""
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
    from mllm_rl.lifecycle import SETUP_PHASES

    names = set(SETUP_PHASES).union(*(plan.phase_names() for plan in all_plans()))
    return {n for n in names if "{" not in n} | {"jax_ready", "torch_ready"}


def build_options(args: argparse.Namespace) -> Any:
    """The plan's options from the flags (``Plan.options``); ``ValueError`` naming the flag."""
    if (args.resume or args.resume_or_start) and not (args.run_dir or args.run_id):
        flag = "--resume" if args.resume else "--resume-or-start"
        raise ValueError(f"{flag} needs --run-dir or --run-id (the run to continue)")
    if args.resume and args.resume_or_start:
        raise ValueError("--resume and --resume-or-start: pass one (--resume-or-start also resumes)")
    try:
        return plan_of(args).options(args, engine_options(args), platform_of(args))
    except OptionError as e:  # the options name their fields; the user typed flags
        raise ValueError(e.named(cli_flag(e.field))) from None


def platform_of(args: argparse.Namespace) -> str:
    """``--platform`` as the backends name it (``cuda`` is ``gpu``)."""
    return "gpu" if args.platform == "cuda" else args.platform


def engine_options(args: argparse.Namespace, task: str | None = None) -> Any:
    """The engine options every plan (and task of ``--tasks``) shares."""
    from mllm_rl.engine import EngineOptions

    return from_args(
        EngineOptions,
        args,
        max_total_tokens=None if args.max_total_tokens == KV_AUTO else args.max_total_tokens,
        chunk_bytes=int(args.swap_chunk_mb * 2**20),
        task=task,
    )


def phase_limits(args: argparse.Namespace) -> Any:
    """``--phase-timeout`` parsed; a PHASE must be one that some plan records."""
    limits = PhaseLimits.parse(args.phase_timeout or [])
    unknown = sorted(set(limits.overrides) - known_phases())
    if unknown:
        raise ValueError(
            f"--phase-timeout {unknown[0]}=...: no such phase; phases: {', '.join(sorted(known_phases()))}"
        )
    return limits


@dataclasses.dataclass
class Prepared:
    """Everything a run needs, checked before anything of it exists."""

    plan: Plan[Any]
    opts: Any  # the plan's options (``Plan[OptionsT]``'s OptionsT: RLOptions, SwapOptions, MultitaskOptions)
    backend: Backend
    model: ModelDir | None  # None: a plan of several models (``--tasks``)
    run_id: str
    run_dir: Path
    limits: PhaseLimits
    resuming: bool  # appends to an existing run (its run.json is rewritten only once the attempt started)
    notes: list[str]
    options: dict[str, Any]  # run.json's ``options``: the settings a resume compares
    overrides: list[dict[str, Any]]  # run.json's ``overrides``: each ``--override`` change, every attempt
    wandb_mode: str  # --wandb, or "offline" when the server was unreachable (``check_wandb``)


def prepare(args: argparse.Namespace, given: set[str] | frozenset[str] = frozenset()) -> Prepared:
    """Every check before start-up, fastest first (``given``: the flags typed; a resumed run takes
    the rest from its ``run.json``). Touches nothing of the run."""
    from mllm_rl.backend_registry import load_backend
    from mllm_rl.options.resume import apply_recorded, check_overrides, known, record

    plan = plan_of(args)
    mode = plan.scope
    check_overrides(args, mode)
    check_run_id(args.run_id)
    run_id = (
        args.run_id or f"{plan.name}-{args.backend}-{time.strftime('%y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    )
    run_dir = Path(args.run_dir or Path("runs") / run_id).resolve()
    check_run_dir(run_dir, resume=bool(args.resume))
    resuming = (args.resume or args.resume_or_start) and (run_dir / "run.json").exists()
    notes: list[str] = []
    overrides: list[dict[str, Any]] = []
    previous: dict[str, Any] = {}
    if resuming:
        previous = _run_json(run_dir)
        if known(previous.get("options")):
            changes = apply_recorded(args, set(given), previous["options"], mode, run_dir / "run.json")
            overrides = [*previous.get("overrides", []), *changes]
            notes += [
                f"resume: --override {c['key']}: {c['from']} -> {c['to']} (recorded in run.json)"
                for c in changes
            ]
        else:
            notes.append(
                f"resume: {run_dir / 'run.json'} records no settings (an older run): the flags are "
                f"not compared with it"
            )
    opts = build_options(args)
    limits = phase_limits(args)
    backend = load_backend(args.backend)
    from mllm_rl.sinks.wandb_sink import check_wandb

    wandb_mode, wandb_notes = check_wandb(
        args.wandb, args.wandb_fallback, args.wandb_timeout, run_dir=run_dir
    )
    notes += wandb_notes
    opts.engine.check_backend(backend.name, backend.engines)
    try:
        opts, plan_notes = plan.preflight(args, opts, backend, run_dir)
    except OptionError as e:  # e.g. --steps that a resumed run is already past
        raise ValueError(e.named(cli_flag(e.field))) from None
    notes += plan_notes
    opts, model, model_notes = plan.resolve_model(args, opts)  # CheckpointError naming the file
    notes += model_notes
    if args.resume or args.resume_or_start:
        run_id = args.run_id or previous.get("run_id") or run_id
    options, resuming = record(args, mode), bool(resuming)
    return Prepared(
        plan, opts, backend, model, run_id, run_dir, limits, resuming, notes, options, overrides, wandb_mode
    )


def _run_json(run_dir: Path) -> dict[str, Any]:
    try:
        found = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: {run_dir / 'run.json'}: unreadable ({e})") from None
    return found if isinstance(found, dict) else {}
