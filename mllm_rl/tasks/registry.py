"""The registry behind ``--task``: a task by name."""

from __future__ import annotations

from mllm_rl.tasks.base import TASKS, Task
from mllm_rl.tasks.boxed import BoxedMathTask
from mllm_rl.tasks.pattern import PatternTask


def get_task(name: str, data: str | None = None) -> Task:
    """``pattern`` (shipped, learnable from scratch) or ``boxed`` (GSM8K-style JSONL file)."""
    if name == "pattern":
        if data is not None:
            raise ValueError("--task-data: the pattern task generates its own prompts")
        return PatternTask()
    if name == "boxed":
        return BoxedMathTask.from_jsonl(data)
    raise ValueError(f"--task {name!r}: choose one of {', '.join(TASKS)}")
