"""The task contract (``Task``, ``Example``) and the task names ``--task`` accepts (``TASKS``).

A task is prompts (a pure function of ``(seed, step)``, so a resumed run sees the same ones), a
held-out set, and a reward by import path (``reward_spec``) run by ``mllm_rl.tasks.reward`` in a
worker process (docs/TASKS.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

# pattern: generated periodic strings (learnable from scratch); boxed: math answers in \boxed{}
# from a dataset (default: a shipped sample); data: any dataset with a reward of your own.
TASKS = ("pattern", "boxed", "data")  # each is built by mllm_rl.tasks.registry.get_task


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt: ``prompt`` (text, or a list of ``{role, content}`` messages for the chat
    template), ``answer`` (text; ``""`` without an answer column), ``row`` (the dataset row as
    loaded, every column: what the reward function gets) and ``where`` (``file:line`` or
    ``file: row i``; empty for a generated prompt)."""

    prompt: Any
    answer: str
    row: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    where: str = ""
    index: int | None = None  # the row's index in its file (None: generated)


class Task(Protocol):
    name: str
    reward_spec: str  # the reward function's import path (``mllm_rl.tasks.reward``)
    templated: bool  # the chat template applies to its prompts (--chat-template auto)

    def batch(self, seed: int, step: int, n: int) -> list[Example]:
        """The ``n`` training prompts of ``step`` (a pure function of its arguments)."""
        ...

    def heldout(self, seed: int, n: int) -> list[Example]:
        """Up to ``n`` held-out prompts (never trained on, where the task can say so)."""
        ...

    def sizing(self, seed: int) -> list[Example]:
        """The prompts whose longest sizes the engine's context (every row of a dataset)."""
        ...

    def rewards(self, prompts: list[str], completions: list[str], examples: list[Example], what: str) -> Any:
        """One finite float per completion (a numpy array), from the reward worker;
        ``RewardError`` naming the function and the sample (``what``: e.g. ``step 3``)."""
        ...

    def close(self) -> None:
        """Stop the reward worker (a later ``rewards`` starts a new one)."""
        ...
