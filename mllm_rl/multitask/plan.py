"""``python -m mllm_rl.run --tasks tasks.toml``: several RL tasks on the same devices, a plan of the
one run (``mllm_rl.run`` does the rest).

Run-level phases (task ``null``): ``wandb_init``, ``<backend>_ready``; then every lease of every
task (``driver.py``, ``runtime.py``). Extra outputs: ``leases.jsonl`` (``leases.p<i>.jsonl`` per
process), ``run.json``'s ``tasks``, ``tasks/<name>/checkpoints``. Exit code: 0 when every task is
done, else the first failure's (``TasksFailed``); ``--fail-fast`` stops at the first failure."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mllm_rl.backend import Backend
from mllm_rl.engine import EngineOptions
from mllm_rl.plans.base import Plan, PlanRun, run_level

RUN_PHASES = ["wandb_init", "{ready}"]
# Server engines bind TCP ports and pick them by "random + is it free?", so two can collide: each task
# gets its own block, every port bind-tested free and never handed out twice (process 0 allocates).
BLOCK = 8  # ports per task: sglang-jax multi-node binds base+5 and base+6; SGLang port + nccl_port
FIRST_PORT = 20000
LAST_PORT = 60000


def port_free(port: int, host: str = "0.0.0.0") -> bool:
    """Can a TCP socket bind ``port`` now (the bind test)?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out blocks of ``BLOCK`` consecutive free ports, each port at most once."""

    def __init__(
        self, first: int = FIRST_PORT, last: int = LAST_PORT, is_free: Callable[[int], bool] = port_free
    ) -> None:
        if not 0 < first < last < 65536:
            raise ValueError(f"port range {first}-{last} is not within 1-65535")
        self.next, self.last, self.is_free = first, last, is_free
        self.given: dict[str, list[int]] = {}

    def block(self, owner: str, n: int = BLOCK) -> list[int]:
        """``n`` consecutive ports, every one bind-tested free and never given before."""
        if owner in self.given:
            raise ValueError(f"ports for {owner!r} were already allocated: {self.given[owner]}")
        base = self.next  # every port given so far is below it
        while base + n - 1 <= self.last:
            ports = list(range(base, base + n))
            busy = next((p for p in ports if not self.is_free(p)), None)
            if busy is None:
                self.given[owner] = ports
                self.next = base + n
                return ports
            base = busy + 1
        raise RuntimeError(f"no {n} consecutive free ports left in {self.next}-{self.last} for {owner!r}")


def allocate(owners: Sequence[str], allocator: PortAllocator | None = None) -> dict[str, list[int]]:
    """A block of ports per owner (task name), from one allocator."""
    alloc = allocator or PortAllocator()
    return {name: alloc.block(name) for name in owners}


@dataclasses.dataclass
class MultitaskOptions:
    tasks_file: str
    specs: list[Any]  # TaskSpec, in file order
    engine: EngineOptions  # the run-level engine choice and tp (every task's engine takes them)
    platform: str
    resume: bool
    fail_fast: bool
    models: dict[str, Any] = dataclasses.field(default_factory=dict)  # task -> ModelDir (``resolve_model``)
    # --resume: every accepted change of a task's setting ({task, key, from, to}), all attempts
    task_overrides: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def rl_options(self, spec: Any, model_name: str | None = None) -> Any:
        """``spec``'s ``RLOptions`` with the run's engine choice, tp and platform."""
        return spec.rl_options(self.engine.tp, self.platform, self.engine.engine, model_name)


class MultitaskPlan(Plan[MultitaskOptions]):
    """The tasks of a ``--tasks`` file, lease by lease on the same devices (docs/MULTITASK.md)."""

    name = "multitask"
    scope = "tasks"
    tasks = True
    summary = "several RL tasks of a --tasks file on the same devices"

    def options(self, args: argparse.Namespace, engine: EngineOptions, platform: str) -> MultitaskOptions:
        from mllm_rl.multitask.spec import load_tasks

        specs = load_tasks(args.tasks)  # every task's own options checked, named by file, task and key
        for s in specs:
            try:
                s.rl_options(tp=args.tp, platform=platform, engine=args.engine)
            except ValueError as e:
                raise ValueError(f"{args.tasks}: task {s.name!r}: {e}") from None
        return MultitaskOptions(args.tasks, specs, engine, platform, bool(args.resume), bool(args.fail_fast))

    def preflight(
        self, args: argparse.Namespace, opts: MultitaskOptions, backend: Backend, run_dir: Path
    ) -> tuple[MultitaskOptions, list[str]]:
        from mllm_rl.options.resume import compare_tasks
        from mllm_rl.tasks import build_task
        from mllm_rl.tasks.reward import check_reward

        notes: list[str] = []
        for s in opts.specs:  # every task's data read and checked, its reward loaded in a worker
            o = opts.rl_options(s)
            try:
                task = build_task(o.task_config)
                task.close()
                if o.reward is not None:
                    check_reward(o.reward, o.reward_timeout)
            except (ValueError, OSError) as e:
                raise ValueError(f"{opts.tasks_file}: task {s.name!r}: {e}") from None
            notes += [f"task {s.name!r}: {n}" for n in getattr(task, "notes", [])]
        previous = _run_json(run_dir) if opts.resume else {}
        if isinstance(previous.get("task_options"), dict):
            changes = compare_tasks(
                opts.specs,
                previous["task_options"],
                args.override or [],
                opts.tasks_file,
                run_dir / "run.json",
            )
            opts = dataclasses.replace(opts, task_overrides=[*previous.get("task_overrides", []), *changes])
            notes += [
                f"resume: task {c['task']!r}: --override {c['key']}: {c['from']} -> {c['to']} "
                f"(recorded in run.json)"
                for c in changes
            ]
        return opts, notes

    def resolve_model(
        self, args: argparse.Namespace, opts: MultitaskOptions
    ) -> tuple[MultitaskOptions, None, list[str]]:
        from mllm_rl.checkpoint.resolve import resolve_model
        from mllm_rl.plans.rl import check_prompts

        models, notes = {}, []
        for s in opts.specs:
            try:
                models[s.name] = m = resolve_model(s.model, seed=s.seed)
                m.check_tp(opts.engine.tp)
                o = opts.rl_options(s)
                notes += [f"task {s.name!r}: {n}" for n in check_prompts(o, m)]  # prompts fit the context
            except ValueError as e:
                raise ValueError(f"{opts.tasks_file}: task {s.name!r}: {e}") from None
        return dataclasses.replace(opts, models=models), None, notes

    def check_runtime(self, backend: Backend, model: Any, opts: MultitaskOptions, process_count: int) -> None:
        # Several tasks' real engines across processes are untested (only fakes are), so refused.
        self.require_release(backend, process_count)
        if process_count > 1:
            raise ValueError(
                f"{process_count} processes: --tasks runs as one process for now (a single task's "
                f"--plan rl runs across processes)"
            )
        for name, m in opts.models.items():
            try:
                backend.check_engine_args(m, opts.engine)
            except ValueError as e:
                raise ValueError(f"{opts.tasks_file}: task {name!r}: {e}") from None

    def phase_names(self) -> set[str]:
        from mllm_rl.lifecycle import (
            LEASE_SETUP_PHASES,
            TRAIN_LEASE_PHASES,
            LifecycleOptions,
            rollout_lease_phases,
        )

        names = {*RUN_PHASES, *LEASE_SETUP_PHASES, *TRAIN_LEASE_PHASES, "checkpoint_flush"}
        for check in (False, True):
            life = LifecycleOptions(check_weights=check)
            names |= {*rollout_lease_phases(life), *rollout_lease_phases(life, "generate_result")}
        return names

    def run_json(self, backend: Backend, opts: MultitaskOptions) -> dict[str, Any]:
        from mllm_rl.options.resume import task_record

        return {
            "model": None,
            "steps": 0,
            "expected_phases": [p.format(ready=backend.ready_phase) for p in RUN_PHASES],
            "expected_step_phases": [],
            "lease_order": "round_robin",
            "tasks_file": opts.tasks_file,
            "task_options": {s.name: task_record(s) for s in opts.specs},
            "task_overrides": opts.task_overrides,
        }

    def run(self, ctx: PlanRun, opts: MultitaskOptions) -> dict[str, Any]:
        return run_tasks(ctx, opts)


def run_tasks(ctx: PlanRun, opts: MultitaskOptions) -> dict[str, Any]:
    """The run-level phases, then every lease of every task; ``TasksFailed`` when a task failed (the
    others ran on), the task's own error with ``--fail-fast``."""
    import sys

    from mllm_rl.coordination import coordinator_for
    from mllm_rl.exit_codes import TasksFailed, exit_of
    from mllm_rl.multitask.driver import Driver, lease_schedule, schedule_digest
    from mllm_rl.multitask.runtime import RLTask, task_phases
    from mllm_rl.progress import progress_bar

    backend, rec, pidx = ctx.backend, ctx.rec, ctx.process_index
    previous = _run_json(ctx.run_dir).get("tasks", {}) if opts.resume else {}
    coord = coordinator_for(backend)
    names = [s.name for s in opts.specs]
    ports = json.loads(coord.gather("ports", json.dumps(allocate(names) if pidx == 0 else {}))[0])
    runtimes = {
        s.name: RLTask(s, opts, backend, rec, ctx.run_dir, ports[s.name], ctx.on_engine) for s in opts.specs
    }
    for name, rt in runtimes.items():
        for d, why in rt.skipped:
            print(f"resume: task {name!r}: skipped {d.name}: {why}", file=sys.stderr)
    schedule = lease_schedule([rt.steps for rt in runtimes.values()])
    tasks = {
        name: {
            "model": str(rt.model.path),
            "seed": rt.spec.seed,
            "task": rt.spec.task,
            "steps": rt.opts.steps,
            "first_step": 0,
            "resumed_at": rt.first_step,
            "group_size": rt.spec.group_size,
            "lora_rank": rt.spec.lora_rank,
            "lr": rt.opts.train.lr,
            "ports": ports[name],
            **task_phases(rt.opts.lifecycle),
            "status": "pending",
            "error": None,
            "previous_status": previous.get(name, {}).get("status"),
        }
        for name, rt in runtimes.items()
    }
    ctx.write_run_json({"schedule_digest": schedule_digest(schedule), "tasks": tasks})

    def on_status(statuses: dict[str, Any]) -> None:
        for name, st in statuses.items():
            tasks[name].update(status=st.status, error=st.error, failed_lease=st.failed_lease)
        ctx.write_run_json({"schedule_digest": schedule_digest(schedule), "tasks": tasks})

    lease_path = ctx.run_dir / (f"leases.p{pidx}.jsonl" if pidx else "leases.jsonl")
    with (
        open(lease_path, "a", encoding="utf-8") as lease_file,
        progress_bar(total=len(schedule), desc="leases", unit="lease") as bar,
    ):

        def on_lease(entry: dict[str, Any]) -> None:
            lease_file.write(json.dumps(entry) + "\n")
            lease_file.flush()
            bar.update(1)
            step = entry["step"] if entry["step"] is not None else ""
            bar.set_postfix_str(f"{entry['task']} {entry['kind']} {step}")

        run_level(backend, rec, ctx.make_wandb, ctx.runtime)
        try:
            for rt in runtimes.values():
                rt.prepare()
            ctx.on_started()
            driver = Driver(
                schedule,
                runtimes,
                coord,
                fail_fast=opts.fail_fast,
                on_lease=on_lease,
                on_status=on_status,
                device_bytes=lambda: _device_bytes(rec),
            )
            statuses = driver.run()
        finally:
            for rt in runtimes.values():
                rt.close()  # reward workers, rewards files
    from mllm_rl.sinks.console import step_line

    lines = []
    for name, rt in runtimes.items():
        lines += [step_line(h["step"], {**h, "task": name}, []) for h in rt.history]
        if rt.eval is not None:
            lines.append(f"{name}: greedy reward {rt.eval.get('greedy_reward_mean', float('nan')):.3f}")
    failed = [n for n, st in statuses.items() if st.status == "failed"]
    if failed:
        first = driver.errors.get(failed[0])
        code = exit_of(first)[0] if first is not None else 1
        for line in lines:
            print(line, file=sys.stderr)
        raise TasksFailed(code, f"task(s) failed: {', '.join(f'{n} ({statuses[n].error})' for n in failed)}")
    return {"history": [], "lines": lines}


def _device_bytes(rec: Any) -> int | None:
    """Device bytes in use now, summed over this process's devices (``None`` when unknown)."""
    used = [u for u in rec.probe.in_use() if u is not None]
    return sum(used) if used else None


def _run_json(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


PLAN = MultitaskPlan()
