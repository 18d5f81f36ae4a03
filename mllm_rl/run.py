"""``python -m mllm_rl.run``: run a plan (``--plan rl|swap``, ``--tasks``) and record every phase.

``--run-dir`` (default ``runs/<run_id>``) gets ``phases.jsonl`` (``phases.p<i>.jsonl`` for process
i > 0), ``run.json``, ``metrics.jsonl``, ``checkpoints/`` and ``wandb/``. Every check that can run
before start-up runs before any of it exists (exit 2, one line); exit codes: ``EXIT_CODES``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from mllm_rl.exit_codes import EXIT_CODES
from mllm_rl.presets import PRESETS
from mllm_rl.run_files import acquire, phase_file_name, write_run_json
from mllm_rl.signals import install_sigterm

# Nothing imported at module level may start a thread (numpy's OpenBLAS pool does):
# ``install_sigterm`` must run while the main thread is the only one.


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2): ``error: argument --tp: invalid int value: 'x'``."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


RUN_SCOPES = ("rl", "swap", "tasks")  # the modes of this command (``mllm_rl.options.schema``)


def build_parser(defaults: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The flags of every mode (``mllm_rl.options.schema``); ``defaults``: for flags not given."""
    from mllm_rl.options.cli import add_options
    from mllm_rl.plans.base import all_plans

    codes = "\n".join(f"  {code:>3}  {what}" for code, what in EXIT_CODES.items())
    plans = "\n".join(f"  {p.name:<5} {p.summary}" for p in all_plans())
    ap = OneLineParser(
        prog="python -m mllm_rl.run",
        usage="%(prog)s --backend {jax,torch} [--plan rl|swap | --tasks FILE] [options]",
        description="Run a plan and record every memory phase. A flag that the chosen plan (or --tasks) "
        f"does not take is refused.\n\nplans (--plan):\n{plans}\n\nmodel presets (--model): "
        f"{', '.join(PRESETS)}",
        epilog=f"exit codes:\n{codes}\n\ncaches (kept between runs in $MLLM_RL_CACHE, default ~/.cache/mllm_rl; "
        "each variable empty: off):\n"
        "  JAX_COMPILATION_CACHE_DIR  JAX's compiled programs, --backend jax (default $MLLM_RL_CACHE/jax-compile)\n"
        "  MLLM_RL_PLAN_CACHE         what the memory plan compiles or traces (default $MLLM_RL_CACHE/plans)\n\n"
        "host memory:\n"
        "  MLLM_RL_HUGEPAGES=0        keep 4 KiB pages (default: where the kernel's THP mode is madvise, the\n"
        "                             run starts itself again with glibc's malloc asking for huge pages)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(ap, RUN_SCOPES, defaults)
    return ap


def recorded_backend(argv: Sequence[str]) -> dict[str, Any]:
    """``{"backend": ...}`` from ``--run-dir``'s ``run.json`` for a resume without ``--backend``."""
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for flag in ("--run-dir", "--backend"):
        pre.add_argument(flag)
    for flag in ("--resume", "--resume-or-start"):
        pre.add_argument(flag, action="store_true")
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:  # the run's own parser says what is wrong
        return {}
    if not (known.resume or known.resume_or_start) or known.backend or not known.run_dir:
        return {}
    try:
        backend = json.loads((Path(known.run_dir) / "run.json").read_text())["options"]["backend"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {"backend": backend} if isinstance(backend, str) else {}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, set[str]]:
    """The flags with every default filled in, and the keys the user gave (exit 2 on a bad flag)."""
    from mllm_rl.options.cli import parse

    defaults = recorded_backend(sys.argv[1:] if argv is None else argv)
    return parse(build_parser(defaults), argv, RUN_SCOPES, defaults)


def check_mode(args: argparse.Namespace, given: set[str]) -> None:
    """``ValueError`` (one line naming the flag) for a flag this mode does not take or a value out
    of its range."""
    from mllm_rl.options.cli import check_scope, check_values

    mode = "tasks" if args.tasks else args.plan
    check_scope(args, given, mode, where=args.tasks or "")
    check_values(args, mode)


def _refuse(message: object, code: int, backend: Any = None) -> int:
    """Print the one-line error (leaving the multi-process run when given ``backend``); ``code``."""
    print(f"error: {message}", file=sys.stderr)
    if backend is not None:
        backend.shutdown_distributed()
    return code


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own: once more with huge pages where they help (no return)
        from mllm_rl.hugepages import restart_with_hugepages

        restart_with_hugepages("mllm_rl.run")
    if threading.active_count() == 1:
        install_sigterm()
    args, given = parse_args(argv)
    try:
        check_mode(args, given)
    except ValueError as e:
        return _refuse(e, 2)
    from mllm_rl.exit_codes import DOES_NOT_FIT, exit_of, named
    from mllm_rl.memplan.for_run import DoesNotFit, write_plan_files
    from mllm_rl.phases.recorder import PhaseRecorder
    from mllm_rl.phases.watchdog import STUCK_EXIT, PhaseStuck, Watchdog
    from mllm_rl.plans.base import PlanRun
    from mllm_rl.plans.preflight import check_fresh, prepare
    from mllm_rl.report.build import report_at_exit
    from mllm_rl.sinks.console import ConsoleSink
    from mllm_rl.sinks.jsonl import JsonlSink, MetricsJsonlSink, count_records

    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    try:
        pre = prepare(args, given)
    except ValueError as e:  # a CheckpointError too
        return _refuse(e, 2)
    except RuntimeError as e:  # W&B online unreachable with --wandb-fallback error
        return _refuse(e, 1)
    backend, model, opts, run_dir, run_id = pre.backend, pre.model, pre.opts, pre.run_dir, pre.run_id
    resuming = args.resume or args.resume_or_start

    # Every process records its own phases, process 0 writes run.json; the runtime comes up and
    # the options are checked against its devices, all before the run directory exists.
    try:
        tp = opts.engine.tp
        procs = backend.init_distributed(tp=tp)
        pidx, pcount = int(procs["process_index"]), int(procs["process_count"])
        phase_file = run_dir / phase_file_name(pidx)
        if not resuming:
            check_fresh(run_dir, phase_file.name)
        t0 = time.perf_counter()
        runtime = backend.init_runtime(tp=tp, platform=opts.platform)
        runtime["init_s"] = round(time.perf_counter() - t0, 3)
        runtime.setdefault("process_count", pcount)  # what the memory plan's target depends on
        pre.plan.check_runtime(backend, model, opts, pcount)
        opts, run_plan, plan_notes = pre.plan.memory_plan(backend, model, opts, runtime)
    except (DoesNotFit, ValueError) as e:  # the same refusal in every process: leave together
        return _refuse(e, DOES_NOT_FIT if isinstance(e, DoesNotFit) else 2, backend)
    except ImportError as e:  # the backend's framework is not in this environment
        return _refuse(f"--backend {args.backend}: {e} (install the '{args.backend}' extra)", 2)
    except RuntimeError as e:  # no platform as asserted, processes that could not meet
        return _refuse(e, 1)

    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        acquire(run_dir, pidx, run_id)  # a second run on this directory is refused here
        if not resuming:  # again, under the lock: a run may have started and ended since the first check
            check_fresh(run_dir, phase_file.name)
    except ValueError as e:  # RunDirBusy, or a run that came and went
        return _refuse(e, 2, backend)
    for line in [*pre.notes, *plan_notes]:
        say(line)
    if run_plan is not None and pidx == 0:
        write_plan_files(run_dir, run_plan)
    sinks: list[Any] = [
        JsonlSink(phase_file),
        MetricsJsonlSink(run_dir / phase_file.name.replace("phases", "metrics")),
    ]
    console = "off" if args.quiet else args.console
    if console != "off":
        sinks.append(ConsoleSink(console, steps=None if pre.plan.tasks else getattr(opts, "steps", None)))
    start_idx = count_records(phase_file) if resuming else 0
    rec = PhaseRecorder(
        run_id, backend.name, sinks=sinks, process_index=pidx, start_idx=start_idx, tasks=pre.plan.tasks
    )

    head = {"run_id": run_id, "backend": backend.name, "plan": pre.plan.name, "process_count": pcount}
    head |= {"model": None if model is None else str(model.path), **pre.plan.run_json(backend, opts)}
    run_argv = sys.argv[1:] if argv is None else argv
    tail = {"argv": run_argv, "options": pre.options, "overrides": pre.overrides}
    extra: dict[str, Any] = {}

    def write_plan(fields: dict[str, Any] | None = None) -> None:
        extra.update(fields or {})
        if pidx == 0:
            write_run_json(run_dir, {**head, **extra, **tail})

    if not pre.resuming:
        write_plan()  # a resumed attempt rewrites the run's run.json only once it has started (on_started)

    def make_wandb():
        if pre.wandb_mode == "disabled":
            return None
        from mllm_rl.sinks.wandb_sink import WandbSink

        wid = run_id if pidx == 0 else f"{run_id}-p{pidx}"
        return WandbSink(
            pre.wandb_mode,
            run_dir,
            wid,
            project=args.wandb_project,
            resume=resuming,
            fallback=args.wandb_fallback,
            init_timeout=max(30.0, 3 * args.wandb_timeout),
            config={k: v for k, v in vars(args).items() if k != "prompt"},
        )

    engines: list[Any] = []

    def hard_exit(stuck: PhaseStuck) -> None:
        """The watchdog's last resort (the main thread never came back): record, report, close."""
        rec.abandon(stuck, stuck=stuck.info)
        if pidx == 0:
            report_at_exit(run_dir, rec, quiet=args.quiet)
        rec.close(STUCK_EXIT)

    watchdog = Watchdog(pre.limits, run_dir, pidx, on_hard_exit=hard_exit)
    if threading.current_thread() is threading.main_thread():
        watchdog.install()
        rec.watchdog = watchdog
    code, error = 0, None
    result: dict[str, Any] = {}
    try:
        ctx = PlanRun(
            backend,
            rec,
            model,
            make_wandb,
            run_dir,
            runtime,
            on_engine=engines.append,
            on_started=write_plan if pre.resuming else lambda: None,
            write_run_json=write_plan,
            process_index=pidx,
        )
        result = pre.plan.run(ctx, opts)
    except BaseException as e:  # noqa: BLE001 -- every ending has its code and one line (mllm_rl.exit_codes)
        code, error = exit_of(e)
        if not named(e):  # not a failure we name: its traceback goes to a file, not the terminal
            error += f" (traceback: {_save_traceback(run_dir, pidx)})"
    finally:
        if pidx == 0:
            report_at_exit(run_dir, rec, quiet=args.quiet)
        rec.close(code)  # W&B finished and torn down before the engine kills child processes
        for engine in engines:
            engine.shutdown()
        backend.shutdown_distributed()  # all processes leave jax.distributed together (else the others abort)
        watchdog.finish()
    tables = console != "steps"  # the default console ends short: the tables are in the report
    if run_plan is not None and pidx == 0 and not args.quiet:
        from mllm_rl.memplan.audit import compare, drifts, summary, table

        try:
            check = compare(rec.records, run_plan.doc)
            if tables or drifts(check):
                say(table(check))
            say(summary(check))
        except (ValueError, KeyError) as e:
            say(f"memory plan: not compared with the records ({e})")
    if not args.quiet:
        _print_summary(rec.records, result, steps_shown=console != "off", tables=tables)
        print(f"run_dir {run_dir}", file=sys.stderr)
    if error is not None:
        print(error, file=sys.stderr)  # last: the line that says why the run failed
    return code


def _save_traceback(run_dir: Any, process_index: int) -> Any:
    """The current exception's traceback in the run directory's ``traceback[.p<i>].txt``."""
    import traceback

    path = run_dir / ("traceback.txt" if process_index == 0 else f"traceback.p{process_index}.txt")
    try:
        path.write_text(traceback.format_exc())
    except OSError:
        return "not saved"
    return path


def _print_summary(
    records: list[dict[str, Any]], result: dict[str, Any], steps_shown: bool, tables: bool
) -> None:
    """The phase tables, each step's line unless the console showed it, the plan's lines and the
    held-out generations."""
    if not records:
        return
    from mllm_rl.sinks.console import step_line
    from mllm_rl.summary import phase_table, step_table

    stepped = [r for r in records if r.get("step") is not None]
    if tables:
        print(phase_table([r for r in records if r.get("step") is None]), file=sys.stderr)
        if stepped:
            print(step_table(stepped), file=sys.stderr)
    for h in [] if steps_shown else result.get("history", []):
        print(step_line(h["step"], h, [r for r in stepped if r["step"] == h["step"]]), file=sys.stderr)
    for line in result.get("lines", []):
        print(line, file=sys.stderr)
    gen = records[-1]["info"]
    if records[-1]["phase"] == "generate_result" and "text" in gen:
        for prompt, text in list(zip(gen["prompts"], gen["text"], strict=True))[:4]:
            print(f"generate: {prompt!r} -> {text!r}", file=sys.stderr)
        if "greedy_reward_mean" in gen:
            print(
                f"greedy reward on {len(gen['prompts'])} held-out prompts: {gen['greedy_reward_mean']:.3f}",
                file=sys.stderr,
            )


# temporary directories libraries make when imported, removed by finalizers that ``os._exit`` skips
# (module, attribute path): wandb's media and artifact staging directories
LIBRARY_TEMP_DIRS = (("wandb.sdk.data_types._private", "MEDIA_TMP"), ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR"))  # fmt: skip


def remove_library_temp_dirs() -> list[str]:
    """Remove the ``LIBRARY_TEMP_DIRS`` of the modules this process imported (a library that moved
    them is passed over); the directories removed."""
    import tempfile

    gone = []
    for module, path in LIBRARY_TEMP_DIRS:
        obj: Any = sys.modules.get(module)
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, tempfile.TemporaryDirectory):
            gone.append(obj.name)
            obj.cleanup()
    return gone


def _exit(code: int) -> None:
    """Leave without interpreter teardown: an engine's scheduler thread (sglang-jax
    single-process mode) makes teardown abort in C++; everything is flushed by now. What
    teardown would have removed from the temp directory is removed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        remove_library_temp_dirs()
    except OSError:
        pass
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
