"""``--profile`` on torch: a ``torch.profiler`` Chrome trace of a step (``mllm_rl.profiling``) of
this process (CPU, CUDA kernels when CUDA is up, allocations; phases as ``record_function``) into
``trace.json`` (``trace.p<i>.json`` for process i > 0)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from mllm_rl.profiling import StepProfiler


class TorchProfiler(StepProfiler):
    def __init__(self) -> None:
        self._prof: Any = None
        self._path: Path | None = None

    def start(self, out_dir: Path, process_index: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            raise RuntimeError(f"a torch.profiler trace into {self._path} is still running")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        out_dir.mkdir(parents=True, exist_ok=True)
        self._path = out_dir / (f"trace.p{process_index}.json" if process_index else "trace.json")
        self._prof = profile(activities=activities, profile_memory=True)
        self._prof.__enter__()

    def stop(self) -> list[Path]:
        if self._prof is None or self._path is None:
            return []
        prof, path, self._prof, self._path = self._prof, self._path, None, None
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(str(path))
        return [path]

    def annotate(self, name: str) -> contextlib.AbstractContextManager[Any]:
        from torch.profiler import record_function

        return record_function(name)

    def how_to_open(self, profile_dir: Path) -> str:
        return f"https://ui.perfetto.dev (Open trace file) or chrome://tracing: the trace*.json files in {profile_dir}"
