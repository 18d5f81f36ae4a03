"""Verifiable RL tasks: prompts with answers, and a reward per completion."""

from mllm_rl.tasks.base import Example, Task
from mllm_rl.tasks.registry import get_task

__all__ = ["Example", "Task", "get_task"]
