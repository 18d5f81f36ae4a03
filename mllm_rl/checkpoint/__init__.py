"""Checkpoints in Hugging Face format: make (random weights), validate, stream, resolve."""

from mllm_rl.checkpoint.make import make_checkpoint
from mllm_rl.checkpoint.model_dir import CheckpointError, ModelDir
from mllm_rl.checkpoint.resolve import resolve_model
from mllm_rl.checkpoint.writer import CheckpointWriteError

__all__ = ["CheckpointError", "CheckpointWriteError", "ModelDir", "make_checkpoint", "resolve_model"]
