"""Verifiable RL tasks: prompts with answers, and a reward per completion."""

from mllm_rl.tasks.base import Example, Task, get_task

__all__ = ["Example", "Task", "get_task"]
