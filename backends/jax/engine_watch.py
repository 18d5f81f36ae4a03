"""Failures of sglang-jax's threads, raised by the calls that wait on them.

sglang-jax (0.1.0rc0) runs its scheduler, detokenizer and, with the overlap schedule, the forward in
threads of this process. A thread that fails logs ``<who> hit an exception: <traceback>`` (its
watchdog: ``Watchdog timeout``), sends SIGQUIT and ends; the scheduler signals this process, the
forward thread and the watchdog its *parent*. A request that thread would have answered is then
waited on forever, and the parent (a shell, a benchmark driver) dies of the signal.

``ThreadWatch`` turns that into an error: ``check()`` raises ``EngineThreadError`` with the failed
thread's last traceback line once a watched thread has ended. ``own_sigquit`` sends the threads'
SIGQUIT to this process and swallows it when a failure was logged; any other SIGQUIT keeps its
default action (quit with a core dump).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable
from typing import Any

FAILURE_MARKS = ("hit an exception", "Watchdog timeout")
_errors: dict[int, str] = {}  # thread ident -> "<who> hit an exception: <last traceback line>"


class EngineThreadError(RuntimeError):
    """A thread of the engine ended: the engine answers no request any more."""


class _FailureLog(logging.Handler):
    """Keeps, per thread, the last line of a failure sglang-jax logs before the thread ends."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(mark in msg for mark in FAILURE_MARKS):
            lines = [line.strip() for line in msg.splitlines() if line.strip()]
            head = lines[0].split(":", 1)[0]
            _errors[record.thread or 0] = head if len(lines) == 1 else f"{head}: {lines[-1]}"


_log = _FailureLog(logging.ERROR)


def _on_sigquit(signum: int, frame: Any) -> None:
    if _errors:  # an engine thread logged its failure, then signalled: the waiting call reports it
        return
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGQUIT)


def own_sigquit(loop: Any, scheduler: Any) -> None:
    """Main thread, after the engine started: its threads signal this process, handled here (not
    sglang-jax's handlers, which kill the whole process tree)."""
    import psutil

    me = psutil.Process()
    worker = getattr(scheduler, "tp_worker", None)
    for owner in (scheduler, worker, getattr(worker, "worker", None)):
        if owner is not None and hasattr(owner, "parent_process"):
            owner.parent_process = me
    loop.remove_signal_handler(signal.SIGQUIT)
    signal.signal(signal.SIGQUIT, _on_sigquit)


def _runs_sgl_jax(t: threading.Thread) -> bool:
    target = getattr(t, "_target", None)  # CPython keeps it until the thread's run() returns
    return str(getattr(target, "__module__", "")).startswith("sgl_jax") or t.name.startswith("sglang")


class ThreadWatch:
    """The engine's threads (``threads``); ``check()`` raises once one of them has ended."""

    def __init__(self, threads: Iterable[threading.Thread]) -> None:
        self.threads = [t for t in threads if t is not None]
        if _log not in logging.getLogger("sgl_jax").handlers:
            logging.getLogger("sgl_jax").addHandler(_log)

    @staticmethod
    def started_since(before: set[threading.Thread]) -> list[threading.Thread]:
        """sglang-jax's threads started since ``before`` (a set of ``threading.enumerate()``): those
        running a function of its own (a thread of ours started meanwhile may end when it likes)."""
        return [t for t in threading.enumerate() if t not in before and _runs_sgl_jax(t)]

    def check(self) -> None:
        for t in self.threads:
            if not t.is_alive():
                why = _errors.get(t.ident or 0, "it logged no error")
                raise EngineThreadError(f"sglang-jax's thread {t.name!r} ended: {why}")
