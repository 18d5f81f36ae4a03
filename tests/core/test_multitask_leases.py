"""The lease schedule and the driver, over the real ``Colocated`` leased phase groups with fake
devices, engines and trainers (``tests/core/multitask_fakes.py``) and random delays in every
fake primitive. Several "processes" are threads sharing a ``ThreadCoordinator``."""

from __future__ import annotations

import threading
import time

import pytest

from mllm_rl.coordination import LocalCoordinator, ScheduleMismatch
from mllm_rl.lifecycle import (
    LEASE_SETUP_PHASES,
    TRAIN_LEASE_PHASES,
    LifecycleError,
    LifecycleOptions,
    rollout_lease_phases,
)
from mllm_rl.multitask.driver import (
    DONE,
    FAILED,
    FINAL,
    ROLLOUT,
    SETUP,
    TRAIN,
    Driver,
    TaskFailed,
    TaskSteps,
    lease_schedule,
    schedule_digest,
)
from mllm_rl.multitask.runtime import task_phases
from mllm_rl.phases import PhaseRecorder, validate_record
from tests.core.multitask_fakes import FakeDevice, FakeProbe, FakeTask, ThreadCoordinator

TASKS = [TaskSteps("a", 0, 3), TaskSteps("b", 0, 2), TaskSteps("c", 0, 3)]


def _process(index, hub, schedule, delay, fail=None, fail_fast=False, seed=0):
    """One simulated process: its own fake device, recorder, tasks and driver."""
    dev = FakeDevice(max_delay_s=delay, seed=seed * 1000 + index)
    rec = PhaseRecorder(
        "mt", "fake", probe=FakeProbe(dev), process_index=index, sample_interval_s=0, tasks=True
    )
    tasks = {t.name: FakeTask(t.name, dev, rec, seed=i, fail_at=(fail or {}).get(t.name))
             for i, t in enumerate(TASKS)}  # fmt: skip
    coord = ThreadCoordinator(hub, index) if hub is not None else LocalCoordinator()
    drv = Driver(schedule, tasks, coord, fail_fast=fail_fast, device_bytes=dev.total)
    drv.entries = []
    drv.on_lease = drv.entries.append
    return drv, dev, rec, tasks


def _run_processes(n, schedule, delay, fails=None, fail_fast=False, seed=0, timeout=60.0):
    hub = ThreadCoordinator.Hub(n, timeout_s=timeout)
    procs = [_process(i, hub, schedule, delay, (fails or {}).get(i), fail_fast, seed) for i in range(n)]
    results: dict[int, object] = {}

    def go(i):
        try:
            results[i] = procs[i][0].run()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a process did not finish: deadlock"
    return procs, results


# -- the schedule ------------------------------------------------------------------------
def test_schedule_is_round_robin_and_a_pure_function_of_the_task_list():
    s = lease_schedule(TASKS)
    assert [(x.task, x.kind, x.step) for x in s[:3]] == [
        ("a", SETUP, None),
        ("b", SETUP, None),
        ("c", SETUP, None),
    ]
    assert [(x.task, x.kind, x.step) for x in s[3:9]] == [
        ("a", ROLLOUT, 0), ("a", TRAIN, 0), ("b", ROLLOUT, 0), ("b", TRAIN, 0), ("c", ROLLOUT, 0), ("c", TRAIN, 0)
    ]  # fmt: skip
    # b has 2 steps: its final lease follows its last train lease, then it drops out of the rounds
    b = [(x.kind, x.step) for x in s if x.task == "b"]
    assert b == [(SETUP, None), (ROLLOUT, 0), (TRAIN, 0), (ROLLOUT, 1), (TRAIN, 1), (FINAL, None)]
    assert [x.index for x in s] == list(range(len(s)))
    assert len(s) == 3 + 2 * (3 + 2 + 3) + 3
    assert lease_schedule(TASKS) == s and schedule_digest(lease_schedule(TASKS)) == schedule_digest(s)
    assert schedule_digest(lease_schedule(TASKS[::-1])) != schedule_digest(s)


def test_schedule_of_resumed_tasks_starts_each_at_its_own_step_and_skips_done_ones():
    s = lease_schedule([TaskSteps("a", 2, 3), TaskSteps("b", 0, 2), TaskSteps("done", 4, 4)])
    assert "done" not in {x.task for x in s}
    assert [(x.kind, x.step) for x in s if x.task == "a"] == [
        (SETUP, None),
        (ROLLOUT, 2),
        (TRAIN, 2),
        (FINAL, None),
    ]
    with pytest.raises(ValueError, match="unique"):
        lease_schedule([TaskSteps("a", 0, 1), TaskSteps("a", 0, 2)])


def test_lease_phase_groups_are_what_the_lifecycle_records():
    """One process, no delays: every record names its task, is schema v2, and each task's
    records are exactly its setup, both leases per step, and its final lease."""
    procs, results = _run_processes(1, lease_schedule(TASKS), delay=0.0)
    drv, dev, rec, tasks = procs[0]
    assert all(st.status == DONE for st in results[0].values())
    opts = LifecycleOptions()
    for r in rec.records:
        validate_record(r)
        assert r["schema"] == "mllm_rl.phase/2" and r["task"] in {"a", "b", "c"}
    for t in TASKS:
        mine = [r for r in rec.records if r["task"] == t.name]
        assert [r["phase"] for r in mine if r["step"] is None] == task_phases(opts)["expected_phases"]
        assert task_phases(opts)["expected_phases"] == (
            ["engine_ready_dummy"] + LEASE_SETUP_PHASES + rollout_lease_phases(opts, "generate_result")
        )
        for s in range(t.steps):
            assert [r["phase"] for r in mine if r["step"] == s] == rollout_lease_phases(
                opts
            ) + TRAIN_LEASE_PHASES
        rel = [r for r in mine if r["phase"] == "release_rollout" and r["step"] is not None]
        assert all(set(r["info"]["held"]) == {f"{t.name}/weights", f"{t.name}/kv_cache"} for r in rel)
    # between leases every task holds nothing on the device (true by device truth, not by flags)
    assert all(b == 0 for task in tasks.values() for b in task.bytes_after)
    assert dev.total() == 0


def test_update_is_sent_in_the_rollout_lease_and_lands():
    procs, _ = _run_processes(1, lease_schedule(TASKS), delay=0.0)
    rec = procs[0][2]
    for r in rec.records:
        if r["phase"] == "update_weights":
            assert r["info"]["fingerprint_ok"] is True and r["info"]["full"] is True


@pytest.mark.parametrize("rep", range(20))
def test_three_tasks_random_delays_same_lease_order_on_every_process_in_bounded_time(rep):
    """3 tasks, random delays in every phase, 2 processes (threads) with different delays:
    every process runs every lease, in the schedule's order, and nobody waits forever."""
    schedule = lease_schedule(TASKS)
    t0 = time.monotonic()
    procs, results = _run_processes(2, schedule, delay=0.002, seed=rep, timeout=60.0)
    assert time.monotonic() - t0 < 60
    want = [x.key for x in schedule]
    for drv, dev, _, _ in procs:
        assert drv.ran == want
        assert dev.total() == 0
    # the handoff: no process starts lease n+1 before every process finished lease n
    ends = [max(drv.entries[n]["t_end"] for drv, *_ in procs) for n in range(len(schedule))]
    for drv, *_ in procs:
        assert all(drv.entries[n + 1]["t_start"] >= ends[n] for n in range(len(schedule) - 1))
    assert all(st.status == DONE for r in results.values() for st in r.values())


def test_processes_with_different_schedules_refuse_to_start():
    hub = ThreadCoordinator.Hub(2, timeout_s=10)
    a = _process(0, hub, lease_schedule(TASKS), 0.0)[0]
    b = _process(1, hub, lease_schedule(TASKS[::-1]), 0.0)[0]
    errors = {}

    def go(name, drv):
        try:
            drv.run()
        except ScheduleMismatch as e:
            errors[name] = e

    threads = [threading.Thread(target=go, args=x) for x in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert set(errors) == {"a", "b"} and a.ran == [] and b.ran == []


# -- faults ------------------------------------------------------------------------------
@pytest.mark.parametrize("where", [(TRAIN, 1), (ROLLOUT, 0), (SETUP, None)])
def test_a_failed_task_releases_its_bytes_and_the_others_go_on(where):
    procs, results = _run_processes(1, lease_schedule(TASKS), delay=0.0, fails={0: {"b": where}})
    drv, dev, rec, tasks = procs[0]
    st = results[0]
    assert st["b"].status == FAILED and "injected failure" in st["b"].error
    assert st["a"].status == DONE and st["c"].status == DONE
    assert dev.of_task("b") == 0 and dev.total() == 0  # device truth: nothing of b is left
    failed_at = st["b"].failed_lease
    assert not any(k.split("/")[1] == "b" for k in drv.ran[drv.ran.index(failed_at) + 1 :])
    assert sorted(tasks["a"].rewards) == [0, 1, 2] and sorted(tasks["c"].rewards) == [0, 1, 2]
    if where[0] != SETUP:
        (fault,) = [r for r in rec.records if r["phase"] == "release_on_fault"]
        assert fault["task"] == "b" and fault["info"]["expected_freed_bytes"] > 0


def test_a_non_finite_train_step_fails_its_task_before_checkpoint_and_update():
    """A NaN loss in a train lease stops that task (``NonFiniteTraining``) before its checkpoint, so
    no NaN weights are saved or streamed to its engine; the other tasks go on."""
    procs, results = _run_processes(1, lease_schedule(TASKS), delay=0.0, fails={0: {"b": ("nan", 1)}})
    _, dev, rec, tasks = procs[0]
    st = results[0]
    assert st["b"].status == FAILED and "non-finite" in st["b"].error
    assert st["a"].status == DONE and st["c"].status == DONE and dev.total() == 0
    b_step1 = [r["phase"] for r in rec.records if r["task"] == "b" and r["step"] == 1]
    assert "train_step" in b_step1 and "checkpoint" not in b_step1
    (nan,) = [r for r in rec.records if r["task"] == "b" and r["phase"] == "train_step" and r["step"] == 1]
    assert "loss" in nan["info"]["non_finite"]
    assert not [
        r for r in rec.records if r["task"] == "b" and r["phase"] == "update_weights" and r["step"] == 2
    ]


def test_fail_fast_stops_the_run_at_the_first_failure():
    procs, results = _run_processes(1, lease_schedule(TASKS), delay=0.0, fails={0: {"b": (TRAIN, 0)}},
                                    fail_fast=True)  # fmt: skip
    drv, dev, _, _ = procs[0]
    assert isinstance(results[0], RuntimeError) and "injected failure in b" in str(results[0])
    assert drv.ran[-1] == "6/b/train/0" and dev.of_task("b") == 0


def test_a_failure_on_one_process_fails_the_task_on_every_process():
    """Only process 1's task b fails: both processes mark it failed and skip the same leases."""
    schedule = lease_schedule(TASKS)
    procs, results = _run_processes(2, schedule, delay=0.001, fails={1: {"b": (TRAIN, 0)}})
    (d0, dev0, _, _), (d1, dev1, _, _) = procs
    assert d0.ran == d1.ran and "6/b/train/0" in d0.ran and not any("/b/" in k for k in d0.ran[7:])
    for i in (0, 1):
        assert results[i]["b"].status == FAILED and "process 1" in results[i]["b"].error
        assert results[i]["a"].status == DONE and results[i]["c"].status == DONE
    assert dev0.total() == 0 and dev1.total() == 0


def test_fail_fast_on_another_process_raises_task_failed_here():
    procs, results = _run_processes(2, lease_schedule(TASKS), delay=0.0, fails={1: {"a": (ROLLOUT, 1)}},
                                    fail_fast=True)  # fmt: skip
    assert isinstance(results[0], TaskFailed) and results[0].task == "a"
    assert isinstance(results[1], RuntimeError)


def test_check_asleep_catches_a_task_that_keeps_bytes_between_leases():
    procs, _ = _run_processes(1, lease_schedule([TaskSteps("a", 0, 1)]), delay=0.0)
    life = procs[0][3]["a"].life
    life.engine.resume(["kv_cache"])
    with pytest.raises(LifecycleError, match="engine still holds"):
        life.check_asleep()
