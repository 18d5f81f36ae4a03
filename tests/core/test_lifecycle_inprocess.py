"""In-process tests of the lifecycle (``Colocated``) and the engine state machine (``ManagedEngine``).

The engine, trainer and backend are the named fakes of ``tests/fakes.py`` (exact device bytes,
controllable requests in flight); the recorder, sinks, batch building and advantages are the
real core code. Each invariant of docs/RL.md has a scenario here;
``test_each_scenario_fails_when_its_invariant_is_removed`` removes the check that enforces it from
the core (monkeypatch) and shows that the scenario then fails: none of them passes by construction.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mllm_rl.engine_state as engine_state
from mllm_rl import lifecycle
from mllm_rl.engine import TAG_KV, TAG_WEIGHTS, EngineStateError, SamplingParams, WeightExport, WeightMismatch
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.lifecycle import (
    BOTH_RESIDENT_OK,
    SCHEDULES,
    SETUP_PHASES,
    Colocated,
    LifecycleError,
    LifecycleOptions,
    colocate,
    step_phases,
)
from mllm_rl.phases import PhaseRecorder, validate_record
from mllm_rl.rl.advantages import group_advantages
from mllm_rl.rl.batch import build_batch
from mllm_rl.sinks.jsonl import JsonlSink, read_jsonl
from tests.fakes import (
    KV_BYTES,
    LORA_NAMES,
    SHAPES,
    FakeBackend,
    FakeDevice,
    FakeEngine,
    FakeProbe,
    FakeTrainer,
    MemorySink,
    fingerprint,
    initial_weights,
    nbytes,
)

PROMPTS = [[1, 2, 3], [4, 5]]
GROUP = 2
PROBE = (7, 8, 9)
W = nbytes(initial_weights())  # engine weights == trainer params bytes
BIGGEST = max(int(np.prod(s)) * 4 for s in SHAPES.values())  # one tensor in flight during an update


def rollout(engine: ManagedEngine, step: int) -> tuple[Any, dict[str, Any]]:
    """``GROUP`` samples per prompt, reward = parity of the first token, GRPO advantages."""
    ids = [p for p in PROMPTS for _ in range(GROUP)]
    outs = engine.generate(ids, SamplingParams(max_new_tokens=4, temperature=1.0, seed=step))
    rewards = np.array([float(o.token_ids[0] % 2) for o in outs])
    return build_batch(ids, outs, group_advantages(rewards, GROUP)), {"reward_mean": float(rewards.mean())}


@dataclass
class Rig:
    """A fake engine and device ready to colocate with a trainer (``setup`` does it)."""

    device: FakeDevice
    fake: FakeEngine
    engine: ManagedEngine
    backend: FakeBackend
    sink: MemorySink
    rec: PhaseRecorder
    opts: LifecycleOptions
    trainer_kw: dict[str, Any]
    life: Colocated | None = None
    trainer: FakeTrainer | None = None
    threads: list[threading.Thread] = field(default_factory=list)

    def make_trainer(self) -> FakeTrainer:
        """The trainer, built on the device now (``setup`` builds it in its ``trainer_init``)."""
        self.trainer = FakeTrainer(self.device, **self.trainer_kw)
        return self.trainer

    def setup(self) -> Rig:
        self.life = colocate(
            self.backend, self.engine, self.rec, self.opts, lambda: (self.make_trainer(), {"fake": True})
        )
        self.life.first_sync()
        return self

    def names(self) -> list[str]:
        return [r["phase"] for r in self.rec.records]

    def record(self, phase: str, step: int | None) -> dict[str, Any]:
        (r,) = [r for r in self.rec.records if r["phase"] == phase and r["step"] == step]
        return r

    def in_background(self, fn: Callable[[], Any]) -> list[Any]:
        """Run ``fn`` in a thread; its result (or exception) lands in the returned list."""
        out: list[Any] = []

        def run() -> None:
            try:
                out.append(fn())
            except Exception as e:
                out.append(e)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        self.threads.append(th)
        return out

    def join(self) -> None:
        self.fake.let_go()
        for th in self.threads:
            th.join(timeout=5)
            assert not th.is_alive(), "a request never returned"


def make_rig(
    schedule: str = "multi_stage",
    check_weights: bool = False,
    sinks: tuple[Any, ...] = (),
    drain_timeout_s: float = 5.0,
    engine: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
) -> Rig:
    device = FakeDevice()
    fake = FakeEngine(device, **(engine or {}))
    managed = ManagedEngine(fake)
    sink = MemorySink()
    rec = PhaseRecorder(
        "inprocess", "fake", sinks=[sink, *sinks], probe=FakeProbe(device), sample_interval_s=0
    )
    opts = LifecycleOptions(schedule=schedule, check_weights=check_weights, probe_ids=PROBE if check_weights else (),
                            drain_timeout_s=drain_timeout_s)  # fmt: skip
    backend = FakeBackend()
    return Rig(device, fake, managed, backend, sink, rec, opts, trainer or {})


def owners(record: dict[str, Any]) -> set[str]:
    """Who held device bytes at the end of a phase (the fake device's ledger, as recorded)."""
    return set(record["memory"]["devices"][0]["raw"]["owners"])


def engines_agree(r: Rig) -> bool:
    return r.fake.weights_fingerprint() == fingerprint(r.trainer.weights) and not r.fake.garbage


# -- phase order, recording ------------------------------------------------------------------
@pytest.mark.parametrize("check_weights", [False, True], ids=["plain", "check_weights"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_setup_and_two_steps_record_every_phase_in_schedule_order(schedule, check_weights, tmp_path):
    r = make_rig(schedule, check_weights, sinks=(JsonlSink(tmp_path / "phases.jsonl"),)).setup()
    metrics = [r.life.step(s, rollout) for s in range(2)]
    r.rec.close()
    phases = step_phases(r.life.opts)
    assert r.names() == SETUP_PHASES + phases + phases
    assert [x["step"] for x in r.rec.records] == [None] * len(SETUP_PHASES) + [0] * len(phases) + [1] * len(
        phases
    )
    on_disk = read_jsonl(tmp_path / "phases.jsonl")
    assert on_disk == json.loads(json.dumps(r.rec.records, default=str))
    assert r.sink.records == r.rec.records and r.sink.closed_with == 0
    assert [x["idx"] for x in on_disk] == list(range(len(on_disk)))
    for x in on_disk:
        validate_record(x)
        assert "error" not in x["info"]
        assert set(x["info"]["engine"]) >= {"released", "weights_valid", "paused", "in_flight"}
    assert all(m["reward_mean"] >= 0 and m["updates"] == 1 for m in metrics)
    assert r.engine.weights_version == 3  # the setup's swap + one update per step
    assert engines_agree(r) and r.fake.violations == []
    assert r.backend.empty_cache_calls == 4
    if check_weights:
        assert r.record("check_weights", 1)["info"]["agree_until"] == r.life.opts.probe_tokens


def test_a_failing_phase_is_recorded_with_its_error_and_the_run_stops(tmp_path):
    r = make_rig(sinks=(JsonlSink(tmp_path / "phases.jsonl"),)).setup()

    def oom(batch):
        raise MemoryError("fake device out of memory")

    r.trainer.train_step = oom
    with pytest.raises(MemoryError):
        r.life.step(0, rollout)
    last = read_jsonl(tmp_path / "phases.jsonl")[-1]
    assert last["phase"] == "train_step" and last["step"] == 0
    assert last["info"]["error"] == "MemoryError: fake device out of memory"
    assert r.names()[-1] == "train_step"


# -- residency -------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_device_bytes_per_phase_follow_the_schedule(schedule):
    r = make_rig(schedule).setup()
    for s in range(2):
        r.life.step(s, rollout)
    engine_all = {"engine.weights", "engine.kv_cache"}
    for step in (None, 0, 1):
        assert not owners(r.record("release_rollout", step)) & engine_all
        assert owners(r.record("continue_generation", step)) == engine_all  # the trainer is gone
    for step in (0, 1):
        assert owners(r.record("onload_trainer", step)) == {"trainer.params", "trainer.optimizer"}
        assert owners(r.record("offload_optimizer", step)) == {"trainer.params"}
        update = r.record("update_weights", step)["memory"]["devices"][0]["phase_peak_bytes"]
        # trainer params + engine weights + the tensor being installed; naive: + the KV cache
        assert update == 2 * W + BIGGEST + (KV_BYTES if schedule == "naive" else 0)
    # every phase, both schedules: flags and device ledger agree, and both resident only where allowed
    for x in r.rec.records:
        trainer = x["info"].get("trainer", {})
        both = trainer.get("params", False) and TAG_WEIGHTS not in x["info"]["engine"]["released"]
        assert both == ({"trainer.params", "engine.weights"} <= owners(x))
        assert not both or x["phase"] in BOTH_RESIDENT_OK, x["phase"]


def scenario_trainer_that_keeps_its_params_breaks_residency() -> None:
    """A trainer whose params offload moves nothing: the next phase with engine weights fails."""
    r = make_rig(trainer={"offload_noop": True})
    with pytest.raises(LifecycleError, match="offload_trainer_params: trainer params and engine weights"):
        r.setup()
    assert r.rec.records[-1]["phase"] == "offload_trainer_params"
    assert "LifecycleError" in r.rec.records[-1]["info"]["error"]


def test_trainer_that_keeps_its_params_breaks_residency():
    scenario_trainer_that_keeps_its_params_breaks_residency()


def test_colocate_builds_the_trainer_only_after_the_engine_released_everything():
    r = make_rig()
    seen: list[set[str]] = []

    def make() -> tuple[FakeTrainer, dict[str, Any]]:
        seen.append(set(r.device.owners))  # what the device holds when the trainer is built
        return r.make_trainer(), {}

    life = colocate(r.backend, r.engine, r.rec, r.opts, make)
    assert life.trainer is r.trainer and r.names() == SETUP_PHASES[:2]
    assert not any(o.startswith("engine.") for o in seen[0])


def test_a_trainer_that_fails_to_build_leaves_the_engine_released_and_nothing_else():
    r = make_rig()

    def make() -> tuple[FakeTrainer, dict[str, Any]]:
        raise MemoryError("fake device out of memory")

    with pytest.raises(MemoryError):
        colocate(r.backend, r.engine, r.rec, r.opts, make)
    assert r.names() == SETUP_PHASES[:2] and r.device.used == 0
    info = lifecycle.release_on_fault(r.backend, r.engine, None, r.rec, r.opts, None)  # no trainer to free
    assert info["expected_freed_bytes"] == 0 and r.names()[-1] == "release_on_fault"


def test_the_naive_swap_places_every_tensor_before_installing_any():
    r = make_rig()
    new = {n: w + 1 for n, w in initial_weights().items()}
    placed = r.engine.place_all(new.items())
    assert r.device.used == W + KV_BYTES + W  # the old weights and every new tensor, both resident
    assert placed.full and placed.names == list(new)
    r.engine.update_weights(placed)
    assert r.fake.weights_fingerprint() == fingerprint(new) and r.device.used == W + KV_BYTES
    r.engine.drain()
    r.engine.release([TAG_KV, TAG_WEIGHTS])
    with pytest.raises(EngineStateError, match="place_all refused: weights are released"):
        r.engine.place_all(new.items())


# -- drain / in flight -------------------------------------------------------------------------
def test_drain_waits_for_requests_in_flight_then_releases():
    r = make_rig().setup()
    late: list[list[Any]] = []

    def rollout_leaving_one_in_flight(engine, step):
        out = rollout(engine, step)
        r.fake.hold()
        late.append(r.in_background(lambda: engine.generate([[3, 3, 3]], SamplingParams(max_new_tokens=8))))
        assert r.fake.started.wait(2)
        return out

    try:
        r.life.step(0, rollout_leaving_one_in_flight)
    finally:
        r.join()
    drain = r.record("drain", 0)["info"]
    assert drain["in_flight_at_pause"] == 1 and drain["aborted"] == 1
    ((outs,),) = late
    assert [o.finish_reason for o in outs] == ["abort"]
    calls = r.fake.calls
    last_pause = len(calls) - 1 - calls[::-1].index("pause_generation")
    assert calls[last_pause + 1 : last_pause + 3] == ["flush_cache", "release:kv_cache"]
    assert r.fake.violations == []
    assert r.engine.aborted == 1


def scenario_release_with_requests_in_flight_is_refused() -> None:
    r = make_rig()
    r.fake.hold()
    r.in_background(lambda: r.engine.generate([[1, 2]], SamplingParams(max_new_tokens=4)))
    try:
        assert r.fake.started.wait(2)
        with pytest.raises(EngineStateError, match="release refused: 1 request"):
            r.engine.release([TAG_KV])
        assert not [c for c in r.fake.calls if c.startswith("release:")]
        assert r.device.holds("engine.kv_cache") and r.fake.violations == []
    finally:
        r.join()
    r.engine.drain(timeout_s=2)
    assert r.engine.release([TAG_KV]) == {TAG_KV: KV_BYTES}
    assert not r.device.holds("engine.kv_cache") and r.fake.violations == []


def test_release_with_requests_in_flight_is_refused():
    scenario_release_with_requests_in_flight_is_refused()


def test_release_before_drain_is_refused_even_when_idle():
    r = make_rig()
    with pytest.raises(EngineStateError, match="generation running; drain"):
        r.engine.release([TAG_WEIGHTS])
    assert r.fake.calls == [] and r.device.holds("engine.weights")


def test_a_drain_that_times_out_raises_and_releases_nothing():
    r = make_rig(drain_timeout_s=0.05, engine={"ignore_pause": True}).setup()
    before, n_calls = dict(r.device.owners), len(r.fake.calls)

    def rollout_leaving_a_hung_request(engine, step):
        out = rollout(engine, step)
        r.fake.hold()
        r.in_background(lambda: engine.generate([[3]], SamplingParams(max_new_tokens=8)))
        assert r.fake.started.wait(2)
        return out

    try:
        with pytest.raises(EngineStateError, match=r"1 request\(s\) still in flight after 0.05s"):
            r.life.step(0, rollout_leaving_a_hung_request)
    finally:
        r.join()
    assert r.names()[-1] == "drain" and "EngineStateError" in r.rec.records[-1]["info"]["error"]
    assert r.device.owners == before  # nothing released
    assert not [c for c in r.fake.calls[n_calls:] if c.startswith("release:")]


# -- weights validity ------------------------------------------------------------------------
def _resumed_without_backup(r: Rig) -> None:
    """Swap the trainer's weights in, drain, release everything, resume everything (no backup)."""
    r.make_trainer()
    r.engine.update_weights(r.trainer.export_weights(full=True))
    r.engine.drain(timeout_s=2)
    r.engine.release([TAG_KV, TAG_WEIGHTS])
    r.engine.resume([TAG_WEIGHTS, TAG_KV])
    r.engine.continue_generation()


def scenario_generate_on_invalid_weights_is_refused() -> None:
    r = make_rig()
    _resumed_without_backup(r)
    assert r.engine.state()["weights_valid"] is False
    n_generate = r.fake.calls.count("generate")
    with pytest.raises(EngineStateError, match="weights are invalid"):
        r.engine.generate(PROMPTS, SamplingParams())
    assert r.fake.calls.count("generate") == n_generate and r.fake.violations == []
    r.engine.update_weights(r.trainer.export_weights(full=True))
    assert r.engine.weights_valid
    r.engine.generate(PROMPTS, SamplingParams())
    assert r.fake.violations == []


def test_generate_on_invalid_weights_is_refused():
    scenario_generate_on_invalid_weights_is_refused()


def test_generate_is_refused_while_released_or_paused():
    r = make_rig()
    r.engine.drain(timeout_s=2)
    with pytest.raises(EngineStateError, match="paused"):
        r.engine.generate(PROMPTS, SamplingParams())
    r.engine.release([TAG_KV])
    with pytest.raises(EngineStateError, match="continue_generation refused: kv_cache is released"):
        r.engine.continue_generation()
    with pytest.raises(EngineStateError, match=r"memory released for \['kv_cache'\]"):
        r.engine.generate(PROMPTS, SamplingParams())
    assert "generate" not in r.fake.calls and r.fake.violations == []


def test_resume_with_cpu_backup_keeps_the_weights_valid():
    r = make_rig(engine={"weights_cpu_backup": True})
    r.engine.update_weights(r.make_trainer().export_weights(full=True))
    r.engine.drain(timeout_s=2)
    assert r.engine.release([TAG_WEIGHTS]) == {TAG_WEIGHTS: W}
    assert r.device.owners == {"engine.kv_cache": KV_BYTES, "trainer.params": W, "trainer.optimizer": 2 * W}
    assert r.engine.resume([TAG_WEIGHTS]) == {TAG_WEIGHTS: W}
    assert r.engine.weights_valid and engines_agree(r)


def scenario_partial_update_on_invalid_weights_is_refused() -> None:
    r = make_rig(trainer={"lora": True})
    _resumed_without_backup(r)
    partial = r.trainer.export_weights(full=False)
    assert not partial.full and partial.names == list(LORA_NAMES)
    n_updates = r.fake.calls.count("update_weights")
    with pytest.raises(EngineStateError, match="partial update on invalid weights"):
        r.engine.update_weights(partial)
    assert r.fake.calls.count("update_weights") == n_updates  # refused before the engine saw a tensor
    assert not r.engine.weights_valid and r.fake.garbage == set(SHAPES)
    r.engine.update_weights(r.trainer.export_weights(full=True))
    assert r.engine.weights_valid and engines_agree(r)


def test_partial_update_on_invalid_weights_is_refused():
    scenario_partial_update_on_invalid_weights_is_refused()


def scenario_lora_step_after_resume_without_backup_syncs_the_full_weights() -> None:
    """The lifecycle replaces the partial (LoRA) sync by a full one when the base is invalid."""
    for backup, full, tensors in ((False, True, len(SHAPES)), (True, False, len(LORA_NAMES))):
        r = make_rig(engine={"weights_cpu_backup": backup}, trainer={"lora": True}).setup()
        for s in range(2):
            r.life.step(s, rollout)
            info = r.record("update_weights", s)["info"]
            assert (info["full"], info["tensors"]) == (full, tensors), (backup, s)
        assert engines_agree(r) and r.fake.violations == []


def test_lora_step_after_resume_without_backup_syncs_the_full_weights():
    scenario_lora_step_after_resume_without_backup_syncs_the_full_weights()


# -- double release / resume, unknown tags ---------------------------------------------------
def scenario_double_release_and_resume_are_warned_no_ops() -> None:
    r = make_rig()
    r.engine.drain(timeout_s=2)
    r.engine.release([TAG_KV])
    with pytest.warns(UserWarning, match="already released; no-op"):
        assert r.engine.release([TAG_KV, TAG_KV]) == {}
    assert r.fake.calls.count("release:kv_cache") == 1 and r.fake.violations == []
    r.engine.resume([TAG_KV])
    with pytest.warns(UserWarning, match="not released; no-op"):
        assert r.engine.resume([TAG_KV]) == {}
    assert r.fake.calls.count("resume:kv_cache") == 1 and r.fake.violations == []
    assert r.device.owners["engine.kv_cache"] == KV_BYTES


def test_double_release_and_resume_are_warned_no_ops():
    scenario_double_release_and_resume_are_warned_no_ops()


def test_unknown_tag_is_an_error_and_changes_nothing():
    r = make_rig()
    r.engine.drain(timeout_s=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for op in (r.engine.release, r.engine.resume):
            with pytest.raises(ValueError, match=r"unknown memory tag\(s\) \['cuda_graph'\]"):
                op([TAG_KV, "cuda_graph"])
    assert r.engine.released == set() and not [c for c in r.fake.calls if ":" in c]


# -- updates that must fail loudly -----------------------------------------------------------
def scenario_update_that_did_not_land_raises() -> None:
    r = make_rig(engine={"drop_updates": True})
    with pytest.raises(WeightMismatch, match="differ from what was sent"):
        r.setup()
    assert r.names()[-1] == "weights_swapped" and "WeightMismatch" in r.rec.records[-1]["info"]["error"]
    assert r.engine.weights_version == 0


def test_update_that_did_not_land_raises():
    scenario_update_that_did_not_land_raises()


@pytest.mark.parametrize("unproven", [set(), set(SHAPES), {"lm_head.weight"}], ids=["none", "all", "one"])
def test_an_update_the_engine_proves_installed_is_not_read_back(unproven):
    """An adapter that proves what it fingerprinted is what it installed (``UpdateStats.installed``)
    spares the check a read of those engine weights; what it cannot prove is read back, and only
    that. The record says how many were (``read_back``) and how long the check took."""
    r = make_rig(engine={"unproven": frozenset(unproven)}).setup()
    r.fake.read_names.clear()  # the setup's swap
    r.life.step(0, rollout)
    (upd,) = [x for x in r.rec.records if x["phase"] == "update_weights"]
    assert sorted(r.fake.read_names) == sorted(unproven)
    assert upd["info"]["read_back"] == len(unproven) and upd["info"]["check_s"] >= 0
    assert engines_agree(r)


def test_update_with_missing_tensors_raises():
    r = make_rig(engine={"max_installed": 2})
    with pytest.raises(WeightMismatch, match=f"2 of {len(SHAPES)} announced tensors arrived"):
        r.setup()


def test_engine_weights_differing_from_the_trainers_raise():
    """What the engine got is what was sent, but not what the trainer says it has."""
    r = make_rig(trainer={"stale_fingerprint": True}).setup()  # no step yet: the fingerprint is right
    with pytest.raises(WeightMismatch, match="differ from the trainer's"):
        r.life.step(0, rollout)
    assert r.names()[-1] == "update_weights"


@pytest.mark.parametrize("stale", [False, True])
def test_an_export_carrying_its_fingerprint_is_checked_without_a_second_pass(stale):
    """The real trainers fingerprint what they send as they send it: the lifecycle checks the
    engine against that, and a sender whose claim is not what it sent is still caught."""
    r = make_rig(trainer={"export_fingerprint": True, "stale_fingerprint": stale}).setup()
    if stale:
        with pytest.raises(WeightMismatch, match="differ from the trainer's"):
            r.life.step(0, rollout)
    else:
        r.life.step(0, rollout)
        assert r.fake.weights_fingerprint() == fingerprint(r.trainer.weights)
    assert r.trainer.fingerprint_reads == 0


def test_an_update_that_failed_midway_leaves_the_weights_invalid_until_a_full_update():
    """Some tensors landed, the rest did not: the engine holds neither the old nor the new weights."""
    r = make_rig()
    trainer = r.make_trainer()
    r.engine.update_weights(trainer.export_weights(full=True))
    trainer.weights = {n: w + 1 for n, w in trainer.weights.items()}
    names = list(trainer.weights)

    def failing_midway():
        yield names[0], trainer.weights[names[0]]
        raise MemoryError("device out of memory while gathering the second tensor")

    with pytest.raises(MemoryError):
        r.engine.update_weights(WeightExport(names, failing_midway(), full=True))
    assert r.fake.weights_fingerprint()[names[0]] == fingerprint(trainer.weights)[names[0]]  # it landed
    with pytest.raises(EngineStateError, match="weights are invalid"):
        r.engine.generate(PROMPTS, SamplingParams())
    with pytest.raises(EngineStateError, match="partial update on invalid weights"):
        r.engine.update_weights(WeightExport.of([(names[1], trainer.weights[names[1]])], full=False))
    r.engine.update_weights(trainer.export_weights(full=True))
    r.engine.generate(PROMPTS, SamplingParams())
    assert engines_agree(r) and r.fake.violations == []


@pytest.mark.parametrize(
    "names, full, match",
    [
        (["model.layers.0.bogus.weight"], False, "unknown parameter"),
        ([*LORA_NAMES, LORA_NAMES[0]], False, "duplicate parameter names"),
        (list(LORA_NAMES), True, "full update misses 3 parameter"),
    ],
    ids=["unknown", "duplicate", "missing"],
)
def test_bad_names_are_rejected_before_any_weight_changes(names, full, match):
    r = make_rig()
    before = r.fake.weights_fingerprint()
    export = WeightExport(names, iter(()), full=full)
    with pytest.raises(ValueError, match=match):
        r.engine.update_weights(export)
    assert "update_weights" not in r.fake.calls and r.fake.weights_fingerprint() == before


# -- the garbage guard -----------------------------------------------------------------------
def scenario_garbage_guard_catches_weights_that_resume_lied_about() -> None:
    """An engine that lost its CPU backup but says it restored it; with LoRA only the adapted
    layers are synced, their fingerprints match, and only the greedy probe can tell."""
    r = make_rig(check_weights=True, engine={"weights_cpu_backup": True, "resume_lies": True},
                 trainer={"lora": True}).setup()  # fmt: skip
    with pytest.raises(WeightMismatch, match="check_weights: engine greedy token"):
        r.life.step(0, rollout)
    assert r.record("update_weights", 0)["info"]["full"] is False  # the fingerprints were fine
    assert r.names()[-1] == "check_weights"
    assert r.fake.garbage == set(SHAPES) - set(LORA_NAMES)


def test_garbage_guard_catches_weights_that_resume_lied_about():
    scenario_garbage_guard_catches_weights_that_resume_lied_about()


# -- every test above can fail ---------------------------------------------------------------
def _release_without_checks(self: ManagedEngine, tags):
    held = {}
    for tag in self._check_tags(tags):
        held[tag] = self.engine.tag_bytes(tag)
        self.engine.release_memory(tag)
        self.released.add(tag)
    return held


_resume = ManagedEngine.resume
_update = Colocated._update


def _resume_always_valid(self: ManagedEngine, tags):
    back = _resume(self, tags)
    self.weights_valid = True
    return back


MUTATIONS: dict[str, tuple[Any, str, Any, Callable[[], None], tuple[type[BaseException], ...]]] = {
    # name: (owner, attribute, replacement, scenario, what the scenario then raises)
    "residency_check": (lifecycle, "check_residency", lambda engine, trainer, phase: None,
                        scenario_trainer_that_keeps_its_params_breaks_residency, ()),
    "release_in_flight_check": (ManagedEngine, "release", _release_without_checks,
                                scenario_release_with_requests_in_flight_is_refused, ()),
    "release_twice_check": (ManagedEngine, "release", _release_without_checks,
                            scenario_double_release_and_resume_are_warned_no_ops, ()),
    "resume_invalidates_weights": (ManagedEngine, "resume", _resume_always_valid,
                                   scenario_generate_on_invalid_weights_is_refused, ()),
    "partial_update_check": (ManagedEngine, "check_update", lambda self, export: None,
                             scenario_partial_update_on_invalid_weights_is_refused, ()),
    "full_sync_after_invalid": (Colocated, "_update", lambda self, full: _update(self, full or False),
                                scenario_lora_step_after_resume_without_backup_syncs_the_full_weights,
                                (EngineStateError,)),
    "fingerprint_check": (engine_state, "compare_fingerprints", lambda want, got, rtol=1e-3: [],
                          scenario_update_that_did_not_land_raises, ()),
    "garbage_guard": (Colocated, "_check_probe", lambda self: {},
                      scenario_garbage_guard_catches_weights_that_resume_lied_about, ()),
}  # fmt: skip


@pytest.mark.parametrize("name", MUTATIONS)
def test_each_scenario_fails_when_its_invariant_is_removed(name, monkeypatch):
    owner, attr, replacement, scenario, raised = MUTATIONS[name]
    scenario()  # passes against the real core
    monkeypatch.setattr(owner, attr, replacement)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((AssertionError, pytest.fail.Exception, *raised)):
            scenario()


def test_the_fakes_see_the_misuse_the_core_prevents(monkeypatch):
    """Without the in-flight check, a release really happens under a running request."""
    monkeypatch.setattr(ManagedEngine, "release", _release_without_checks)
    r = make_rig()
    r.fake.hold()
    r.in_background(lambda: r.engine.generate([[1]], SamplingParams()))
    try:
        assert r.fake.started.wait(2)
        r.engine.release([TAG_KV])
    finally:
        r.join()
    assert r.fake.violations == ["release(kv_cache) with 1 request(s) running"]


def test_checkpoint_phase_saves_through_the_callback(tmp_path):
    r = make_rig().setup()
    saved: list[Path] = []

    def save(step: int) -> dict:
        if step != 1:
            return {"saved": False, "path": None}
        path = tmp_path / f"step_{step}"
        path.mkdir()
        r.trainer.save(path)
        saved.append(path)
        return {"saved": True, "path": str(path)}

    for s in range(2):
        r.life.step(s, rollout, save)
    assert [r.record("checkpoint", s)["info"]["saved"] for s in range(2)] == [False, True]
    other = FakeTrainer(FakeDevice())
    other.restore(saved[0])
    assert fingerprint(other.weights) == fingerprint(r.trainer.weights)
