"""Where phase records go: JSONL (source of truth), console, W&B."""

from mllm_rl.sinks.console import ConsoleSink
from mllm_rl.sinks.jsonl import JsonlSink, read_jsonl

__all__ = ["ConsoleSink", "JsonlSink", "read_jsonl"]
