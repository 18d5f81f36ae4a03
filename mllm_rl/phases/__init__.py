"""Phase records: schema, memory probes, the recorder."""

from mllm_rl.phases.probe import DeviceMemory, MemoryProbe, NullProbe, host_rss
from mllm_rl.phases.recorder import PhaseRecorder
from mllm_rl.phases.schema import SCHEMA, SchemaError, validate_record

__all__ = [
    "SCHEMA",
    "DeviceMemory",
    "MemoryProbe",
    "NullProbe",
    "PhaseRecorder",
    "SchemaError",
    "host_rss",
    "validate_record",
]
