"""SIGTERM as an exception in the main thread (``Terminated``), so a run's ``finally`` blocks run
(shared by ``python -m mllm_rl.run`` and its multi-task runs)."""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from typing import Any

# A process of a multi-process run still alive this long after SIGTERM ends itself (exit 143): the
# others stop too, so a collective it waits in (or that waits for it) never completes.
TERM_BOUND_S = 5.0
PROCESS_COUNT_VARS = ("MLLM_RL_NUM_PROCESSES", "WORLD_SIZE")  # python -m mllm_rl.launch, torchrun


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM so ``finally`` blocks run. A ``SystemExit``: event
    loops (the engine's asyncio loop) swallow other exceptions raised in their callbacks."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def process_count() -> int:
    """The processes of this run, from the launcher's or torchrun's variables (1 when neither)."""
    counts = [1]
    for name in PROCESS_COUNT_VARS:
        try:
            counts.append(int(os.environ.get(name, "1")))
        except ValueError:
            pass
    return max(counts)


def install_sigterm(bound_s: float = TERM_BOUND_S) -> None:
    """Turn SIGTERM into ``Terminated`` in the main thread, whoever loads later; in a run of
    several processes, end the process (exit 143) if it is still running ``bound_s`` later.

    jaxlib's absl failure handler takes SIGTERM over when XLA starts and aborts (exit -6), so
    SIGTERM is blocked here before any other thread exists (threads inherit the mask) and a
    waiter thread ``sigwait``s it and raises through Python's own handler table.

    The bound: one process may be stuck in a collective (a C call) that another, already in its
    ``finally``, never joins, each waiting for the other; ending the survivor breaks the wait."""

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    def wait() -> None:
        signal.sigwait({signal.SIGTERM})
        _thread.interrupt_main(signal.SIGTERM)
        if process_count() < 2:
            return
        time.sleep(bound_s)
        print(
            f"error: still running {bound_s:g} s after SIGTERM (waiting for another process of the run): "
            f"exiting {128 + signal.SIGTERM}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=wait, name="mllm_rl-sigterm", daemon=True).start()
