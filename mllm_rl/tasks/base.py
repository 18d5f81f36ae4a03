"""The task contract (``Task``, ``Example``) and the task names ``--task`` accepts (``TASKS``)."""

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


TASKS = ("pattern", "boxed")  # each is built by mllm_rl.tasks.registry.get_task
