"""RL math: backend-neutral parts (advantages on host arrays); loss code lives per backend."""

from mllm_rl.rl.advantages import group_advantages

__all__ = ["group_advantages"]
