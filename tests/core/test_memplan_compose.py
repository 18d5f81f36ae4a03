"""The backend-neutral memory-plan core: residency table and composition."""

from __future__ import annotations

import pytest

from mllm_rl.lifecycle import SETUP_PHASES, STEP_PHASES
from mllm_rl.memplan.compose import GIB, Component, FunctionMemory, Target, compose, format_table
from mllm_rl.memplan.kv import kv_cell_bytes, kv_tokens
from mllm_rl.memplan.residency import phase_rows

TARGET = Target("t", "tpu", 4, 1, 10 * GIB, "fake device", "test")


def comps(**gib: float) -> dict[str, Component]:
    return {k: Component(k, int(v * GIB), "layout") for k, v in gib.items()}


@pytest.mark.parametrize("schedule", list(STEP_PHASES))
def test_every_lifecycle_phase_has_a_residency_row(schedule):
    rows = phase_rows(STEP_PHASES[schedule] + ["check_weights"], schedule)
    assert [r[0] for r in rows] == STEP_PHASES[schedule] + ["check_weights"]
    phase_rows(SETUP_PHASES, "multi_stage")


def test_unknown_phase_is_refused():
    with pytest.raises(KeyError, match="no residency row"):
        phase_rows(["rollout", "teleport"], "multi_stage")


def test_multi_stage_never_stacks_kv_with_trainer_but_naive_does():
    c = comps(engine_weights=2, kv_pool=4, trainer_params=2, optimizer=4, grads=2, staging=0.1)
    fns = {"grad_step": FunctionMemory("grad_step", peak_bytes=5 * GIB, argument_bytes=2 * GIB)}
    ms = compose(TARGET, "multi_stage", STEP_PHASES["multi_stage"], c, fns)
    naive = compose(TARGET, "naive", STEP_PHASES["naive"], c, fns)
    by = {p.phase: p for p in ms.phases}
    assert by["train_step"].total == int(2 * GIB) + int(4 * GIB) + int(2 * GIB) + 3 * GIB
    assert by["update_weights"].total == int(2 * GIB) * 2 + int(0.1 * GIB)
    assert "kv_pool" not in by["update_weights"].resident
    nby = {p.phase: p for p in naive.phases}
    assert nby["update_weights"].resident["kv_pool"] == int(4 * GIB)
    # empty_cache after offload_optimizer keeps only the trainer params
    empties = [p for p in ms.phases if p.phase == "empty_cache"]
    assert list(empties[0].resident) == ["trainer_params"]
    assert list(empties[1].resident) == ["engine_weights"]
    assert ms.peak.phase == "train_step" and not ms.fits  # 11 GiB > 9 GiB budget
    assert ms.first_overflow() == ("train_step", "temp:grad_step")
    assert "DOES NOT FIT: temp:grad_step overflows in train_step" in format_table(ms)


def test_fits_and_json():
    c = comps(engine_weights=1, kv_pool=1, trainer_params=1, optimizer=2)
    plan = compose(TARGET, "multi_stage", STEP_PHASES["multi_stage"], c, {}, inputs={"model": "m"})
    assert plan.fits and plan.first_overflow() is None
    js = plan.to_json()
    assert js["kind"] == "predicted" and js["fits"] and js["inputs"] == {"model": "m"}
    assert len(js["phases"]) == len(STEP_PHASES["multi_stage"])


def test_bad_component_and_margin():
    with pytest.raises(ValueError, match="Component.name"):
        Component("activations", 1, "layout")
    with pytest.raises(ValueError, match="margin"):
        compose(TARGET, "multi_stage", ["rollout"], {}, {}, margin=1.5)


def test_kv_cell_sglang_jax_rule():
    # Qwen3-4B: 36 layers, 8 kv heads, head_dim 128, bf16, tp 4 -> 2 heads per shard
    assert kv_cell_bytes(36, 8, 128, 2, tp=4, head_dim_align=128) == 2 * 128 * 2 * 36 * 2
    # head_dim 64 pads to 128 under the sglang-jax rule, not under SGLang's
    assert kv_cell_bytes(2, 2, 64, 4, head_dim_align=128) == 2 * kv_cell_bytes(2, 2, 64, 4)
    # tp beyond the kv heads replicates one head per shard
    assert kv_cell_bytes(2, 2, 128, 2, tp=8) == kv_cell_bytes(2, 1, 128, 2)
    assert kv_tokens(10_000, 100) == 100 and kv_tokens(1, 0) == 0


# -- host memory ------------------------------------------------------------------------------------
def _host(schedule, step=True, **kw):
    from mllm_rl.memplan.residency import host_rows
    from mllm_rl.phase_table import SETUP, step_sequence

    phases = list(step_sequence(schedule)) if step else list(SETUP)
    return {name: (set(during), set(end)) for name, during, end in host_rows(phases, schedule, step, **kw)}


def test_host_rows_follow_the_offloads_and_the_engine_backup():
    """The trainer's state is on the host while offloaded (both copies during an offload or an onload);
    the engine's weight backup from its release to its resume, with --weights-cpu-backup only."""
    t, o, e = "trainer_params", "optimizer", "engine_weights"
    h = _host("multi_stage", backup=True)
    assert h["rollout"] == ({t, o}, {t, o})
    assert h["release_rollout"] == ({t, o, e}, {t, o, e})
    assert h["onload_trainer"] == ({t, o, e}, {e})  # the host copies go when the onload ends
    assert h["train_step"] == ({e}, {e})
    assert h["offload_optimizer"] == ({o, e}, {o, e})
    assert h["resume_weights"] == ({o, e}, {o})  # the backup is restored and freed
    assert h["update_weights"] == ({o}, {o})
    assert h["offload_trainer_params"] == ({t, o}, {t, o})
    assert all(e not in during for during, _ in _host("multi_stage").values())  # no backup asked
    naive = _host("naive", backup=True)
    assert naive["resume_rollout"] == ({o, e}, {o})
    setup = _host("multi_stage", step=False, ref=True)
    assert setup["release_rollout"] == (set(), set())  # no trainer yet, no backup asked
    assert setup["trainer_init"] == ({"ref_params"}, {"ref_params"})
    assert setup["offload_trainer_params"] == ({t, o, "ref_params"}, {t, o, "ref_params"})


def test_host_bytes_are_per_host_and_checked_against_its_ram():
    """Per-device bytes times the devices of a host; on a CPU target the devices' bytes are the
    host's RAM too; a target without a known RAM has no host verdict."""
    c = comps(engine_weights=2, kv_pool=4, trainer_params=2, optimizer=4, grads=2, staging=0.1)
    two_hosts = Target("t2", "tpu", 8, 2, 10 * GIB, "fake device", "test")  # 4 devices per host
    p = compose(two_hosts, "multi_stage", STEP_PHASES["multi_stage"], c, {})
    by = {x.phase: x for x in p.phases}
    assert by["rollout"].host == {"trainer_params": int(2 * GIB) * 4, "optimizer": int(4 * GIB) * 4}
    assert p.host_fits is None and "not known" in format_table(p)
    assert p.to_json()["host"]["peak_bytes"] == 24 * GIB
    cpu = Target("c", "cpu", 1, 1, 100 * GIB, "CPU", "test", host_ram_bytes=100 * GIB)
    q = compose(cpu, "multi_stage", STEP_PHASES["multi_stage"], c, {})
    rollout = {x.phase: x for x in q.phases}["rollout"]
    assert q.host_ram_used(rollout) == rollout.host_total + rollout.total  # the CPU devices are the RAM
    assert q.host_fits is True
    small = Target("c", "cpu", 1, 1, 100 * GIB, "CPU", "test", host_ram_bytes=12 * GIB)
    assert compose(small, "multi_stage", STEP_PHASES["multi_stage"], c, {}).host_fits is False


def test_a_host_resident_component_is_in_every_host_row_and_no_device_row():
    """``Component(memory="host")`` (an optimizer kept on the host and streamed by its update): no
    device row holds it; from the phase the trainer starts in, every phase's host copies do, during
    and at its end; the device totals are those of the same plan without it."""
    c = comps(engine_weights=1, kv_pool=1, trainer_params=1, optimizer=2)
    dev = compose(TARGET, "multi_stage", STEP_PHASES["multi_stage"], c, {}, setup=SETUP_PHASES)
    c["optimizer"] = Component("optimizer", 2 * GIB, "layout", memory="host")
    host = compose(TARGET, "multi_stage", STEP_PHASES["multi_stage"], c, {}, setup=SETUP_PHASES)
    per_host = 2 * GIB * TARGET.devices_per_host
    started = False
    for d, h in zip(dev.phases, host.phases, strict=True):
        started = started or h.phase == "setup:trainer_init"
        assert "optimizer" not in h.resident
        assert h.total == d.total - d.resident.get("optimizer", 0), h.phase
        assert (h.host.get("optimizer") == per_host) == started, h.phase
        assert (h.host_end.get("optimizer") == per_host) == started, h.phase
    assert any("optimizer" in d.resident for d in dev.phases)
    with pytest.raises(ValueError, match="memory 'disk'"):
        Component("optimizer", 1, "layout", memory="disk")


def test_a_background_checkpoint_copy_is_in_every_step_host_row(tmp_path):
    """``--checkpoint-background`` (``snapshot``): the trainer's params and optimizer state copied to
    the host, per host, during and at the end of every step phase (a write may outlast its step),
    never in the setup; the device rows unchanged. The run's request carries the option only when
    the run checkpoints at all."""
    from types import SimpleNamespace

    from mllm_rl.memplan.compose import CHECKPOINT_COPY

    c = comps(engine_weights=1, kv_pool=1, trainer_params=1, optimizer=2)
    steps = STEP_PHASES["multi_stage"]
    plain = compose(TARGET, "multi_stage", steps, c, {}, setup=SETUP_PHASES)
    snap = compose(TARGET, "multi_stage", steps, c, {}, setup=SETUP_PHASES, snapshot=True)
    copy = 3 * GIB * TARGET.devices_per_host
    for p, s in zip(plain.phases, snap.phases, strict=True):
        assert s.resident == p.resident and s.total == p.total, s.phase
        want = 0 if s.phase.startswith("setup:") else copy
        assert s.host.get(CHECKPOINT_COPY, 0) == s.host_end.get(CHECKPOINT_COPY, 0) == want, s.phase
        assert s.host_total == p.host_total + want, s.phase
    assert snap.to_json()["host"]["peak_bytes"] == plain.to_json()["host"]["peak_bytes"] + copy

    from mllm_rl.memplan.for_run import request_for

    model = SimpleNamespace(config=SimpleNamespace(torch_dtype="bfloat16"))
    train = SimpleNamespace(mini_batches=1, micro_batch_size=4, lora_rank=0, loss=SimpleNamespace(beta=0.0),
                            precision="mixed", trainer_tp=1, fsdp=0, model_options={})  # fmt: skip
    eng = SimpleNamespace(context_length=64, tp=1, max_total_tokens=None, mem_fraction_static=None,
                          max_running_requests=8, weights_cpu_backup=False)  # fmt: skip
    for every, background, want in ((5, True, True), (0, True, False), (5, False, False)):
        opts = SimpleNamespace(prompts_per_step=2, group_size=2, train=train, engine=eng,
                               lifecycle=SimpleNamespace(schedule="multi_stage"),
                               checkpoint_every=every, checkpoint_background=background)  # fmt: skip
        assert request_for("jax", "cpu", model, opts).checkpoint_background is want
