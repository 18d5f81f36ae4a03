"""Append-only JSONL sink: the source of truth. Flushed and fsynced per record; strict JSON
(a non-finite number is written as ``"NaN"``/``"Infinity"``: ``mllm_rl.phases.jsonsafe``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mllm_rl.phases.jsonsafe import dumps
from mllm_rl.phases.recorder import Sink


class JsonlSink(Sink):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self, exit_code: int = 0) -> None:
        if not self._f.closed:
            self._f.close()


class MetricsJsonlSink(JsonlSink):
    """``metrics.jsonl``: one line per RL step, ``{"step": k, "time": t, ...metrics}``."""

    def write(self, record: dict[str, Any]) -> None:
        pass  # phase records go to phases.jsonl

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        super().write({"step": step, "time": time.time(), **metrics})


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


def _drop_torn_tail(path: Path) -> None:
    """Cut a torn last line (a writer killed mid-line) that appending would bury mid-file."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        if not (data := f.read()).endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def count_records(path: str | Path) -> int:
    """Records in a phase file (0 if it does not exist): a resumed run continues its ``idx``."""
    path = Path(path)
    return len(read_jsonl(path)) if path.exists() else 0
