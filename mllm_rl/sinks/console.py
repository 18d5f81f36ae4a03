"""Console sink: each phase record as one JSON line on stdout (``phase {...}``)."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO


class ConsoleSink:
    def __init__(self, stream: TextIO | None = None, full: bool = True) -> None:
        self.stream = stream or sys.stdout
        self.full = full

    def write(self, record: dict[str, Any]) -> None:
        rec = record
        if not self.full:  # drop per-device raw allocator stats
            mem = dict(record["memory"])
            mem["devices"] = [{k: v for k, v in d.items() if k != "raw"} for d in mem["devices"]]
            rec = {**record, "memory": mem}
        self.stream.write("phase " + json.dumps(rec, separators=(",", ":"), default=str) + "\n")
        self.stream.flush()

    def close(self, exit_code: int = 0) -> None:
        self.stream.flush()
