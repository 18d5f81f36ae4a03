"""The phase record, schema ``mllm_rl.phase/1`` (docs/DESIGN.md, "The phase record"); ``/2``
(multi-task runs) adds ``task`` (null: run-level). What cannot be measured is ``null``, never 0."""

from __future__ import annotations

from typing import Any

SCHEMA = "mllm_rl.phase/1"
SCHEMA_V2 = "mllm_rl.phase/2"  # + ``task`` (str or null): multi-task runs
SCHEMAS = (SCHEMA, SCHEMA_V2)
SOURCES = ("memory_stats", "live_arrays", "torch_allocator", "mem_get_info", "live_tensors", "host")
TOP_KEYS = tuple("schema run_id backend process_index idx phase step t_start t_end memory info".split())
DEVICE_KEYS = tuple(
    "id platform bytes_in_use peak_bytes_in_use phase_peak_bytes bytes_limit source raw".split()
)
HOST_KEYS = ("rss_bytes", "rss_peak_bytes")


class SchemaError(ValueError):
    pass


def _int_or_none(v: Any, where: str) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise SchemaError(f"{where}: expected a non-negative int or null, got {v!r}")


def validate_record(rec: dict[str, Any]) -> None:
    """Raise ``SchemaError`` (naming the field) unless ``rec`` is a valid phase record."""
    if missing := [k for k in TOP_KEYS if k not in rec]:
        raise SchemaError(f"missing key(s): {', '.join(missing)}")
    if rec["schema"] not in SCHEMAS:
        raise SchemaError(f"schema: {rec['schema']!r} is not one of {', '.join(SCHEMAS)}")
    if rec["schema"] == SCHEMA_V2:
        if "task" not in rec:
            raise SchemaError(f"missing key: task ({SCHEMA_V2})")
        if rec["task"] is not None and (not isinstance(rec["task"], str) or not rec["task"]):
            raise SchemaError("task: expected a non-empty string or null")
    if not isinstance(rec["phase"], str) or not rec["phase"]:
        raise SchemaError("phase: expected a non-empty string")
    for k in ("idx", "process_index", "step"):
        _int_or_none(rec[k], k)
    if not rec["t_start"] <= rec["t_end"]:
        raise SchemaError("t_start > t_end")
    host = rec["memory"].get("host")
    if not isinstance(host, dict) or any(k not in host for k in HOST_KEYS):
        raise SchemaError("memory.host: needs rss_bytes and rss_peak_bytes")
    for k in HOST_KEYS:
        _int_or_none(host[k], f"memory.host.{k}")
    devices = rec["memory"].get("devices")
    if not isinstance(devices, list):
        raise SchemaError("memory.devices: expected a list")
    for i, d in enumerate(devices):
        if miss := [k for k in DEVICE_KEYS if k not in d]:
            raise SchemaError(f"memory.devices[{i}]: missing {', '.join(miss)}")
        if d["source"] not in SOURCES:
            raise SchemaError(f"memory.devices[{i}].source: unknown {d['source']!r}")
        for k in ("bytes_in_use", "peak_bytes_in_use", "phase_peak_bytes", "bytes_limit"):
            _int_or_none(d[k], f"memory.devices[{i}].{k}")
    if not isinstance(rec["info"], dict):
        raise SchemaError("info: expected an object")
