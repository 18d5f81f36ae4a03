"""SIGTERM as an exception in the main thread (``Terminated``), so a run's ``finally`` blocks run
(shared by ``python -m mllm_rl.run`` and its multi-task runs)."""

from __future__ import annotations

import _thread
import signal
import threading
from typing import Any


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
