"""The task contract and the registry behind ``--task``."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


class Task(Protocol):
    name: str

    def sample(self, rng: np.random.Generator, n: int) -> list[Example]:
        """``n`` training prompts drawn with ``rng`` (deterministic given its seed)."""
        ...

    def reward(self, completion: str, example: Example) -> float:
        """Reward in [0, 1] of one completion (text after the prompt)."""
        ...


TASKS = ("pattern", "boxed")


def get_task(name: str, data: str | None = None) -> Task:
    """``pattern`` (shipped, learnable from scratch) or ``boxed`` (GSM8K-style JSONL file)."""
    if name == "pattern":
        from mllm_rl.tasks.pattern import PatternTask

        if data is not None:
            raise ValueError("--task-data: the pattern task generates its own prompts")
        return PatternTask()
    if name == "boxed":
        from mllm_rl.tasks.boxed import BoxedMathTask

        return BoxedMathTask.from_jsonl(data)
    raise ValueError(f"--task {name!r}: choose one of {', '.join(TASKS)}")
