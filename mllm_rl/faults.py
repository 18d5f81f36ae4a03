"""Fault injection for tests: ``MLLM_RL_FAULTS="name1,name2"`` turns named faults on.

Each fault sits where a real bug would, and exists to prove that the check which must
catch that bug really does (a test without it could not fail). Names in use:

- ``swap_noop``      engines drop each received tensor instead of installing it
- ``resume_lies``    an engine loses its weights' CPU backup but reports them restored on resume
- ``train_oom``      the trainer's step fails like a device out-of-memory
- ``offload_noop``   the trainer's params offload moves nothing
- ``checkpoint_fails:<task>:<step>``  a multi-task run's checkpoint of one task at one step fails
"""

from __future__ import annotations

import os


def fault(name: str) -> bool:
    return name in os.environ.get("MLLM_RL_FAULTS", "").split(",")
