"""Verifiable RL tasks: prompts with answers, and a reward per completion (docs/TASKS.md)."""

from mllm_rl.tasks.base import Example, Task
from mllm_rl.tasks.registry import TaskConfig, build_task, get_task

__all__ = ["Example", "Task", "TaskConfig", "build_task", "get_task"]
