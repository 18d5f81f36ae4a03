"""``python -m mllm_rl.launch --nproc N -- <arguments of python -m mllm_rl.run>``: N processes of one
run on this machine (CPU tests, one multi-GPU node).

Each process gets the environment of a multi-process run for both backends (JAX's
MLLM_RL_COORDINATOR/NUM_PROCESSES/PROCESS_ID, torchrun's MASTER_ADDR/PORT, WORLD_SIZE, RANK,
LOCAL_RANK, LOCAL_WORLD_SIZE) and OMP_NUM_THREADS = cores // N unless set. Output is prefixed
[p<i>]. When one process fails the others get SIGTERM, then SIGKILL after --grace-s; the
launcher exits with the first failure's code (128 + the signal when it is itself signalled).
The run's flags are checked once before any process starts (exit 2); --backend jax without --tp
gets --tp = N x the devices of a process. Multi-host TPU: tpu/tpu.sh; GPU node: torchrun.

OMP_NUM_THREADS: N processes each spinning one OpenMP thread per core stall a torch CPU step."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from mllm_rl.run import OneLineParser, check_mode, parse_args

EXIT_BAD_INPUT = 2
RUN_MODULE = "mllm_rl.run"
REFUSAL_WAIT_S = 10.0  # after one process refuses its input (exit 2), how long the others get to do the same


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def coordinator_port() -> int:
    """A free port P with P+1..P+7 free too: the JAX backend's engine ports default to the
    coordinator's + 1, and sglang-jax's request broadcast binds that port + 5 and + 6."""
    for _ in range(100):
        port = free_port()
        if port + 7 < 65536 and all(_bindable(port + k) for k in range(1, 8)):
            return port
    raise RuntimeError("no 8 consecutive free ports for the coordinator")


def process_env(rank: int, nproc: int, coord_port: int, torch_port: int) -> dict[str, str]:
    """The variables process ``rank`` of ``nproc`` reads to find the others (both backends')."""
    return {
        "MLLM_RL_COORDINATOR": f"127.0.0.1:{coord_port}",
        "MLLM_RL_NUM_PROCESSES": str(nproc),
        "MLLM_RL_PROCESS_ID": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(torch_port),
        "WORLD_SIZE": str(nproc),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc),
    }


def threads_per_process(nproc: int, env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": cores // nproc}`` (at least 1) unless ``env`` sets it (then nothing)."""
    if env.get("OMP_NUM_THREADS"):
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}


def _pump(stream: IO[str], prefix: str, out: IO[str], lock: threading.Lock, errors: set[str]) -> None:
    """Copy ``stream`` to ``out`` line by line with ``prefix``; an ``error:`` line already in
    ``errors`` (another process printed it) is left out."""
    for line in stream:
        text = line if line.endswith("\n") else line + "\n"
        with lock:
            if text.startswith("error: "):
                if text in errors:
                    continue
                errors.add(text)
            out.write(prefix + text)
            out.flush()


def devices_per_process(env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The (fake CPU) devices each JAX process has: ``XLA_FLAGS``' forced count, else 1."""
    for flag in env.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_force_host_platform_device_count" and value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def check_run_args(rest: list[str], nproc: int) -> list[str]:
    """``rest`` checked by the run's parser (exit 2), with ``--tp`` added for a multi-process JAX
    run without it: the engine's mesh spans every process's devices."""
    args, given = parse_args(rest)  # exits 2 with the run's one line
    try:
        check_mode(args, given)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    resuming = args.resume or args.resume_or_start  # a resume takes the --tp that run.json recorded
    if nproc > 1 and args.backend == "jax" and "tp" not in given and not resuming:
        with_tp = [*rest, "--tp", str(nproc * devices_per_process())]
        try:
            check_mode(*parse_args(with_tp))
        except ValueError:  # a mode that does not take --tp: as it is
            return rest
        return with_tp
    return rest


def exit_code(returncode: int) -> int:
    """A child's exit code as a shell says it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="python -m mllm_rl.launch",
        usage="%(prog)s --nproc N [options] -- <arguments of python -m mllm_rl.run>",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    ap.add_argument("--nproc", type=int, required=True, help="processes to start on this machine (>= 1)")
    ap.add_argument(
        "--module", default=RUN_MODULE, help="the module every process runs (default: mllm_rl.run)"
    )
    ap.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="seconds between SIGTERM and SIGKILL when stopping the others (default: 30)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])  # --help: the launcher's help, exit 0
    if cut == len(argv):
        build_parser().error("no run arguments: put them after -- (e.g. -- --backend jax --steps 2)")
    rest = argv[cut + 1 :]
    if args.nproc < 1:
        build_parser().error(f"--nproc must be >= 1, got {args.nproc}")
    if not args.grace_s >= 0:
        build_parser().error(f"--grace-s must be >= 0, got {args.grace_s}")
    if args.module == RUN_MODULE:
        rest = check_run_args(rest, args.nproc)
    stopping: list[int] = []  # the signal that stops the launcher, if any
    for sig in (signal.SIGTERM, signal.SIGINT):  # before any process starts: none is left behind
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    coord = coordinator_port()
    torch_port = free_port()
    lock = threading.Lock()
    errors: set[str] = set()
    procs: list[subprocess.Popen[str]] = []
    pumps: list[threading.Thread] = []
    for rank in range(args.nproc):
        env = {**os.environ, **threads_per_process(args.nproc), **process_env(rank, args.nproc, coord, torch_port),
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        p = subprocess.Popen(
            [sys.executable, "-m", args.module, *rest],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, f"[p{rank}] ", out, lock, errors), daemon=True)
            t.start()
            pumps.append(t)
    first_failure: int | None = None
    refused_at: float | None = None
    while [p.poll() for p in procs].count(None):  # poll every process (any() would stop at the first)
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed and not stopping and all(p.returncode in (None, EXIT_BAD_INPUT) for p in procs):
            # a refusal of the input: the others refuse it too, on their own (then: one line, no more)
            refused_at = refused_at or time.monotonic()
            if time.monotonic() - refused_at < REFUSAL_WAIT_S:
                time.sleep(0.05)
                continue
        if failed or stopping:
            if failed and first_failure is None:
                first_failure = exit_code(failed[0].returncode)
                rank = procs.index(failed[0])
                print(f"launch: process {rank} exited {first_failure}; stopping the others", file=sys.stderr)
            _stop(procs, args.grace_s)
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    for t in pumps:
        t.join(timeout=5)
    if stopping and first_failure is None:  # stopped before any process failed: the launcher's signal
        return 128 + stopping[0]
    codes = [exit_code(p.returncode) for p in procs]
    return first_failure if first_failure is not None else next((c for c in codes if c != 0), 0)


def _stop(procs: list[subprocess.Popen[str]], grace_s: float) -> None:
    """SIGTERM to every process's session (an exited process's children too: no orphans),
    SIGKILL after ``grace_s`` to every session that still has a process."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        _signal_group(p, signal.SIGKILL)


def _signal_group(p: subprocess.Popen[str], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)


if __name__ == "__main__":
    sys.exit(main())
