"""mllm_rl: backend-neutral trainer/rollout runtime for colocated LLM RL.

The core never imports jax or torch at module level; backends live in
``mllm_rl.backends.<name>`` and are found through the ``mllm_rl.backends`` entry points.
"""

__version__ = "0.1.0"
