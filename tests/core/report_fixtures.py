"""Synthetic runs for the report tests, written by the real ``PhaseRecorder`` + ``JsonlSink``.

A scripted probe plays the devices: ``cuda`` (two entries per device: ``mem_get_info`` driver
truth and ``torch_allocator``; engine memory lives below the allocator, as with
torch_memory_saver), ``jax_cpu`` (``live_arrays``) or ``tpu`` (``memory_stats``). The RL
schedule is the multi-stage awake (14 phases per step incl. ``checkpoint``, ``empty_cache`` twice).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mllm_rl.phases import DeviceMemory, PhaseRecorder
from mllm_rl.phases.recorder import PhaseHandle
from mllm_rl.run import phase_file_name, write_run_json
from mllm_rl.sinks.jsonl import JsonlSink

MiB = 2**20
SETUP = ["wandb_init", "jax_ready", "engine_ready"]
FINAL = ["generate_result"]  # after the steps
STEP = ["rollout", "drain", "release_rollout", "onload_trainer", "train_step", "checkpoint", "offload_optimizer",
        "empty_cache",
        "resume_weights", "update_weights", "offload_trainer_params", "empty_cache", "resume_kv",
        "continue_generation"]  # fmt: skip
SWAP = ["wandb_init", "jax_ready", "engine_ready_dummy", "weights_swapped", "generate_result"]
W, K, P, OPT, A, BUCKET, BASE = 40 * MiB, 24 * MiB, 40 * MiB, 80 * MiB, 16 * MiB, 4 * MiB, 8 * MiB


class FakeDevices:
    """Scripted memory of ``n`` local devices. ``alloc``: allocator bytes (trainer); ``engine``:
    engine bytes (below the allocator on CUDA)."""

    def __init__(self, n: int = 2, kind: str = "cuda") -> None:
        self.n, self.kind = n, kind
        self.alloc = [BASE] * n
        self.engine = [0] * n
        self.peak = [BASE] * n
        if kind == "cuda":
            self.reset_peak = self._reset_peak

    def _reset_peak(self) -> None:
        self.peak = list(self.alloc)

    def add(self, alloc: int = 0, engine: int = 0) -> None:
        for i in range(self.n):
            self.alloc[i] += alloc
            self.engine[i] += engine
            self.peak[i] = max(self.peak[i], self.alloc[i] if self.kind == "cuda" else self.total(i))

    def total(self, i: int) -> int:
        return self.alloc[i] + self.engine[i]

    def snapshot(self) -> list[DeviceMemory]:
        out = []
        for i in range(self.n):
            if self.kind == "cuda":
                out.append(DeviceMemory(i, "cuda", self.total(i) + MiB, None, 1024 * MiB, "mem_get_info", {}))
                out.append(
                    DeviceMemory(i, "cuda", self.alloc[i], self.peak[i], 1024 * MiB, "torch_allocator", {})
                )
            elif self.kind == "jax_cpu":
                out.append(DeviceMemory(i, "cpu", self.total(i), None, None, "live_arrays", {}))
            else:
                out.append(
                    DeviceMemory(i, "tpu", self.total(i), self.peak[i], 1024 * MiB, "memory_stats", {})
                )
        return out

    def in_use(self) -> list[int | None]:
        return [d.bytes_in_use for d in self.snapshot()]


@dataclass
class Ctx:
    rec: PhaseRecorder
    dev: FakeDevices
    process: int
    drop: set[tuple[Any, ...]]
    seen: dict[tuple[Any, ...], int]

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None, **info: Any) -> Iterator[PhaseHandle]:
        """A recorded phase, or the same work unrecorded when ``(process, step, name[, occurrence])``
        is in ``drop`` (a missing trace point)."""
        k = self.seen.get((step, name), 0)
        self.seen[(step, name)] = k + 1
        if (self.process, step, name) in self.drop and k == 0 or (self.process, step, name, k) in self.drop:
            yield PhaseHandle(name, step, dict(info))
            return
        with self.rec.phase(name, step=step, **info) as h:
            yield h

    def spike(self, extra: int) -> None:
        """A transient allocation the recorder samples, then freed."""
        self.dev.add(alloc=extra)
        self.rec.sample()
        self.dev.add(alloc=-extra)


class Killed(Exception):
    """The process died here (nothing recorded for the rest)."""


def setup(c: Ctx) -> None:
    with c.phase("wandb_init"):
        pass
    with c.phase("jax_ready"):
        c.rec.set_probe(c.dev)
    with c.phase("engine_ready"):
        c.dev.add(engine=W + K)


def rl_step(
    c: Ctx, s: int, release_frees: float = 1.0, stop_after: str | None = None, fail_in: str | None = None
) -> None:
    """One multi-stage-awake step. ``release_frees``: fraction of the engine's bytes the release
    really frees; ``stop_after``: the process is killed after this phase; ``fail_in``: this phase raises."""
    n = c.dev.n
    plan: list[tuple[str, dict[str, Any], Any]] = [
        ("rollout", {"tokens": 128}, lambda: c.spike(A // 2)),
        ("drain", {}, lambda: None),
        ("release_rollout", {"expected_freed_bytes": n * (W + K)},
         lambda: c.dev.add(engine=-int((W + K) * release_frees))),
        ("onload_trainer", {"expected_alloc_bytes": n * (P + OPT)}, lambda: c.dev.add(alloc=P + OPT)),
        ("train_step", {"reward_mean": 0.25 * s, "loss": 1.0 / (s + 1)}, lambda: c.spike(A)),
        ("checkpoint", {"saved": True}, lambda: None),
        ("offload_optimizer", {"expected_freed_bytes": n * OPT}, lambda: c.dev.add(alloc=-OPT)),
        ("empty_cache", {}, lambda: None),
        ("resume_weights", {"expected_alloc_bytes": n * W}, lambda: c.dev.add(engine=W)),
        ("update_weights", {}, lambda: c.spike(BUCKET)),
        ("offload_trainer_params", {"expected_freed_bytes": n * P}, lambda: c.dev.add(alloc=-P)),
        ("empty_cache", {}, lambda: None),
        ("resume_kv", {"expected_alloc_bytes": n * K}, lambda: c.dev.add(engine=K)),
        ("continue_generation", {}, lambda: None),
    ]  # fmt: skip
    for name, info, work in plan:
        with c.phase(name, s, **info):
            work()
            if name == fail_in:
                raise RuntimeError(f"RESOURCE_EXHAUSTED in {name}")
        if name == stop_after:
            raise Killed(name)


def run_json(
    run_dir: Path,
    processes: int,
    steps: int,
    phases: list[str] = SETUP + FINAL,
    step_phases: list[str] = STEP,
    run_id: str = "rl-test",
    plan: str = "rl",
) -> None:
    write_run_json(run_dir, {
        "run_id": run_id, "backend": "fake", "plan": plan, "model": "tiny", "steps": steps,
        "process_count": processes, "expected_phases": phases, "expected_step_phases": step_phases,
    })  # fmt: skip


def write_rl_run(
    run_dir: Path,
    processes: int = 2,
    steps: int = 2,
    kind: str = "cuda",
    devices: int = 2,
    drop: set[tuple[Any, ...]] | None = None,
    release_frees: float = 1.0,
    attempts: list[tuple[int, tuple[int, str] | None]] | None = None,
    fail_in: tuple[int, str] | None = None,
    with_run_json: bool = True,
    run_id: str = "rl-test",
) -> Path:
    """An RL run. ``attempts``: per attempt ``(first step, (step, phase) killed after or None)``;
    default one attempt over every step. Each attempt is a fresh recorder appending to the same file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if with_run_json:
        run_json(run_dir, processes, steps, run_id=run_id)
    for p in range(processes):
        for first, stop in attempts or [(0, None)]:
            sink = JsonlSink(run_dir / phase_file_name(p))
            rec = PhaseRecorder(run_id, "fake", sinks=[sink], process_index=p, sample_interval_s=0)
            c = Ctx(rec, FakeDevices(devices, kind), p, drop or set(), {})
            try:
                setup(c)
                for s in range(first, steps):
                    rl_step(
                        c,
                        s,
                        release_frees,
                        stop_after=stop[1] if stop and stop[0] == s else None,
                        fail_in=fail_in[1] if fail_in and fail_in[0] == s else None,
                    )
                with c.phase("generate_result"):
                    pass
            except (Killed, RuntimeError):
                pass
            finally:
                rec.close()
    return run_dir


def write_swap_run(
    run_dir: Path,
    swap_extra: int = 2 * MiB,
    kind: str = "tpu",
    devices: int = 1,
    run_id: str = "swap-test",
    backend: str = "fake",
    with_run_json: bool = True,
) -> Path:
    """A param-swap run (SWAP phases); ``weights_swapped`` peaks ``swap_extra`` above its steady bytes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if with_run_json:
        run_json(run_dir, 1, 0, phases=SWAP, step_phases=[], run_id=run_id, plan="swap")
    rec = PhaseRecorder(run_id, backend, sinks=[JsonlSink(run_dir / "phases.jsonl")], sample_interval_s=0)
    c = Ctx(rec, FakeDevices(devices, kind), 0, set(), {})
    with c.phase("wandb_init"):
        pass
    with c.phase("jax_ready"):
        rec.set_probe(c.dev)
    with c.phase("engine_ready_dummy", tp=devices):
        c.dev.add(engine=W + K)
    with c.phase("weights_swapped", bytes=W * devices):
        c.spike(swap_extra)
    with c.phase("generate_result"):
        pass
    rec.close()
    return run_dir


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def write_lines(path: Path, recs: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
