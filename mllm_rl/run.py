"""``python -m mllm_rl.run``: run a plan on a backend and record every phase.

Plans: ``rl`` (default; GRPO-style colocated RL with the full memory lifecycle,
``mllm_rl.plans.rl``) and ``swap`` (dummy-init engine + streamed weight swap,
``mllm_rl.plans.swap``).

Outputs go to ``--run-dir`` (default ``runs/<run_id>``): ``phases.jsonl`` (one record per
phase, the source of truth; ``phases.p<i>.jsonl`` for process i > 0), ``run.json`` (what was
run and which phases to expect), ``metrics.jsonl`` (RL metrics, one line per step),
``checkpoints/`` (RL), a W&B offline run under ``wandb/`` unless ``--wandb disabled``.

Exit codes (``EXIT_CODES``, also in ``--help``): 0 ok; 1 runtime error; 2 bad input (one line on
stderr, nothing started: every check that can run before start-up runs before the run directory,
W&B or an engine is touched; ``docs/ERRORS.md`` lists them); 3 an engine's weights differ from what
was sent (update that did not land, garbage guard); 4 a lifecycle invariant broke; 5 a train step's
loss or grad norm is not finite; 6 a phase ran past its ``--phase-timeout`` (stuck; every thread's
stack in the run directory); 128+N killed by signal N (SIGTERM: 143) after closing the sinks.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any, NoReturn

from mllm_rl.presets import PRESETS
from mllm_rl.run_files import phase_file_name, write_run_json
from mllm_rl.signals import Terminated, install_sigterm

EXIT_CODES = {
    0: "ok",
    1: "runtime error",
    2: "bad input: one line on stderr, nothing started (no run directory, W&B run or engine); docs/ERRORS.md",
    3: "an engine's weights differ from what was sent (fingerprint) or from the trainer's (garbage guard)",
    4: "a lifecycle invariant broke",
    5: "a train step's loss or grad norm is not finite (stopped before its checkpoint and update)",
    6: "a phase ran past its --phase-timeout (stuck): every thread's stack is in the run directory",
    143: "SIGTERM (128 + signal), after the phase log and the W&B run were closed",
}
# Nothing imported at module level may start a thread (numpy's OpenBLAS pool does):
# ``install_sigterm`` must run while the main thread is the only one.


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2): ``error: argument --tp: invalid int value: 'x'``."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default once: appended unless the help already says it, or there is none to say
    (``None``, a switch's ``False``, a required flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        none = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.required or none or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at module level: they import numpy, whose thread pool must start
    # after ``install_sigterm`` blocked SIGTERM (see there).
    from mllm_rl.lifecycle import SCHEDULES
    from mllm_rl.phases.watchdog import DEFAULT_LIMIT_S, LIGHT_FACTOR
    from mllm_rl.plans.registry import DEFAULT_PLAN, all_plans, plan_names
    from mllm_rl.rl.advantages import ESTIMATORS, STDS
    from mllm_rl.rl.loss_config import AGGREGATIONS
    from mllm_rl.rl.old_logp import SOURCES as OLD_LOGP_SOURCES
    from mllm_rl.tasks.base import TASKS
    from mllm_rl.trainer import PRECISIONS

    codes = "\n".join(f"  {code:>3}  {what}" for code, what in EXIT_CODES.items())
    ap = _Parser(
        prog="python -m mllm_rl.run",
        description="Run a plan (rl: colocated GRPO with every memory phase recorded; swap: dummy-init "
        "engine + streamed weight swap).",
        epilog=f"exit codes:\n{codes}",
        formatter_class=_HelpFormatter,
    )
    ap.add_argument(
        "--backend", required=True, help="backend name (entry point group mllm_rl.backends): jax, torch"
    )
    ap.add_argument("--plan", default=DEFAULT_PLAN, choices=plan_names(),
                    help="what to run: " + "; ".join(f"{p.name}: {p.summary}" for p in all_plans()))  # fmt: skip
    ap.add_argument("--tasks", default=None, help="TOML file of several RL tasks sharing the devices "
                    "(docs/MULTITASK.md); per-task settings then come from the file")  # fmt: skip
    ap.add_argument(
        "--fail-fast", action="store_true", help="--tasks: stop the whole run when one task fails"
    )
    ap.add_argument(
        "--model", default="tiny", help=f"preset ({', '.join(PRESETS)}), checkpoint dir, or hub id"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed for preset checkpoints, data and sampling")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the rollout engine")
    ap.add_argument(
        "--platform",
        default="auto",
        choices=["auto", "cpu", "gpu", "tpu", "cuda"],
        help="assert the accelerator platform (auto: accept what the runtime finds)",
    )
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens per completion (default: 8 for rl, 16 for swap)",
    )
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="engine KV cache size in tokens (default: swap 4096; rl max-running-requests x context)",
    )
    ap.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="engine context length (default: swap 512; rl: fits the task's prompts + completions)",
    )
    ap.add_argument("--max-running-requests", type=int, default=128, help="engine batch limit (requests)")
    ap.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "embedded", "sglang"],
        help="rollout engine; torch: auto (SGLang when importable on CUDA, else embedded), embedded, "
        "sglang; jax: auto only (sglang-jax)",
    )
    ap.add_argument(
        "--weights-cpu-backup",
        action="store_true",
        help="engine keeps a host copy of its weights across release/resume (else: full re-sync)",
    )
    ap.add_argument(
        "--phase-timeout",
        action="append",
        metavar="[PHASE=]SECONDS",
        help=f"watchdog: a phase still running after its limit is recorded as stuck, every thread's "
        f"stack goes to the run dir, and the run exits 6. SECONDS sets the limit of the phases that "
        f"compute or move a model (rollout, train_step, engine start, ...; the others get "
        f"{LIGHT_FACTOR:g}x it), PHASE=SECONDS one phase's; repeatable; 0 = no limit "
        f"(default: {DEFAULT_LIMIT_S:g})",
    )
    out = ap.add_argument_group("outputs")
    out.add_argument("--wandb", default="offline", choices=["disabled", "offline", "online"], help="W&B mode")
    out.add_argument("--wandb-project", default="mllm_rl", help="W&B project")
    out.add_argument("--run-id", default=None, help="default: <plan>-<backend>-<time>-<rand>")
    out.add_argument("--run-dir", default=None, help="default: runs/<run_id>")
    out.add_argument(
        "--console",
        default="compact",
        choices=["compact", "full", "off"],
        help="phase records on stdout: one short line each, the full JSON, or nothing",
    )
    out.add_argument("--quiet", action="store_true", help="print only errors (implies --console off)")
    sw = ap.add_argument_group("swap plan")
    sw.add_argument(
        "--swap-mode",
        default="streaming",
        choices=["streaming", "naive"],
        help="streaming: one tensor at a time; naive: load all, then replace (baseline)",
    )
    sw.add_argument(
        "--swap-chunk-mb",
        type=float,
        default=64.0,
        help="streaming: tensors larger than this are written into the engine buffer in chunks "
        "of this size (peak = one copy + one chunk); 0 = whole tensors",
    )
    sw.add_argument(
        "--prompt",
        action="append",
        help="prompt for generate_result (repeatable; default: two built-in prompts)",
    )
    rl = ap.add_argument_group("rl plan")
    rl.add_argument("--steps", type=int, default=20, help="RL steps")
    rl.add_argument(
        "--task",
        default="pattern",
        choices=list(TASKS),
        help="pattern: shipped periodic-string completion (learnable from scratch); "
        "boxed: GSM8K-style \\boxed{} answers from --task-data",
    )
    rl.add_argument(
        "--task-data",
        default=None,
        help="JSONL of {question, answer} for --task boxed (default: a shipped sample)",
    )
    rl.add_argument("--prompts-per-step", type=int, default=16, help="prompts per RL step")
    rl.add_argument("--group-size", type=int, default=8, help="completions per prompt (GRPO group, >= 2)")
    rl.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature of the rollout (> 0); the trainer's log-probs use the same (logits / T)",
    )
    rl.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of the rollout")
    rl.add_argument("--estimator", default="grpo", choices=list(ESTIMATORS), help="advantage estimator")
    rl.add_argument(
        "--adv-std",
        default="unbiased",
        choices=list(STDS),
        help="grpo: the group std (unbiased: n - 1, as verl and TRL; biased: n)",
    )
    rl.add_argument(
        "--lr",
        type=float,
        default=None,
        help="AdamW learning rate. Default: 3e-3 for the tiny preset (trained from random init), "
        "1e-6 for every other model (a pretrained checkpoint: fine-tuning, verl's default)",
    )
    rl.add_argument(
        "--precision",
        default="mixed",
        choices=list(PRECISIONS),
        help="mixed: a bf16/fp16 checkpoint trains float32 master weights with float32 AdamW moments, "
        "computes in bf16/fp16, the engine gets casts; pure: params and moments in the checkpoint dtype "
        "(half the state; Adam steps below half a bf16 ulp are lost: little or no learning at lr ~1e-6)",
    )
    rl.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    rl.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clip; 0 = off")
    rl.add_argument("--mini-batches", type=int, default=1, help="optimizer updates per step")
    rl.add_argument("--micro-batch-size", type=int, default=64, help="sequences per forward/backward")
    rl.add_argument("--eps-low", type=float, default=0.2, help="PPO clip range below 1")
    rl.add_argument("--eps-high", type=float, default=0.28, help="PPO clip range above 1 (clip-higher)")
    rl.add_argument(
        "--clip-ratio-c",
        type=float,
        default=3.0,
        help="dual-clip: for negative advantages the loss is capped at -A * c (verl's clip_ratio_c); 0 = off",
    )
    rl.add_argument("--kl-beta", type=float, default=0.0, help="KL-to-reference weight in the loss (k3)")
    rl.add_argument(
        "--old-logp",
        default="trainer",
        choices=list(OLD_LOGP_SOURCES),
        help="old log-probs of the PPO ratio: recomputed by the trainer before the update (verl's default; "
        "the engine/trainer mismatch is reported) or the engine's rollout log-probs",
    )
    rl.add_argument(
        "--tis-cap",
        type=float,
        default=0.0,
        help="truncated importance sampling: weigh each token by min(exp(logp_trainer - logp_engine), C) "
        "(needs --old-logp trainer); 0 = off",
    )
    rl.add_argument("--loss-agg", default="token_mean", choices=list(AGGREGATIONS), help="loss aggregation")
    rl.add_argument("--lora-rank", type=int, default=0, help="> 0: train LoRA adapters, base frozen")
    rl.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scale numerator (alpha / rank)")
    rl.add_argument(
        "--schedule",
        default="multi_stage",
        choices=list(SCHEDULES),
        help="multi_stage: resume weights, update, free trainer, then resume KV; naive: baseline",
    )
    rl.add_argument(
        "--check-weights",
        action="store_true",
        help="garbage guard: engine greedy probe after each update must match the trainer's",
    )
    rl.add_argument(
        "--checkpoint-every",
        "--save-every",
        dest="checkpoint_every",
        type=int,
        default=5,
        help="checkpoint every N steps, and always the last step; 0 = never",
    )
    rl.add_argument(
        "--checkpoint-background",
        action="store_true",
        help="torch: copy the state to host memory in the checkpoint phase and write it in the background "
        "(it counts once written; costs host memory the size of the state). Default: write in the phase",
    )
    rl.add_argument(
        "--resume",
        action="store_true",
        help="continue --run-dir/--run-id from its newest valid checkpoint (appends to its phase log); "
        "a run with nothing to resume is refused",
    )
    rl.add_argument(
        "--resume-or-start",
        action="store_true",
        help="like --resume, but a run directory without checkpoints (or none at all) starts from step 0",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    if threading.active_count() == 1:
        install_sigterm()
    args = build_parser().parse_args(argv)
    if args.tasks:
        from mllm_rl import multitask

        return multitask.main(args, argv)
    from mllm_rl.checkpoint.model_dir import CheckpointError
    from mllm_rl.engine import WeightMismatch
    from mllm_rl.lifecycle import LifecycleError, NonFiniteTraining
    from mllm_rl.phases.recorder import PhaseRecorder
    from mllm_rl.phases.watchdog import STUCK_EXIT, PhaseStuck, Watchdog
    from mllm_rl.plans.base import PlanRun
    from mllm_rl.plans.preflight import check_fresh, prepare
    from mllm_rl.report.at_exit import report_at_exit
    from mllm_rl.sinks.console import ConsoleSink
    from mllm_rl.sinks.jsonl import JsonlSink, MetricsJsonlSink, count_records

    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    try:
        pre = prepare(args)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    backend, model, opts, run_dir, run_id = pre.backend, pre.model, pre.opts, pre.run_dir, pre.run_id

    # Multi-process runs (multi-host TPU slices; jax.distributed): every process records its
    # own phases; process 0 writes run.json. Then the runtime comes up and the engine options are
    # checked against its devices -- all before the run directory exists.
    try:
        tp = opts.engine.tp
        procs = backend.init_distributed(tp=tp)
        pidx, pcount = int(procs["process_index"]), int(procs["process_count"])
        phase_file = run_dir / phase_file_name(pidx)
        if not (args.resume or args.resume_or_start):
            check_fresh(run_dir, phase_file.name)
        t0 = time.perf_counter()
        runtime = backend.init_runtime(tp=tp, platform=opts.platform)
        runtime["init_s"] = round(time.perf_counter() - t0, 3)
        backend.check_engine_args(model, opts.engine)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # the backend's framework is not in this environment
        print(f"error: --backend {args.backend}: {e} (install the '{args.backend}' extra)", file=sys.stderr)
        return 2
    except RuntimeError as e:  # no platform as asserted, processes that could not meet
        print(f"error: {e}", file=sys.stderr)
        return 1

    run_dir.mkdir(parents=True, exist_ok=True)
    for line in pre.notes:
        say(line)
    sinks: list[Any] = [
        JsonlSink(phase_file),
        MetricsJsonlSink(run_dir / phase_file.name.replace("phases", "metrics")),
    ]
    console = "off" if args.quiet else args.console
    if console != "off":
        sinks.append(ConsoleSink(compact=console == "compact"))
    start_idx = count_records(phase_file) if (args.resume or args.resume_or_start) else 0
    rec = PhaseRecorder(run_id, backend.name, sinks=sinks, process_index=pidx, start_idx=start_idx)

    plan_info = pre.plan.run_json(backend, opts)

    def write_plan() -> None:
        if pidx == 0:
            write_run_json(run_dir, {
                "run_id": run_id, "backend": backend.name, "plan": args.plan, "model": str(model.path),
                "process_count": pcount, **plan_info, "argv": sys.argv[1:] if argv is None else argv,
            })  # fmt: skip

    if not pre.resuming:
        write_plan()  # a resumed attempt rewrites the run's run.json only once it has started (on_started)

    def make_wandb():
        if args.wandb == "disabled":
            return None
        from mllm_rl.sinks.wandb_sink import WandbSink

        wid = run_id if pidx == 0 else f"{run_id}-p{pidx}"
        return WandbSink(args.wandb, run_dir, wid, project=args.wandb_project,
                         resume=args.resume or args.resume_or_start,
                         config={k: v for k, v in vars(args).items() if k != "prompt"})  # fmt: skip

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
        ctx = PlanRun(backend, rec, model, make_wandb, run_dir, runtime, on_engine=engines.append,
                      on_started=write_plan if pre.resuming else lambda: None)  # fmt: skip
        result = pre.plan.run(ctx, opts)
    except Terminated as e:
        code, error = 128 + e.signum, f"terminated by signal {e.signum}; phase log closed"
    except PhaseStuck as e:
        code, error = STUCK_EXIT, f"error: {e}"
    except NonFiniteTraining as e:
        code, error = 5, f"error: {e}"
    except WeightMismatch as e:
        code, error = 3, f"error: {e}"
    except LifecycleError as e:
        code, error = 4, f"error: {e}"
    except (CheckpointError, ValueError) as e:
        code, error = 2, f"error: {e}"
    except RuntimeError as e:  # engine adapter probes, refused operations
        code, error = 1, f"error: {type(e).__name__}: {e}"
    finally:
        if pidx == 0:
            report_at_exit(run_dir, rec, quiet=args.quiet)
        rec.close(code)  # W&B finished and torn down before the engine kills child processes
        for engine in engines:
            engine.shutdown()
        backend.shutdown_distributed()  # all processes leave jax.distributed together (else the others abort)
        watchdog.finish()
    if not args.quiet:
        _print_summary(rec.records, result)
        print(f"run_dir {run_dir}", file=sys.stderr)
    if error is not None:
        print(error, file=sys.stderr)  # last: the line that says why the run failed
    return code


def _print_summary(records: list[dict[str, Any]], result: dict[str, Any]) -> None:
    if not records:
        return
    from mllm_rl.summary import phase_table, step_table

    print(phase_table([r for r in records if r.get("step") is None]), file=sys.stderr)
    stepped = [r for r in records if r.get("step") is not None]
    if stepped:
        print(step_table(stepped), file=sys.stderr)
    for h in result.get("history", []):
        print(f"step {h['step']:>3}: reward_mean {h['reward_mean']:.3f}  loss {h.get('loss', float('nan')):.4f}",
              file=sys.stderr)  # fmt: skip
    gen = records[-1]["info"]
    if records[-1]["phase"] == "generate_result" and "text" in gen:
        for prompt, text in list(zip(gen["prompts"], gen["text"], strict=True))[:4]:
            print(f"generate: {prompt!r} -> {text!r}", file=sys.stderr)
        if "greedy_reward_mean" in gen:
            print(f"greedy reward on {len(gen['prompts'])} held-out prompts: {gen['greedy_reward_mean']:.3f}",
                  file=sys.stderr)  # fmt: skip


def _exit(code: int) -> None:
    """Leave without interpreter teardown: an engine's scheduler thread (sglang-jax
    single-process mode) makes teardown abort in C++; everything is flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
