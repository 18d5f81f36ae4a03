"""The run's exit codes, and the one mapping from what ended a run to its code and last line
(``python -m mllm_rl.run``, every plan; a multi-task run's failed task, ``TasksFailed``)."""

from __future__ import annotations

EXIT_CODES = {
    0: "ok",
    1: "runtime error",
    2: "bad input: one line on stderr, nothing started (no run directory, W&B run or engine); docs/ERRORS.md",
    3: "an engine's weights differ from what was sent (fingerprint) or from the trainer's (garbage guard)",
    4: "a lifecycle invariant broke",
    5: "a train step's loss or grad norm is not finite (stopped before its checkpoint and update)",
    6: "a phase ran past its --phase-timeout (stuck: every thread's stack is in the run directory), or "
    "the run's memory plan does not fit its devices (--memory-plan check; before anything started)",
    137: "killed (128 + SIGKILL) by its own watcher: still running 25 s after SIGTERM (a C call holding "
    "the interpreter, or a shutdown that long; the watcher's line on stderr says so)",
    143: "SIGTERM (128 + signal), after the phase log and the W&B run were closed",
}


DOES_NOT_FIT = 6  # as python -m mllm_rl.memplan: the plan does not fit (the run's own, before start-up)


class TasksFailed(RuntimeError):
    """Tasks of a multi-task run failed (the others ran on); ``code``: the first failure's."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def exit_of(e: BaseException) -> tuple[int, str]:
    """The exit code and the last line of a run that ``e`` ended (exception classes looked up by
    module: nothing heavy imported)."""
    import sys

    from mllm_rl.signals import Terminated

    if isinstance(e, Terminated):
        return 128 + e.signum, f"terminated by signal {e.signum}; phase log closed"
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted (SIGINT); phase log closed"
    if isinstance(e, TasksFailed):
        return e.code, f"error: {e}"
    kinds = [
        ("mllm_rl.phases.watchdog", "PhaseStuck", 6),
        ("mllm_rl.lifecycle", "NonFiniteTraining", 5),
        ("mllm_rl.engine", "WeightMismatch", 3),
        ("mllm_rl.lifecycle", "LifecycleError", 4),
        ("mllm_rl.checkpoint.model_dir", "CheckpointError", 2),
        ("mllm_rl.checkpoint.writer", "CheckpointWriteError", 1),  # names the file and the OS's reason
    ]
    for module, name, code in kinds:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return code, f"error: {type(e).__name__ + ': ' if code == 1 else ''}{e}"
    if isinstance(e, ValueError):  # bad input found once running (a task's data, a resumed shape)
        return 2, f"error: {e}"
    return 1, f"error: {type(e).__name__}: {e}"


def named(e: BaseException) -> bool:
    """Whether ``exit_of(e)``'s line is the whole story (else the run keeps the traceback)."""
    import sys

    if isinstance(e, (KeyboardInterrupt, TasksFailed)) or type(e).__name__ == "Terminated":
        return True
    writer = getattr(sys.modules.get("mllm_rl.checkpoint.writer"), "CheckpointWriteError", None)
    return exit_of(e)[0] != 1 or (writer is not None and isinstance(e, writer))
