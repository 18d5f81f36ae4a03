"""Fault injection for tests: ``MLLM_RL_FAULTS="name1,name2"`` turns named faults on.

Each fault sits where a real bug would, to prove the check that must catch it does. Names:

- ``swap_noop``      engines drop each received tensor instead of installing it
- ``resume_lies``    an engine loses its weights' CPU backup but reports them restored on resume
- ``train_oom``      the trainer's step fails like a device out-of-memory
- ``offload_noop``   the trainer's params offload moves nothing
- ``leak_mb=N``      the trainer keeps N MiB more device memory per train step (the plan audit)
- ``host_leak_mb=N`` every train step keeps N MiB more host memory (the ``host_growth`` finding)
- ``reward_nan``     each step's first completion gets a NaN reward (the non-finite loss guard)
- ``hang=PHASE``     phase PHASE sleeps until interrupted (the watchdog)
- ``hang_deaf=PHASE`` the same, swallowing every interruption (the watchdog's hard exit)
- ``checkpoint_fails:<task>:<step>``  a multi-task run's checkpoint of one task at one step fails
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

_off = threading.local()  # suspended() on this thread


def _faults() -> list[str]:
    if getattr(_off, "depth", 0):
        return []
    return os.environ.get("MLLM_RL_FAULTS", "").split(",")


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No fault fires on this thread inside, e.g. while the memory planner traces the trainer step."""
    _off.depth = getattr(_off, "depth", 0) + 1
    try:
        yield
    finally:
        _off.depth -= 1


def fault(name: str) -> bool:
    return name in _faults()


def fault_value(name: str) -> str | None:
    """``VALUE`` of a ``name=VALUE`` fault, or None when it is off."""
    for f in _faults():
        key, sep, value = f.partition("=")
        if sep and key == name:
            return value
    return None


def injected_hang(phase: str) -> None:
    """Sleep forever in ``phase`` under ``hang=PHASE`` (interruptible) or ``hang_deaf=PHASE`` (not)."""
    if fault_value("hang") == phase:
        while True:
            time.sleep(3600)
    if fault_value("hang_deaf") == phase:
        while True:
            try:
                time.sleep(3600)
            except BaseException:  # the point: a hang that ignores every interruption
                pass
