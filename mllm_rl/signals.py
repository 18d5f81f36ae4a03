"""SIGTERM as an exception in the main thread (``Terminated``), so a run's ``finally`` blocks run
(shared by ``python -m mllm_rl.run`` and its multi-task runs)."""

from __future__ import annotations

import _thread
import contextlib
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
        with contextlib.suppress(ValueError):
            counts.append(int(os.environ.get(name, "1")))
    return max(counts)


# Sent to the main thread to end a blocking wait so that a pending Python handler runs (the phase
# watchdog's too); its handler here does nothing.
WAKE_SIGNAL = signal.SIGUSR2
# A run still alive this long after SIGTERM is killed by its watcher process (exit 137): a C call that
# holds the interpreter (the GIL) never lets the main thread, or any Python thread, act on the signal.
HARD_BOUND_S = 25.0
POLL_S = 0.1

# The watcher: a separate interpreter, so it runs whatever the run's own one is stuck in. SIGTERM is
# blocked in every thread of the run, so it stays pending in the process's shared set (``ShdPnd`` in
# /proc/PID/status) until the watcher sees it there and writes one byte to the run's pipe.
_WATCHER = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a signal to the run's process group is the run's
signal.signal(signal.SIGINT, signal.SIG_IGN)
ppid, fd, hard, poll = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
bit = 1 << (signal.SIGTERM - 1)
def pending():
    with open(f"/proc/{ppid}/status") as f:
        for line in f:
            if line.startswith("ShdPnd:"):
                return int(line.split()[1], 16) & bit
    return 0
try:
    while os.getppid() == ppid and not pending():
        time.sleep(poll)
    if os.getppid() != ppid:
        sys.exit(0)
    os.write(fd, b"T")
    end = time.monotonic() + hard
    while os.getppid() == ppid and time.monotonic() < end:
        time.sleep(poll)
except OSError:
    sys.exit(0)
if os.getppid() == ppid:
    print(f"error: still running {hard:g} s after SIGTERM (a C call holding its interpreter, or a "
          f"shutdown that long): killing process {ppid} (exit 137)", file=sys.stderr, flush=True)
    os.kill(ppid, signal.SIGKILL)
"""


def install_sigterm(bound_s: float = TERM_BOUND_S, hard_bound_s: float = HARD_BOUND_S) -> None:
    """Turn SIGTERM into ``Terminated`` in the main thread; exit 143 ``bound_s`` later in a run of
    several processes (a collective another process never joins), exit 137 ``hard_bound_s`` later
    in any run (killed by the watcher: a C call holding the GIL stops every Python thread).

    jaxlib's absl failure handler takes SIGTERM over when XLA starts, so SIGTERM is blocked here
    before any other thread exists; the watcher process sees it pending and wakes a thread here,
    which raises it through Python's handlers (no /proc: that thread ``sigwait``s it instead)."""

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, on_term)
    if signal.getsignal(WAKE_SIGNAL) in (signal.SIG_DFL, None):
        signal.signal(WAKE_SIGNAL, lambda signum, frame: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    woken = _start_watcher(hard_bound_s)

    def wait() -> None:
        if woken is None or not os.read(woken, 1):  # no watcher, or it ended without a word
            signal.sigwait({signal.SIGTERM})
        _thread.interrupt_main(signal.SIGTERM)
        # a real signal to the main thread ends a blocking wait there (a lock, a future's result), so
        # the handler runs now, not when the wait would have ended
        signal.pthread_kill(threading.main_thread().ident, WAKE_SIGNAL)
        if process_count() < 2:
            return
        time.sleep(bound_s)
        msg = f"still running {bound_s:g} s after SIGTERM (waiting for another process of the run)"
        print(f"error: {msg}: exiting {128 + signal.SIGTERM}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=wait, name="mllm_rl-sigterm", daemon=True).start()


def _start_watcher(hard_bound_s: float) -> int | None:
    """Start ``_WATCHER`` for this process; the pipe end it writes to when SIGTERM is pending, or
    None where it cannot run (no /proc status of this process)."""
    import subprocess

    if not os.path.exists(f"/proc/{os.getpid()}/status"):
        return None
    r, w = os.pipe()
    try:
        argv = [sys.executable, "-I", "-S", "-c", _WATCHER, *map(str, (os.getpid(), w, hard_bound_s, POLL_S))]
        subprocess.Popen(argv, pass_fds=(w,), stdin=subprocess.DEVNULL)
    except OSError:
        os.close(r)
        os.close(w)
        return None
    os.close(w)
    return r
