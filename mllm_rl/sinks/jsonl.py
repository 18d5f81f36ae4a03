"""Append-only JSONL sink: the source of truth. Flushed and fsynced per record."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonlSink:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self, exit_code: int = 0) -> None:
        if not self._f.closed:
            self._f.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a phase file; a torn last line (killed writer) is skipped."""
    out = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return out
