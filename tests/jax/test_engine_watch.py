"""``backends/jax/engine_watch.py`` without an engine: the SIGQUIT an sglang-jax thread sends after
logging its failure is swallowed (the waiting call reports the failure); any other SIGQUIT keeps
its default action. In child processes: the handler is process-wide, and the default action ends one."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import threading

import pytest

from mllm_rl.backends.jax.engine_watch import EngineThreadError, ThreadWatch

CHILD = """
import logging, os, signal, sys, threading
from mllm_rl.backends.jax import engine_watch as w
w.ThreadWatch([])  # attaches the failure log to the 'sgl_jax' logger
signal.signal(signal.SIGQUIT, w._on_sigquit)
if sys.argv[1] == "failed":
    t = threading.Thread(target=lambda: logging.getLogger("sgl_jax.srt.managers.scheduler").error(
        "Scheduler hit an exception: %s", "Traceback (most recent call last):\\nRuntimeError: boom"))
    t.start(); t.join()
os.kill(os.getpid(), signal.SIGQUIT)
print("alive", flush=True)
"""


@pytest.mark.parametrize(("case", "code"), [("failed", 0), ("not", -signal.SIGQUIT)])
def test_a_sigquit_after_a_logged_failure_is_swallowed_any_other_quits(case, code, tmp_path):
    def no_core() -> None:  # the default action of SIGQUIT dumps core
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    r = subprocess.run([sys.executable, "-c", CHILD, case], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, preexec_fn=no_core)  # fmt: skip
    assert r.returncode == code, r.stderr[-2000:]
    assert ("alive" in r.stdout) == (code == 0)


def test_check_names_the_thread_that_ended_and_its_error():
    import logging

    go, alive = threading.Event(), threading.Event()

    def fails() -> None:
        go.wait()
        logging.getLogger("sgl_jax.srt.managers.tp_worker_overlap_thread").error(
            "ModelWorkerClient hit an exception: %s",
            "Traceback (most recent call last):\nValueError: bad cubin",
        )

    threads = [
        threading.Thread(target=alive.wait, name="keeps"),
        threading.Thread(target=fails, name="forward"),
    ]
    for t in threads:
        t.start()
    watch = ThreadWatch(threads)
    watch.check()  # both still running
    go.set()
    threads[1].join()
    with pytest.raises(
        EngineThreadError, match=r"'forward' ended: ModelWorkerClient hit an exception: ValueError: bad"
    ):
        watch.check()
    alive.set()
    threads[0].join()


def test_only_sglang_jax_threads_started_since_are_watched():
    """A thread of ours started while the engine starts (and free to end) is not the engine's."""
    before = set(threading.enumerate())
    stop = threading.Event()
    ours = threading.Thread(target=stop.wait, name="ours")
    named = threading.Thread(target=stop.wait, name="sglang::scheduler")
    for t in (ours, named):
        t.start()
    try:
        assert ThreadWatch.started_since(before) == [named]
    finally:
        stop.set()
