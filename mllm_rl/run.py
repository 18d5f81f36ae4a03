"""``python -m mllm_rl.run``: run a plan on a backend and record every phase.

Outputs go to ``--run-dir`` (default ``runs/<run_id>``): ``phases.jsonl`` (one record per
phase, the source of truth), ``run.json`` (what was run and which phases to expect), a
W&B offline run under ``wandb/`` unless ``--wandb disabled``. Phase records are also
printed to stdout, one ``phase {...}`` line each.

Exit codes: 0 ok; 2 bad input (one line on stderr, nothing started); 3 an engine's weights
differ from what was sent; 128+N killed by signal N (SIGTERM: 143) after closing the sinks.
"""

from __future__ import annotations

import _thread
import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from mllm_rl.presets import PRESETS

# Nothing imported at module level may start a thread (numpy's OpenBLAS pool does):
# ``install_sigterm`` must run while the main thread is the only one.


class Terminated(SystemExit):
    """Raised in the main thread by the SIGTERM handler so ``finally`` blocks run.

    A ``SystemExit``: event loops (the engine's asyncio loop) swallow other exceptions
    raised in their callbacks but let this one through.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def install_sigterm() -> None:
    """Turn SIGTERM into ``Terminated`` in the main thread, whoever loads later.

    jaxlib's absl failure handler takes SIGTERM over (lazily, when XLA starts) and aborts
    the process (exit -6) with the W&B run unfinished. So SIGTERM is blocked in this thread
    before any other thread exists (threads inherit the mask, XLA's included), a waiter
    thread takes it with ``sigwait`` and raises it in the main thread through Python's own
    handler table, which no C library touches.
    """

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    def wait() -> None:
        signal.sigwait({signal.SIGTERM})
        _thread.interrupt_main(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=wait, name="mllm_rl-sigterm", daemon=True).start()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mllm_rl.run",
        description="Run a plan (swap: dummy-init engine + streamed weight swap) with every phase recorded.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--backend", required=True, help="backend name (entry point group mllm_rl.backends): jax, torch")
    ap.add_argument("--plan", default="swap", choices=["swap"], help="what to run")
    ap.add_argument("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}), checkpoint dir, or hub id")
    ap.add_argument("--seed", type=int, default=0, help="seed for preset checkpoints and sampling")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the rollout engine")
    ap.add_argument("--platform", default="auto", choices=["auto", "cpu", "gpu", "tpu", "cuda"],
                    help="assert the accelerator platform (auto: accept what the runtime finds)")
    ap.add_argument("--swap-mode", default="streaming", choices=["streaming", "naive"],
                    help="streaming: one tensor at a time; naive: load all, then replace (baseline)")
    ap.add_argument("--swap-chunk-mb", type=float, default=64.0,
                    help="streaming: tensors larger than this are written into the engine buffer in chunks "
                         "of this size (peak = one copy + one chunk); 0 = whole tensors")
    ap.add_argument("--prompt", action="append", help="prompt for generate_result (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="engine KV cache size in tokens")
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--wandb", default="offline", choices=["disabled", "offline", "online"])
    ap.add_argument("--wandb-project", default="mllm_rl")
    ap.add_argument("--run-id", default=None, help="default: <plan>-<backend>-<time>-<rand>")
    ap.add_argument("--run-dir", default=None, help="default: runs/<run_id>")
    ap.add_argument("--quiet", action="store_true", help="do not print phase records to stdout")
    return ap


def phase_file_name(process_index: int) -> str:
    """``phases.jsonl`` for process 0, ``phases.p<i>.jsonl`` for the others (one file each)."""
    return "phases.jsonl" if process_index == 0 else f"phases.p{process_index}.jsonl"


def write_run_json(run_dir: Path, plan: dict[str, Any]) -> None:
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(plan, indent=2))
    os.replace(tmp, run_dir / "run.json")


def _validate(args: argparse.Namespace) -> None:
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if args.swap_chunk_mb < 0:
        raise ValueError(f"--swap-chunk-mb must be >= 0, got {args.swap_chunk_mb}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.active_count() == 1:
        install_sigterm()
    from mllm_rl.checkpoint.model_dir import CheckpointError
    from mllm_rl.engine import WeightMismatch
    from mllm_rl.phases.recorder import PhaseRecorder
    from mllm_rl.sinks.console import ConsoleSink
    from mllm_rl.sinks.jsonl import JsonlSink

    try:
        _validate(args)
        from mllm_rl.backend_registry import load_backend
        from mllm_rl.checkpoint.resolve import resolve_model

        backend = load_backend(args.backend)
        model = resolve_model(args.model, seed=args.seed)  # validated before any engine starts
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # Multi-process runs (multi-host TPU slices; jax.distributed): every process records its
    # own phases; process 0 writes run.json.
    init_distributed = getattr(backend, "init_distributed", None)
    procs = init_distributed(tp=args.tp) if init_distributed else {"process_index": 0, "process_count": 1}
    pidx, pcount = int(procs["process_index"]), int(procs["process_count"])
    run_id = args.run_id or f"{args.plan}-{args.backend}-{time.strftime('%y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    run_dir = Path(args.run_dir or Path("runs") / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[Any] = [JsonlSink(run_dir / phase_file_name(pidx))]
    if not args.quiet:
        sinks.append(ConsoleSink())
    rec = PhaseRecorder(run_id, backend.name, sinks=sinks, process_index=pidx)

    from mllm_rl.plans.swap import SwapOptions, expected_phases, run_swap

    if pidx == 0:
        write_run_json(run_dir, {
            "run_id": run_id,
            "backend": backend.name,
            "plan": args.plan,
            "model": str(model.path),
            "steps": 0,
            "process_count": pcount,
            "expected_phases": expected_phases(backend),
            "expected_step_phases": [],
            "argv": sys.argv[1:] if argv is None else argv,
        })  # fmt: skip

    def make_wandb():
        if args.wandb == "disabled":
            return None
        from mllm_rl.sinks.wandb_sink import WandbSink

        return WandbSink(args.wandb, run_dir, run_id, project=args.wandb_project,
                         config={k: v for k, v in vars(args).items() if k != "prompt"})

    engines: list[Any] = []
    code = 0
    try:
        opts = SwapOptions(
            tp=args.tp,
            platform="gpu" if args.platform == "cuda" else args.platform,
            mode=args.swap_mode,
            prompts=tuple(args.prompt) if args.prompt else SwapOptions.prompts,
            max_new_tokens=args.max_new_tokens,
            engine_kwargs={"max_total_tokens": args.max_total_tokens, "context_length": args.context_length,
                           "seed": args.seed,
                           "chunk_bytes": int(args.swap_chunk_mb * 2**20)},
        )
        run_swap(backend, rec, model, opts, make_wandb, on_engine=engines.append)
    except Terminated as e:
        code = 128 + e.signum
        print(f"terminated by signal {e.signum}; phase log closed", file=sys.stderr)
    except WeightMismatch as e:
        code = 3
        print(f"error: {e}", file=sys.stderr)
    except (CheckpointError, ValueError) as e:
        code = 2
        print(f"error: {e}", file=sys.stderr)
    except RuntimeError as e:  # platform assertion, engine adapter probes
        code = 1
        print(f"error: {e}", file=sys.stderr)
    finally:
        rec.close(code)  # W&B finished and torn down before the engine kills child processes
        for engine in engines:
            engine.shutdown()
    if rec.records:
        from mllm_rl.summary import phase_table

        print(phase_table(rec.records), file=sys.stderr)
        gen = rec.records[-1]["info"]
        if rec.records[-1]["phase"] == "generate_result" and "text" in gen:
            for prompt, text in zip(gen["prompts"], gen["text"], strict=True):
                print(f"generate: {prompt!r} -> {text!r}", file=sys.stderr)
    print(f"run_dir {run_dir}", file=sys.stderr)
    return code


def _exit(code: int) -> None:
    """Leave without interpreter teardown: an engine's scheduler thread (sglang-jax
    single-process mode) makes teardown abort in C++; everything is flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
