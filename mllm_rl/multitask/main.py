"""``python -m mllm_rl.run --backend B --tasks tasks.toml``: several RL tasks on the same devices.

Run-level phases (task ``null``): ``wandb_init``, ``<backend>_ready``. Then the lease schedule
(``schedule.py``) over every task (``runtime.py``), driven by ``driver.py``. Outputs in the run
directory: ``phases.jsonl`` (schema ``mllm_rl.phase/2``: every record names its task),
``metrics.jsonl`` (one line per task per step, with ``task``), ``leases.jsonl`` (one line per
lease: task, kind, step, times, outcome on every process, device bytes after it; per process
``leases.p<i>.jsonl``), ``run.json`` (with ``tasks``: per task its expected phases and its
status, ``done`` or ``failed`` with the error), ``tasks/<name>/checkpoints``, ``report/``.

Exit codes: 0 every task done; 2 bad input (nothing started); otherwise the code of the first
failure (3 weights differ, 4 lifecycle invariant, 5 non-finite loss, 1 anything else; also with
``--fail-fast``, which stops the whole run at the first failure instead of letting the other tasks
go on);
128+N on signal N.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from mllm_rl.multitask.spec import TaskSpec, load_tasks

RUN_PHASES = ["wandb_init", "{ready}"]


def _exit_code(e: BaseException) -> int:
    from mllm_rl.checkpoint.model_dir import CheckpointError
    from mllm_rl.engine import WeightMismatch
    from mllm_rl.lifecycle import LifecycleError, NonFiniteTraining

    if isinstance(e, WeightMismatch):
        return 3
    if isinstance(e, NonFiniteTraining):
        return 5
    if isinstance(e, LifecycleError):
        return 4
    if isinstance(e, (CheckpointError, ValueError)):
        return 2
    return 1


def _validate(args: argparse.Namespace) -> tuple[list[TaskSpec], Any, dict[str, Any]]:
    """Tasks file, backend, engine choice, run directory, models and data: all checked before
    anything starts (``ValueError`` / ``CheckpointError``, exit 2)."""
    from mllm_rl.backend_registry import load_backend
    from mllm_rl.checkpoint.resolve import resolve_model
    from mllm_rl.plans.preflight import check_fresh, check_run_dir, check_run_id
    from mllm_rl.tasks import get_task

    # --plan, --resume-or-start and every per-task flag next to --tasks: refused by ``run.check_mode``
    if args.resume and not (args.run_dir or args.run_id):
        raise ValueError("--resume needs --run-dir or --run-id (the run to continue)")
    specs = load_tasks(args.tasks)
    backend = load_backend(args.backend)
    for s in specs:
        try:
            opts = s.rl_options(tp=args.tp, platform=_platform(args), engine=args.engine)
            opts.engine.check_backend(backend.name, backend.engines)
            get_task(s.task, s.task_data)
        except (ValueError, OSError) as e:
            raise ValueError(f"{args.tasks}: task {s.name!r}: {e}") from None
    check_run_id(args.run_id)
    if args.run_dir:
        check_run_dir(Path(args.run_dir).resolve())
        if not args.resume:
            check_fresh(Path(args.run_dir).resolve(), "phases.jsonl")
    models = {s.name: resolve_model(s.model, seed=s.seed) for s in specs}
    for s in specs:
        try:
            models[s.name].check_tp(args.tp)
        except ValueError as e:
            raise ValueError(f"{args.tasks}: task {s.name!r}: {e}") from None
    return specs, backend, models


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the tasks of ``args.tasks`` (the run-level flags come from ``args``); the exit code."""
    from mllm_rl.checkpoint.model_dir import CheckpointError

    try:
        specs, backend, models = _validate(args)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # the backend's framework is not in this environment
        print(f"error: --backend {args.backend}: {e} (install the '{args.backend}' extra)", file=sys.stderr)
        return 2
    try:
        procs = backend.init_distributed(tp=args.tp)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    pidx, pcount = int(procs["process_index"]), int(procs["process_count"])
    if pcount > 1 and backend.name == "jax":
        # The lease protocol spans processes (tests/jax/test_multitask_multihost.py), but sglang-jax
        # refuses release/resume for an engine spanning processes (backends/jax/sglang_engine.py).
        print(f"error: --tasks: {pcount} processes: sglang-jax cannot release an engine that spans "
              "processes yet; run a multi-task run in one process", file=sys.stderr)  # fmt: skip
        backend.shutdown_distributed()
        return 2
    return _run(args, argv, specs, backend, models, pidx, pcount)


def _run(args: argparse.Namespace, argv: list[str] | None, specs: list[TaskSpec], backend: Any,
         models: dict[str, Any], pidx: int, pcount: int) -> int:  # fmt: skip
    from mllm_rl.coordination import coordinator_for
    from mllm_rl.multitask.driver import Driver, TaskFailed
    from mllm_rl.multitask.ports import allocate
    from mllm_rl.multitask.runtime import RLTask, task_phases
    from mllm_rl.multitask.schedule import lease_schedule, schedule_digest
    from mllm_rl.phases.recorder import PhaseRecorder
    from mllm_rl.progress import progress_bar
    from mllm_rl.report.at_exit import report_at_exit
    from mllm_rl.run_files import phase_file_name, write_run_json
    from mllm_rl.run_lock import RunDirBusy, acquire
    from mllm_rl.signals import Terminated
    from mllm_rl.sinks.console import ConsoleSink
    from mllm_rl.sinks.jsonl import JsonlSink, MetricsJsonlSink, count_records

    run_id = (
        args.run_id or f"multitask-{args.backend}-{time.strftime('%y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    )
    run_dir = Path(args.run_dir or Path("runs") / run_id).resolve()
    if args.resume and args.run_id is None:
        run_id = _previous(run_dir).get("run_id", run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        acquire(run_dir, pidx, run_id)  # a second run on this directory is refused here
    except RunDirBusy as e:
        print(f"error: {e}", file=sys.stderr)
        backend.shutdown_distributed()
        return 2
    phase_file = run_dir / phase_file_name(pidx)
    sinks: list[Any] = [JsonlSink(phase_file),
                        MetricsJsonlSink(run_dir / phase_file.name.replace("phases", "metrics"))]  # fmt: skip
    if not args.quiet and args.console != "off":
        sinks.append(ConsoleSink(compact=args.console == "compact"))
    start_idx = count_records(phase_file) if args.resume else 0
    rec = PhaseRecorder(
        run_id, backend.name, sinks=sinks, process_index=pidx, start_idx=start_idx, tasks=True
    )
    coord = coordinator_for(backend)
    ports = json.loads(
        coord.gather("ports", json.dumps(allocate([s.name for s in specs]) if pidx == 0 else {}))[0]
    )
    engines: list[Any] = []
    runtimes = {s.name: RLTask(s, models[s.name], backend, rec, run_dir, tp=args.tp, platform=_platform(args),
                               engine=args.engine, resume=args.resume, ports=ports[s.name], on_engine=engines.append)
                for s in specs}  # fmt: skip
    for name, rt in runtimes.items():
        for d, why in rt.skipped:
            print(f"resume: task {name!r}: skipped {d.name}: {why}", file=sys.stderr)
    schedule = lease_schedule([rt.steps for rt in runtimes.values()])
    previous = _previous(run_dir).get("tasks", {}) if args.resume else {}
    plan: dict[str, Any] = {
        "run_id": run_id, "backend": backend.name, "plan": "multitask", "model": None, "process_count": pcount,
        "expected_phases": [p.format(ready=backend.ready_phase) for p in RUN_PHASES], "expected_step_phases": [],
        "steps": 0, "lease_order": "round_robin", "schedule_digest": schedule_digest(schedule),
        "argv": sys.argv[1:] if argv is None else argv,
        "tasks": {name: {"model": str(rt.model.path), "seed": rt.spec.seed, "task": rt.spec.task,
                         "steps": rt.opts.steps, "first_step": 0, "resumed_at": rt.first_step,
                         "group_size": rt.spec.group_size, "lora_rank": rt.spec.lora_rank, "lr": rt.spec.lr,
                         "ports": ports[name], **task_phases(rt.opts.lifecycle),
                         "status": "pending", "error": None, "previous_status": previous.get(name, {}).get("status")}
                  for name, rt in runtimes.items()},
    }  # fmt: skip

    def on_status(statuses: dict[str, Any]) -> None:
        if pidx != 0:
            return
        for name, st in statuses.items():
            plan["tasks"][name].update(status=st.status, error=st.error, failed_lease=st.failed_lease)
        write_run_json(run_dir, plan)

    if pidx == 0:
        write_run_json(run_dir, plan)
    lease_file = open(run_dir / phase_file.name.replace("phases", "leases"), "a", encoding="utf-8")  # noqa: SIM115
    bar_cm = progress_bar(total=len(schedule), desc="leases", unit="lease")
    bar = bar_cm.__enter__()

    def on_lease(entry: dict[str, Any]) -> None:
        lease_file.write(json.dumps(entry) + "\n")
        lease_file.flush()
        bar.update(1)
        bar.set_postfix_str(
            f"{entry['task']} {entry['kind']} {entry['step'] if entry['step'] is not None else ''}"
        )

    code = 0
    driver: Driver | None = None
    try:
        _run_level_phases(args, backend, rec, run_dir, run_id, pidx)
        for rt in runtimes.values():
            rt.prepare()
        driver = Driver(schedule, runtimes, coord, fail_fast=args.fail_fast, on_lease=on_lease,
                        on_status=on_status, device_bytes=lambda: _device_bytes(rec))  # fmt: skip
        statuses = driver.run()
        failed = [n for n, st in statuses.items() if st.status == "failed"]
        if failed:
            first = driver.errors.get(failed[0])
            code = _exit_code(first) if first is not None else 1
            print(f"error: task(s) failed: {', '.join(f'{n} ({statuses[n].error})' for n in failed)}",
                  file=sys.stderr)  # fmt: skip
    except Terminated as e:
        code = 128 + e.signum
        print(f"terminated by signal {e.signum}; phase log closed", file=sys.stderr)
    except TaskFailed as e:
        code = 1
        print(f"error: {e}", file=sys.stderr)
    except Exception as e:  # --fail-fast re-raises the task's own error; bad input found late
        code = _exit_code(e)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        bar_cm.__exit__(None, None, None)
        lease_file.close()
        if pidx == 0:
            report_at_exit(run_dir, rec)
        rec.close(code)
        for engine in engines:
            engine.shutdown()
        backend.shutdown_distributed()
    for name, rt in runtimes.items():
        for h in rt.history:
            print(f"{name} step {h['step']:>3}: reward_mean {h['reward_mean']:.3f}  loss {h.get('loss', float('nan')):.4f}",
                  file=sys.stderr)  # fmt: skip
        if rt.eval is not None:
            print(
                f"{name}: greedy reward {rt.eval.get('greedy_reward_mean', float('nan')):.3f}",
                file=sys.stderr,
            )
    print(f"run_dir {run_dir}", file=sys.stderr)
    return code


def _platform(args: argparse.Namespace) -> str:
    return "gpu" if args.platform == "cuda" else args.platform


def _run_level_phases(args: argparse.Namespace, backend: Any, rec: Any, run_dir: Path, run_id: str,
                      pidx: int) -> None:  # fmt: skip
    """``wandb_init`` and ``<backend>_ready`` (task ``null``); installs the memory probe."""
    with rec.phase("wandb_init") as ph:
        sink = None
        if args.wandb != "disabled":
            from mllm_rl.sinks.wandb_sink import WandbSink

            wid = run_id if pidx == 0 else f"{run_id}-p{pidx}"
            sink = WandbSink(args.wandb, run_dir, wid, project=args.wandb_project, resume=args.resume,
                             config={k: v for k, v in vars(args).items() if k != "prompt"})  # fmt: skip
            rec.sinks.append(sink)
            ph.info["wandb_dir"] = sink.offline_dir
        ph.info["wandb"] = "disabled" if sink is None else "enabled"
    with rec.phase(backend.ready_phase) as ph:
        ph.info.update(backend.init_runtime(tp=args.tp, platform=_platform(args)))
        rec.set_probe(backend.memory_probe())


def _device_bytes(rec: Any) -> int | None:
    """Device bytes in use now, summed over this process's devices (``None`` when unknown)."""
    used = [u for u in rec.probe.in_use() if u is not None]
    return sum(used) if used else None


def _previous(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
