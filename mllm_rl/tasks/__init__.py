"""Verifiable RL tasks: the contract (``Task``, ``Example``) and ``--task`` by name (docs/TASKS.md).

A task is prompts (a pure function of ``(seed, step)``, so a resumed run sees the same ones), a
held-out set, and a reward by import path (``reward_spec``) run in a worker process
(``mllm_rl.tasks.reward``). Every data error is a ``ValueError`` naming the flag or file and row."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from mllm_rl.tasks import boxed, pattern
from mllm_rl.tasks.data import Example, dataset_task
from mllm_rl.tasks.reward import DEFAULT_TIMEOUT_S, check_spec

# pattern: generated periodic strings (learnable from scratch); boxed: math answers in \boxed{}
# from a dataset (default: a shipped sample); data: any dataset with a reward of your own.
TASKS = ("pattern", "boxed", "data")


class Task(Protocol):
    """What a task is: ``batch`` (the ``n`` training prompts of ``step``, a pure function of its
    arguments), ``heldout`` (up to ``n`` prompts never trained on, where the task can say so),
    ``sizing`` (the prompts whose longest sizes the engine's context), ``rewards`` (one finite float
    per completion, else ``RewardError`` naming the sample) and ``close`` (stop the reward worker)."""

    name: str
    reward_spec: str  # the reward function's import path
    templated: bool  # the chat template applies to its prompts (--chat-template auto)

    def batch(self, seed: int, step: int, n: int) -> list[Example]: ...
    def heldout(self, seed: int, n: int) -> list[Example]: ...
    def sizing(self, seed: int) -> list[Example]: ...
    def rewards(
        self, prompts: list[str], completions: list[str], examples: list[Example], what: str
    ) -> Any: ...
    def close(self) -> None: ...


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
    return task if task is not None else "data" if data is not None else "pattern"


def check_config(cfg: TaskConfig) -> None:
    """The checks that read no file (``ValueError`` naming the flag)."""
    name = cfg.name
    if name not in TASKS:
        raise ValueError(f"--task {name!r}: choose one of {', '.join(TASKS)}")
    if name == "pattern":
        if cfg.data is not None:
            raise ValueError("--task-data: the pattern task generates its own prompts")
        for flag in ("--prompt-key", "--answer-key", "--eval-data"):
            if getattr(cfg, flag[2:].replace("-", "_")) is not None:
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
    """The task ``name`` over ``data``; ``settings``: the other fields of ``TaskConfig``."""
    return build_task(TaskConfig(task=name, data=data, **settings))


def build_task(cfg: TaskConfig) -> Task:
    """The task of ``cfg``: its data read and every row checked."""
    check_config(cfg)
    if cfg.name == "pattern":
        return pattern.PatternTask(
            reward_spec=cfg.reward or pattern.REWARD, reward_timeout=cfg.reward_timeout
        )
    if cfg.name == "boxed":
        return boxed.boxed_task(cfg)
    assert cfg.data is not None and cfg.reward is not None  # check_config: a data task has both
    pkey = "prompt" if cfg.prompt_key is None else cfg.prompt_key
    akey = "answer" if cfg.answer_key is None else cfg.answer_key
    return dataset_task(cfg, cfg.data, pkey, akey, cfg.reward)


def default_reward(name: str | None) -> str | None:
    """The reward a task uses without ``--reward`` (``data`` has none)."""
    return {"pattern": pattern.REWARD, "boxed": boxed.REWARD}.get(task_name(name, None))
