"""Names and writers of a run directory's files (shared by single- and multi-task runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def phase_file_name(process_index: int) -> str:
    """``phases.jsonl`` for process 0, ``phases.p<i>.jsonl`` for the others (one file each)."""
    return "phases.jsonl" if process_index == 0 else f"phases.p{process_index}.jsonl"


def write_run_json(run_dir: Path, plan: dict[str, Any]) -> None:
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(plan, indent=2))
    os.replace(tmp, run_dir / "run.json")
