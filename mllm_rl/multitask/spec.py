"""The ``--tasks`` TOML file of a multi-task run: ``[defaults]`` and ``[[task]]`` tables (docs/MULTITASK.md).

A task's keys are ``FIELDS``: ``name`` (required, unique) and the ``task``-scope options of
``mllm_rl.options.schema`` (same meaning, default and range as the flag). Paths (``model``,
``task_data``, ``eval_data``, a reward file) are relative to the TOML file. A bad file is a
``ValueError`` naming the file, task and field before anything starts."""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mllm_rl.option_error import OptionError, cli_key
from mllm_rl.options.check import check_range, check_type
from mllm_rl.options.schema import ALIASES, OPTIONS, Option, defaults, in_scope
from mllm_rl.tasks.data import is_hub_id
from mllm_rl.tasks.reward_worker import absolute_spec

if TYPE_CHECKING:
    from mllm_rl.plans.rl import RLOptions

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def _rl_options(
    self: Any, tp: int = 1, platform: str = "auto", engine: str = "auto", model_name: str | None = None
) -> RLOptions:
    """This task's ``RLOptions``, built as the flags' are (``RLPlan.options``); the engine carries
    the task's name. ``model_name``: the resolved preset (an unset ``lr`` is its default)."""
    from mllm_rl.plans.preflight import engine_options
    from mllm_rl.plans.rl import PLAN, default_lr

    values = {k: v for scope in ("rl", "swap", "tasks") for k, v in defaults(scope).items()}
    values.update(dataclasses.asdict(self), tp=tp, platform=platform, engine=engine)
    args = argparse.Namespace(**values)
    opts = PLAN.options(args, engine_options(args, task=self.name), platform)
    if opts.lr_from_model:
        lr = default_lr(model_name or self.model)
        opts = dataclasses.replace(opts, train=dataclasses.replace(opts.train, lr=lr), lr_from_model=False)
    return opts


TASK_OPTIONS: dict[str, Option] = {o.key: o for o in in_scope("task")}
# One task of a multi-task run: its name and every ``task`` option of the schema.
TaskSpec = dataclasses.make_dataclass(
    "TaskSpec",
    [("name", str), *((o.key, Any, dataclasses.field(default=o.default)) for o in TASK_OPTIONS.values())],
    frozen=True,
    namespace={"rl_options": _rl_options, "__module__": __name__},
)
FIELDS = ["name", *TASK_OPTIONS]
OPTION_KEYS = {o.key for o in OPTIONS}


def _task(raw: Any, defaults: dict[str, Any], where: str, base: Path) -> TaskSpec:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a table")
    merged = {ALIASES.get(k, k): v for table in (defaults, raw) for k, v in table.items()}
    if "name" not in raw:
        raise ValueError(f"{where}: field 'name' is required")
    values: dict[str, Any] = {}
    for key, value in merged.items():
        if key == "name":
            values[key] = value if isinstance(value, str) else repr(value)
        elif key in TASK_OPTIONS:
            values[key] = check_type(TASK_OPTIONS[key], value, f"{where}.{key}")
        elif key in OPTION_KEYS:
            raise ValueError(
                f"{where}: {key!r} is a run-level setting, not a task's: pass it as "
                f"--{key.replace('_', '-')} (or leave it out)"
            )
        else:
            raise ValueError(f"{where}: unknown field {key!r} (known: {', '.join(FIELDS)})")
    if not NAME.match(values["name"]):
        raise ValueError(f"{where}.name: {values['name']!r} must match {NAME.pattern}")
    for key in ("task_data", "eval_data"):  # relative paths are relative to the TOML file
        data = values.get(key)
        if isinstance(data, str) and not Path(data).expanduser().is_absolute() and not is_hub_id(data, base):
            values[key] = str((base / data).resolve())
    if isinstance(values.get("reward"), str):  # a reward file too (path/to/file.py:function)
        values["reward"] = absolute_spec(values["reward"], base)
    model = values.get("model", "tiny")
    if not Path(model).expanduser().is_absolute() and (base / model).is_dir():
        values["model"] = str((base / model).resolve())
    return TaskSpec(**values)


def load_tasks(path: str | Path) -> list[TaskSpec]:
    """Parse and validate a tasks file (see the module doc); ``ValueError`` names file, task, field."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--tasks {path}: cannot read ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--tasks {path}: not valid TOML ({e})") from None
    unknown = sorted(set(doc) - {"task", "defaults"})
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {unknown}; expected [defaults] and [[task]]")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ValueError(f"{path}: [defaults] must be a table")
    if "name" in defaults:
        raise ValueError(f"{path}: [defaults] cannot set 'name'")
    raw = doc.get("task")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: no [[task]] table")
    specs = []
    for i, t in enumerate(raw):
        name = repr(t.get("name")) if isinstance(t, dict) and "name" in t else "unnamed"
        specs.append(_task(t, defaults, f"{path}: task {i} ({name})", path.parent))
    for i, s in enumerate(specs):
        if s.name in (t.name for t in specs[:i]):
            raise ValueError(f"{path}: task name {s.name!r} is used twice")
    for s in specs:  # the single-task checks (steps >= 1, estimator, loss, ...) before anything runs
        try:
            for key, opt in TASK_OPTIONS.items():
                check_range(opt, getattr(s, key), key)
            s.rl_options()
        except OptionError as e:  # the options name their fields; the file names its keys
            raise ValueError(f"{path}: task {s.name!r}: {e.named(cli_key(e.field))}") from None
        except ValueError as e:
            raise ValueError(f"{path}: task {s.name!r}: {e}") from None
    return specs
