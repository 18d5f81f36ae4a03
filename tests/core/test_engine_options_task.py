"""``EngineOptions.task`` / ``ports`` (multi-task runs): validated on construction."""

from __future__ import annotations

import pytest

from mllm_rl.engine import EngineOptions


def test_task_and_ports_are_kept():
    o = EngineOptions(task="small-1", ports=(30001, 30002)).resolved()
    assert (o.task, o.ports) == ("small-1", (30001, 30002))


@pytest.mark.parametrize("task", ["", "a/b", "-x", "x" * 65, "a b"])
def test_a_task_that_is_not_a_simple_name_is_refused(task):
    with pytest.raises(ValueError, match="engine task"):
        EngineOptions(task=task)


@pytest.mark.parametrize("ports", [(1,), (1, 2, 3), [1, 2], (0, 2), (1, 70000), (1, True), ("1", 2)])
def test_ports_must_be_two_ports(ports):
    with pytest.raises(ValueError, match="engine ports"):
        EngineOptions(ports=ports)
