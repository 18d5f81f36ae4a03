"""Reward functions by import path, called in a worker process with a timeout (docs/TASKS.md).

``RewardRunner`` runs ``--reward`` in one subprocess per run (``reward_worker``): a call that
raises, returns a non-finite or non-number, exceeds ``timeout`` (per sample, or per batch) or kills
the worker is a ``RewardError`` (exit 1) naming function and sample. ``check_reward`` loads it
before the run starts (exit 2 when it cannot be imported or called as documented)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from mllm_rl.tasks.reward_worker import LoadError, is_file_spec, split_spec

# ``-c``, not ``-m``: the package imports this module (runpy would warn about a second copy)
WORKER_MAIN = "import sys; from mllm_rl.tasks.reward_worker import main; sys.exit(main(sys.argv[1:]))"
LOAD_TIMEOUT_S = 120.0  # importing the reward's module (it may import a large library)
DEFAULT_TIMEOUT_S = 30.0


class RewardError(RuntimeError):
    """A reward call that raised, hung, returned a non-number or NaN, or whose worker died (exit 1)."""


def check_spec(spec: str) -> None:
    """The shape of ``spec`` and, for a file, that it exists (``ValueError`` naming ``--reward``)."""
    try:
        target, _ = split_spec(spec)
    except LoadError as e:
        raise ValueError(f"--reward {e}") from None
    if is_file_spec(target) and not os.path.isfile(os.path.expanduser(target)):
        raise ValueError(f"--reward {spec}: {target}: no such file")


def check_reward(spec: str, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """Load ``spec`` in a worker and stop it: whether it is batched (``ValueError`` naming ``--reward``)."""
    check_spec(spec)
    runner = RewardRunner(spec, timeout)
    try:
        runner.start()
    except RewardError as e:
        raise ValueError(f"--reward {spec}: {e}") from None
    finally:
        runner.close()
    return runner.batched


class RewardRunner:
    """One worker process running one reward function (see the module doc)."""

    def __init__(
        self, spec: str, timeout: float = DEFAULT_TIMEOUT_S, env: dict[str, str] | None = None
    ) -> None:
        self.spec, self.timeout, self.env = spec, float(timeout), dict(env or {})
        self.batched = False
        self.proc: subprocess.Popen[bytes] | None = None
        self._send: Any = None
        self._recv: Any = None
        self._status: int | None = None  # the keeper's report of the worker's exit code

    def start(self) -> None:
        from multiprocessing.connection import Connection

        if self.proc is not None:
            return
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        status_r, status_w = os.pipe()
        fds = (to_child_r, from_child_w, status_w)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", WORKER_MAIN, *map(str, fds)],
                stdin=subprocess.DEVNULL,
                pass_fds=fds,
                close_fds=True,
                env={**os.environ, **self.env},
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self._status = status_r
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self._post(("load", self.spec, [os.getcwd(), *sys.path]), "loading it")
        msg = self._wait(max(self.timeout, LOAD_TIMEOUT_S), "loading it")
        if msg[0] == "failed":
            self.close()
            raise RewardError(msg[1])
        self.batched = bool(msg[1])

    def close(self) -> None:
        """Stop the worker (its pipes closed, the process killed if it does not leave)."""
        for conn in (self._send, self._recv):
            if conn is not None:
                try:
                    conn.close()
                except OSError:
                    pass
        self._send = self._recv = None
        if self._status is not None:
            os.close(self._status)
            self._status = None
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def _kill(self) -> None:
        """Kill the worker (its keeper does, on SIGUSR1) and close."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
        self.close()

    def _post(self, msg: tuple[Any, ...], what: str) -> None:
        """Send ``msg``; a worker that is gone is ``RewardError`` with its exit status."""
        assert self._send is not None and self.proc is not None
        try:
            self._send.send(msg)
        except OSError:  # the pipe's reader is gone: the worker died since the last call
            self._died(what)

    def _died(self, what: str) -> None:
        code = self._exit_code()
        self.close()
        how = f"killed by signal {-code}" if (code or 0) < 0 else f"exit status {code}"
        raise RewardError(f"the reward worker died ({'exit status unknown' if code is None else how}) {what}")

    def _exit_code(self, timeout: float = 10.0) -> int | None:
        """The dead worker's exit code (``-N``: signal N) as its keeper reports it, else the
        keeper's own. Not ``Popen.wait`` alone: sglang-jax's SIGCHLD handler may reap the keeper
        first, and ``wait`` then says 0."""
        assert self.proc is not None and self._status is not None
        if select.select([self._status], [], [], timeout)[0]:
            report = os.read(self._status, 64).strip()
            if report:
                return int(report)
        try:  # no report: the keeper died; its status, unless someone else reaped it (then 0)
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return code or None  # a keeper that is not killed reports before it exits 0

    def _wait(self, timeout: float, what: str) -> tuple[Any, ...]:
        """The worker's next message, or ``RewardError`` (timeout: the worker is killed; a dead
        worker: its exit status)."""
        assert self._recv is not None and self.proc is not None
        if not self._recv.poll(timeout):
            self._kill()
            raise RewardError(f"no result within {timeout:g} s (--reward-timeout) {what}; worker stopped")
        try:
            return self._recv.recv()
        except (EOFError, OSError):
            self._died(what)
            raise  # (not reached: _died raises)

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        rows: list[dict[str, Any]],
        sample: Callable[[int], str],
    ) -> np.ndarray:
        """One finite float per completion; ``sample(i)`` names sample ``i`` in an error."""
        n = len(completions)
        if not (len(prompts) == len(rows) == n):
            raise ValueError(f"{len(prompts)} prompts, {n} completions, {len(rows)} rows")
        if n == 0:
            return np.zeros(0, np.float64)
        out = np.full(n, np.nan, np.float64)
        name = f"reward {self.spec}"
        batch = f"for the batch of {n} samples ({sample(0)} ...)"
        try:
            self.start()
            self._post(("score", list(prompts), list(completions), list(rows)), f"before {sample(0)}")
            for i in range(n + 1):  # a batched call's first value may take the whole timeout
                first = not self.batched or i == 0
                what = batch if self.batched else f"on {sample(i)}" if i < n else "at the end of the batch"
                msg = self._wait(self.timeout if first and i < n else 10.0, what)
                if msg[0] != "value":
                    break
                out[msg[1]] = msg[2]
        except RewardError as e:
            raise RewardError(f"{name}: {e}") from None
        if msg[0] in ("raised", "bad"):
            where = batch if msg[1] < 0 else f"on {sample(msg[1])}"
            self._drain()
            if msg[0] == "raised":
                raise RewardError(f"{name} raised {msg[2]} {where}")
            raise RewardError(f"{name} {msg[2]} {where}: rewards must be finite numbers")
        if msg[0] != "done" or (i < n and not self.batched):
            raise RewardError(f"{name}: unexpected message {msg[0]!r} from the worker")
        return out

    def _drain(self) -> None:
        """After an error the worker sends ``done``; read it so the pipe stays in step."""
        try:
            if self._recv is not None and self._recv.poll(5):
                self._recv.recv()
        except (EOFError, OSError):
            self.close()


def sample_name(i: int, example: Any, prompt: str, what: str) -> str:
    """``sample 3 of step 0 (data.jsonl:7, prompt 'What is ...')``: which call failed (the prompt as
    the data has it, before the chat template)."""
    raw = getattr(example, "prompt", None)
    prompt = raw if isinstance(raw, str) else prompt
    shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
    where = f"{example.where}, " if getattr(example, "where", "") else ""
    return f"sample {i} of {what} ({where}prompt {shown!r})"


class Scorer:
    """A task's reward: ``spec`` run by a ``RewardRunner`` started on first use."""

    def __init__(
        self, spec: str, timeout: float = DEFAULT_TIMEOUT_S, env: dict[str, str] | None = None
    ) -> None:
        self.spec, self.timeout, self.env = spec, timeout, dict(env or {})
        self.runner: RewardRunner | None = None

    def rewards(
        self, prompts: list[str], completions: list[str], examples: list[Any], what: str
    ) -> np.ndarray:
        if self.runner is None:
            self.runner = RewardRunner(self.spec, self.timeout, self.env)
        rows = [e.row for e in examples]
        return self.runner.score(
            prompts, completions, rows, lambda i: sample_name(i, examples[i], prompts[i], what)
        )

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None
