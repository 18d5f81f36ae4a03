"""``--profile`` on JAX: a ``jax.profiler`` trace of a step (``mllm_rl.profiling``).

Writes ``dir/plugins/profile/<timestamp>/<host>.xplane.pb`` (XProf, TensorBoard) and
``<host>.trace.json.gz`` (Chrome trace events) for the whole process: the trainer and the
sglang-jax engine's scheduler thread. Phases are ``TraceAnnotation`` ranges.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from mllm_rl.profiling import StepProfiler


class JaxProfiler(StepProfiler):
    def __init__(self) -> None:
        self._dir: Path | None = None

    def start(self, out_dir: Path, process_index: int) -> None:
        import jax

        if self._dir is not None:
            raise RuntimeError(f"a jax.profiler trace into {self._dir} is still running")
        # each process its own directory: files are named by host
        self._dir = out_dir if process_index == 0 else out_dir / f"p{process_index}"
        self._dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self._dir))

    def stop(self) -> list[Path]:
        import jax

        if self._dir is None:
            return []
        out, self._dir = self._dir, None
        jax.profiler.stop_trace()
        return sorted(p for p in out.rglob("*") if p.is_file())

    def annotate(self, name: str) -> contextlib.AbstractContextManager[Any]:
        import jax

        return jax.profiler.TraceAnnotation(name)

    def how_to_open(self, profile_dir: Path) -> str:
        return (
            f"xprof --logdir {profile_dir} (pip install xprof), or tensorboard --logdir {profile_dir} with "
            f"tensorboard-plugin-profile; the .trace.json.gz files also open in https://ui.perfetto.dev"
        )
