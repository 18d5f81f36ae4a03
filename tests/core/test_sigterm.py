"""SIGTERM ends a run's process however it is stuck (``mllm_rl.signals.install_sigterm``): in Python,
even in a blocking wait (the signal thread wakes the main thread), ``Terminated`` runs its
``finally`` blocks and it exits 143; in a C call that holds the GIL (every
Python thread of the process stopped, the signal's own thread too), its watcher process kills it
``hard_bound_s`` after the signal (exit 137) and says why."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.conftest import ROOT

CHILD = r"""
import sys
from mllm_rl.signals import install_sigterm
install_sigterm(hard_bound_s=float(sys.argv[2]))
try:
    print("ready", flush=True)
    if sys.argv[1] == "gil":
        import ctypes
        ctypes.PyDLL(None).sleep(120)  # a C call through PyDLL keeps the GIL for two minutes
    else:
        import threading
        threading.Event().wait()  # a lock wait that nothing else ends
finally:
    print("finally", flush=True)
"""


def _stop(mode: str, hard_bound_s: float) -> tuple[int, str, str, float]:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(hard_bound_s)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # the child is in its loop or its C call
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err, time.monotonic() - t0


def test_sigterm_in_python_runs_the_finally_and_exits_143():
    rc, out, err, secs = _stop("python", 30)
    assert rc == 143 and "finally" in out, err[-2000:]
    assert secs < 5, secs


def test_sigterm_while_a_c_call_holds_the_gil_is_killed_by_the_watcher():
    rc, out, err, secs = _stop("gil", 3)
    assert rc == -signal.SIGKILL, (rc, err[-2000:])
    assert "error: still running 3 s after SIGTERM" in err and "exit 137" in err
    assert "finally" not in out  # the interpreter never ran again
    assert 3 <= secs < 10, secs
