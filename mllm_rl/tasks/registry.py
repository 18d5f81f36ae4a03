"""The registry behind ``--task``: a task by name, from its settings (``TaskConfig``).

- ``pattern``: generated periodic strings (no data file), reward ``mllm_rl.tasks.pattern:reward``;
- ``boxed``: a dataset of math questions (default: the shipped sample), reward
  ``mllm_rl.tasks.boxed:reward`` (``math-verify``);
- ``data``: any dataset (``--data``) with a reward of your own (``--reward``).

``--task`` unset is ``data`` with ``--data`` and ``pattern`` without. Every data error is a
``ValueError`` naming the flag or the file and the row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mllm_rl.tasks.base import TASKS, Task
from mllm_rl.tasks.reward import DEFAULT_TIMEOUT_S, check_spec


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The settings a task is built from (the ``--task`` ... ``--reward-timeout`` flags)."""

    task: str | None = None
    data: str | None = None  # --data / --task-data
    prompt_key: str | None = None
    answer_key: str | None = None
    eval_data: str | None = None
    eval_prompts: int = 16
    reward: str | None = None
    reward_timeout: float = DEFAULT_TIMEOUT_S

    @property
    def name(self) -> str:
        return task_name(self.task, self.data)


def task_name(task: str | None, data: str | None) -> str:
    """``--task`` as given, else ``data`` with a data file and ``pattern`` without."""
    if task is not None:
        return task
    return "data" if data is not None else "pattern"


def check_config(cfg: TaskConfig) -> None:
    """The checks that read no file: the task's name, the settings it does not take, a reward it
    needs and the shape of ``--reward`` (``ValueError`` naming the flag)."""
    name = cfg.name
    if name not in TASKS:
        raise ValueError(f"--task {name!r}: choose one of {', '.join(TASKS)}")
    if name == "pattern":
        if cfg.data is not None:
            raise ValueError("--task-data: the pattern task generates its own prompts")
        for flag, value in (
            ("--prompt-key", cfg.prompt_key),
            ("--answer-key", cfg.answer_key),
            ("--eval-data", cfg.eval_data),
        ):
            if value is not None:
                raise ValueError(f"{flag}: the pattern task generates its own prompts (it takes no data)")
    if name == "data" and cfg.reward is None:
        raise ValueError(
            f"--task-data {cfg.data}: a dataset needs --reward module:function or path/to/file.py:function "
            f"(docs/TASKS.md); --task boxed scores \\boxed{{}} math answers with the shipped reward"
            if cfg.data is not None
            else "--task data needs --data PATH and --reward module:function (docs/TASKS.md)"
        )
    if name == "data" and cfg.data is None:
        raise ValueError("--task data needs --data PATH (JSONL, parquet, CSV or a saved dataset directory)")
    if cfg.reward is not None:
        check_spec(cfg.reward)


def get_task(name: str | None, data: str | None = None, **settings: Any) -> Task:
    """The task ``name`` (``None``: see ``task_name``) over ``data``; ``settings``: the other
    fields of ``TaskConfig``."""
    return build_task(TaskConfig(task=name, data=data, **settings))


def build_task(cfg: TaskConfig) -> Task:
    """The task of ``cfg``: its data read and every row checked (see the module doc)."""
    from mllm_rl.tasks.boxed import boxed_task
    from mllm_rl.tasks.dataset import dataset_task
    from mllm_rl.tasks.pattern import REWARD as PATTERN_REWARD
    from mllm_rl.tasks.pattern import PatternTask

    check_config(cfg)
    name = cfg.name
    if name == "pattern":
        return PatternTask(reward_spec=cfg.reward or PATTERN_REWARD, reward_timeout=cfg.reward_timeout)
    if name == "boxed":
        return boxed_task(
            cfg.data,
            cfg.prompt_key,
            cfg.answer_key,
            cfg.eval_data,
            cfg.eval_prompts,
            cfg.reward,
            cfg.reward_timeout,
        )
    assert cfg.data is not None and cfg.reward is not None  # check_config: a data task has both
    pkey = "prompt" if cfg.prompt_key is None else cfg.prompt_key
    akey = "answer" if cfg.answer_key is None else cfg.answer_key
    return dataset_task(
        name, cfg.data, pkey, akey, cfg.eval_data, cfg.eval_prompts, cfg.reward, cfg.reward_timeout
    )


def default_reward(name: str | None) -> str | None:
    """The reward a task uses without ``--reward`` (``data`` has none)."""
    from mllm_rl.tasks.boxed import REWARD as BOXED
    from mllm_rl.tasks.pattern import REWARD as PATTERN

    return {"pattern": PATTERN, "boxed": BOXED}.get(task_name(name, None))
