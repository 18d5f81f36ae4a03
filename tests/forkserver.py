"""A fork server for the suite's ``python -m mllm_rl.run`` subprocesses (``conftest.run_cli``).

A whole run spends seconds importing jax, flax, orbax, sglang-jax, torch and transformers before
its first phase; the suite starts about a hundred of them. The server imports those once (nothing
more: no backend is initialised, no thread started, no ``mllm_rl`` module loaded) and forks a
child per run, which then does exactly what ``python -m`` does: the module runs as ``__main__``
with the run's argv, environment and working directory, stdout and stderr to files, and the exit
status is the interpreter's (``SystemExit`` code, 1 and a traceback for an uncaught exception,
``-N`` for a signal). Modules read some variables when imported (``JAX_PLATFORMS``,
``OMP_NUM_THREADS``, ...), so there is one server per import environment: the environment but the
variables nothing preloaded reads at import (``FORKABLE_ENV``). ``MLLM_RL_TESTS_FORK=0`` turns it
off (every run a fresh process).

Protocol (JSON lines): request ``{"id", "module", "args", "env", "cwd", "out", "err", "fsize"}`` (``fsize``:
the child's ``RLIMIT_FSIZE`` soft limit in bytes, or null) on the
server's stdin; replies ``{"id", "pid"}`` once forked and ``{"id", "status", "cpu"}`` once it exited
(``cpu``: its user + system seconds, which ``forked_cpu_seconds`` sums for the suite's CPU per test)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

PRELOAD = (  # what a whole run imports that costs seconds; those missing from a venv are skipped
    "numpy", "jax", "flax.nnx", "optax", "orbax.checkpoint", "sgl_jax.srt.entrypoints.engine",
    "sgl_jax.srt.models.qwen3", "torch", "torch._dynamo", "transformers",
    "transformers.models.auto.tokenization_auto",
)  # fmt: skip
# read after import only: NETRC (at a login), TPU_* and ALLOW_MULTIPLE_LIBTPU_LOAD (libtpu, when a
# backend starts; the planner sets them in a test's process); TF_CPP_MIN_LOG_LEVEL is the 1 that
# ``import jax`` sets in the server as in any test process that imported jax
FORKABLE_ENV = ("MLLM_RL_", "WANDB_", "BYO_", "PYTEST_", "PYTHONUNBUFFERED", "XLA_FLAGS",
                "XLA_PYTHON_CLIENT_PREALLOCATE", "NETRC", "TPU_", "ALLOW_MULTIPLE_LIBTPU_LOAD",
                "TF_CPP_MIN_LOG_LEVEL")  # fmt: skip


# -- the server (its own process) ------------------------------------------------------------------


_PROTO: list[int] = []  # the server's reply pipe (a copy of its fd 1), closed in each child


def _serve() -> None:
    import importlib

    # replies go to a copy of fd 1; fd 1 itself goes to stderr, so a preloaded module that prints
    # at import cannot break the protocol
    out = os.fdopen(os.dup(1), "w")
    _PROTO.append(out.fileno())
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    extra = [m for m in os.environ.get("MLLM_RL_TESTS_PRELOAD", "").split(",") if m]  # the suite's own test
    base = PRELOAD if os.environ.get("MLLM_RL_TESTS_PRELOAD_BASE", "1") != "0" else ()  # 0: its own tests
    for name in (*base, *extra):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    running: dict[int, Any] = {}
    stdin = sys.stdin.fileno()
    buf = b""
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        if readable:
            chunk = os.read(stdin, 1 << 16)
            if not chunk:
                return  # the suite ended
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)  # never returns
                running[pid] = req["id"]
                print(json.dumps({"id": req["id"], "pid": pid}), file=out, flush=True)
        while running:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            rid = running.pop(pid, None)
            if rid is not None:
                cpu = usage.ru_utime + usage.ru_stime  # the child's and its waited-for children's
                reply = {"id": rid, "status": os.waitstatus_to_exitcode(status), "cpu": cpu}
                print(json.dumps(reply), file=out, flush=True)


def limit_file_size(nbytes: int) -> None:
    """Set this process's ``RLIMIT_FSIZE`` soft limit (a write past it fails with EFBIG)."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _child(req: dict[str, Any]) -> None:
    """``python -m module args`` in this forked process; exits with its status."""
    import atexit
    import io
    import random
    import runpy
    import traceback

    code = 1
    try:
        for fd in _PROTO:
            os.close(fd)
        os.chdir(req["cwd"])
        if req.get("fsize") is not None:
            limit_file_size(req["fsize"])
        os.environ.clear()
        os.environ.update(req["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.close(null)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", write_through=True)  # fmt: skip
        sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
        sys.path[0] = os.getcwd()  # as ``python -m`` sets it
        random.seed()  # a fresh process draws its own seed
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = [req["module"], *req["args"]]
        try:
            runpy._run_module_as_main(req["module"], alter_argv=True)  # what ``python -m`` calls
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # the interpreter's exit: non-daemon threads, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# -- the client (the test process) -----------------------------------------------------------------


class ForkedProcess:
    """A run forked by the server, used as a ``subprocess.Popen`` with text pipes is: ``pid``,
    ``poll``, ``wait``, ``communicate`` (its stdout and stderr, once it ended), ``send_signal``,
    ``kill``, ``returncode``, ``args``."""

    def __init__(
        self, server: ForkServer, rid: int, args: list[str], tmp: tempfile.TemporaryDirectory
    ) -> None:
        self._server, self._rid, self.args, self._tmp = server, rid, args, tmp
        self.returncode: int | None = None
        self._output: tuple[str, str] | None = None
        self.pid: int = server.reply(rid, "pid", 60)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self._rid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._server.done(self._rid).wait(timeout):
            return self.poll()
        raise subprocess.TimeoutExpired(self.args, timeout)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._output is None:
            d = Path(self._tmp.name)
            self._output = ((d / "out").read_text(errors="replace"), (d / "err").read_text(errors="replace"))
            self._tmp.cleanup()
        return self._output

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)


class ForkServer:
    """The server process for one import environment (``env`` but its ``FORKABLE_ENV`` variables)
    of this interpreter, started on first use, ended with the session."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parents[1], env=env)  # fmt: skip
        try:
            ready = json.loads(self.proc.stdout.readline() or b"{}")
            if "ready" not in ready:
                raise RuntimeError("fork server did not start")
        except (RuntimeError, ValueError):
            self.proc.kill()
            self.proc.wait()
            raise
        self._lock = threading.Lock()
        self._next = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._done: dict[int, threading.Event] = {}
        self._changed = threading.Condition(self._lock)
        threading.Thread(target=self._read, daemon=True, name="forkserver-replies").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._changed:
                self._replies.setdefault(msg["id"], {}).update(msg)
                if "status" in msg:
                    _CPU[0] += msg.get("cpu", 0.0)
                    self._done[msg["id"]].set()
                self._changed.notify_all()

    def reply(self, rid: int, key: str, timeout: float) -> Any:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._replies.get(rid, {}), timeout):
                raise RuntimeError(f"fork server: no {key} for request {rid} within {timeout} s")
            return self._replies[rid][key]

    def status(self, rid: int) -> int | None:
        with self._lock:
            return self._replies.get(rid, {}).get("status")

    def done(self, rid: int) -> threading.Event:
        return self._done[rid]

    def start(
        self, module: str, args: list[str], env: dict[str, str], cwd: Path, fsize: int | None = None
    ) -> ForkedProcess:
        tmp = tempfile.TemporaryDirectory(prefix="mllm-rl-fork-")
        with self._lock:
            rid = self._next = self._next + 1
            self._done[rid] = threading.Event()
            req = {"id": rid, "module": module, "args": args, "env": env, "cwd": str(cwd),
                   "out": f"{tmp.name}/out", "err": f"{tmp.name}/err", "fsize": fsize}  # fmt: skip
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        return ForkedProcess(self, rid, [sys.executable, "-m", module, *args], tmp)

    def run(self, module: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float,
            fsize: int | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        """``subprocess.run(capture_output=True, text=True)`` of ``python -m module args`` as a
        forked child, killed at ``timeout`` (``TimeoutExpired``)."""
        p = self.start(module, args, env, cwd, fsize)
        try:
            out, err = p.communicate(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(60)
            raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def close(self) -> None:
        """End the server (its stdin closed: it returns once idle)."""
        self.proc.stdin.close()
        self.proc.wait(60)


MAX_SERVERS = 3  # per test process: a JAX server holds about half a GiB
_CPU = [0.0]  # CPU seconds of this process's forked children that ended


def forked_cpu_seconds() -> float:
    """User + system seconds of every forked child of this process's servers that has ended."""
    return _CPU[0]


_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def server_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The import environment of ``env``: its variables but the ``FORKABLE_ENV`` ones."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(FORKABLE_ENV)))


def server_for(env: dict[str, str]) -> ForkServer | None:
    """The fork server of ``env``'s import environment (started again if it died); None when
    switched off (``MLLM_RL_TESTS_FORK=0``), off Linux, past ``MAX_SERVERS`` or when it failed to
    start."""
    if env.get("MLLM_RL_TESTS_FORK", "1") == "0" or sys.platform != "linux":
        return None
    key = server_key(env)
    with _servers_lock:
        s = _servers.get(key)
        if s is not None and s.proc.poll() is not None:  # it died (killed from outside): a new one
            del _servers[key]
            s = None
        if s is None and len(_servers) < MAX_SERVERS:
            try:
                s = _servers[key] = ForkServer(env)
            except (OSError, RuntimeError, ValueError):
                return None
        return s


def run(
    module: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float, fsize: int | None = None
) -> subprocess.CompletedProcess | None:
    """``subprocess.run(capture_output=True, text=True)`` of ``python -m module args`` as a forked
    child (killed at ``timeout``: ``TimeoutExpired``; ``fsize``: its ``RLIMIT_FSIZE`` soft limit);
    None when no server takes it."""
    s = server_for(env)
    return None if s is None else s.run(module, args, env, cwd, timeout, fsize)


if __name__ == "__main__":
    _serve()
