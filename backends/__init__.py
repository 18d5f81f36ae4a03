"""Backends of mllm_rl, imported as ``mllm_rl.backends.<name>`` (found by entry point)."""
