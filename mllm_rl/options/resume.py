"""What ``run.json`` records of a run's settings (``record``: every non-``fresh`` one, paths made
absolute) and what ``--resume`` does with them (``apply_recorded``): a setting not given comes from
the record; a given ``fixed`` one that differs is refused unless ``--override KEY`` names it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mllm_rl.options.cli import said
from mllm_rl.options.schema import BY_KEY, in_scope

# a path here is recorded absolute (presets and hub ids as they are); --reward: its file's path
PATH_KEYS = ("model", "task_data", "eval_data")


def _normal(key: str, value: Any) -> Any:
    if key in PATH_KEYS and isinstance(value, str) and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    if key == "reward" and isinstance(value, str):
        from mllm_rl.tasks.reward_worker import absolute_spec

        return absolute_spec(value)
    return value


def record(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """``{key: value}`` of every setting of ``mode`` that a resume compares or inherits."""
    return {o.key: _normal(o.key, getattr(args, o.key)) for o in in_scope(mode) if o.resume != "fresh"}


def fixed_keys(mode: str) -> list[str]:
    """The settings of ``mode`` that define what is trained (``--tasks``: those of its tasks too)."""
    scopes = (mode, "task") if mode == "tasks" else (mode,)
    return list(dict.fromkeys(o.key for s in scopes for o in in_scope(s) if o.resume == "fixed"))


def task_record(spec: Any) -> dict[str, Any]:
    """A task's settings as ``run.json``'s ``task_options`` records them (paths absolute)."""
    return record(spec, "task")


def compare_tasks(
    specs: list[Any], recorded: dict[str, Any], overrides: list[str], where: str, run_json: Path
) -> list[dict[str, Any]]:
    """A resumed multi-task run's tasks against their recorded settings: a changed ``fixed`` one is
    refused (``ValueError`` naming file, task and key) unless ``--override KEY``; the accepted changes."""
    changes = []
    for spec in specs:
        before = recorded.get(spec.name)
        if not isinstance(before, dict):
            continue
        for key, now in task_record(spec).items():
            if BY_KEY[key].resume != "fixed" or key not in before or before[key] == now:
                continue
            if key not in overrides:
                raise ValueError(
                    f"{where}: task {spec.name!r}: {key} {now!r}: {run_json} was run with {before[key]!r}; "
                    f"resuming with another value changes what is trained: pass --override {key} "
                    f"to accept it"
                )
            changes.append({"task": spec.name, "key": key, "from": before[key], "to": now})
    return changes


def check_overrides(args: argparse.Namespace, mode: str) -> None:
    """``--override KEY``: only when resuming, and only a setting that defines the run."""
    keys = args.override or []
    if keys and not (args.resume or args.resume_or_start):
        raise ValueError(
            f"--override {keys[0]}: only with --resume or --resume-or-start (a new run has "
            f"nothing to override)"
        )
    for key in keys:
        if key not in fixed_keys(mode):
            raise ValueError(
                f"--override {key}: not a setting that defines the run; those are: "
                f"{', '.join(fixed_keys(mode))}"
            )


def apply_recorded(
    args: argparse.Namespace, given: set[str], recorded: dict[str, Any], mode: str, where: Path
) -> list[dict[str, Any]]:
    """Fill ``args`` from ``recorded``; the overridden changes. ``ValueError`` (``args`` unchanged)
    for a changed ``fixed`` setting ``--override`` does not name."""
    overrides = set(args.override or [])
    changes, inherit = [], {}
    for opt in in_scope(mode):
        if opt.key not in recorded or opt.resume == "fresh":
            continue
        before, now = recorded[opt.key], _normal(opt.key, getattr(args, opt.key))
        if opt.key not in given:
            inherit[opt.key] = before
        elif opt.resume == "fixed" and now != before:
            if opt.key not in overrides:
                raise ValueError(
                    f"{said(opt, getattr(args, opt.key))}: {where} was run with "
                    f"{said(opt, before) if before is not None else f'{opt.flag} unset'}; resuming with another "
                    f"value changes what is trained: pass --override {opt.key} to accept it, or drop the flag"
                )
            changes.append({"key": opt.key, "from": before, "to": now})
    for key, value in inherit.items():
        setattr(args, key, value)
    return changes


def known(recorded: Any) -> bool:
    """A ``run.json`` ``options`` table this version can compare (older runs have none)."""
    return isinstance(recorded, dict) and all(isinstance(k, str) and k in BY_KEY for k in recorded)
