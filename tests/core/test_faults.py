"""``mllm_rl.faults``: named faults from ``MLLM_RL_FAULTS``, and ``suspended()`` (the memory
planner traces the run's real trainer step before start-up: a fault meant for the run must not
fire there)."""

from __future__ import annotations

import threading

from mllm_rl import faults


def test_faults_and_values_follow_the_environment(monkeypatch):
    monkeypatch.setenv("MLLM_RL_FAULTS", "train_oom,leak_mb=64")
    assert faults.fault("train_oom") and not faults.fault("swap_noop")
    assert faults.fault_value("leak_mb") == "64" and faults.fault_value("hang") is None


def test_suspended_turns_every_fault_off_on_its_thread_only(monkeypatch):
    monkeypatch.setenv("MLLM_RL_FAULTS", "train_oom,leak_mb=64")
    seen: list[bool] = []
    with faults.suspended():
        assert not faults.fault("train_oom") and faults.fault_value("leak_mb") is None
        with faults.suspended():  # nested
            assert not faults.fault("train_oom")
        assert not faults.fault("train_oom")
        other = threading.Thread(target=lambda: seen.append(faults.fault("train_oom")))
        other.start()
        other.join()
    assert seen == [True]  # another thread still sees the fault
    assert faults.fault("train_oom") and faults.fault_value("leak_mb") == "64"
