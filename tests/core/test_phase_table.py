"""The phase table (``mllm_rl.phase_table``) is the one declaration of the lifecycle's phases.

Checked here: ``Colocated`` has a handler for every phase of every sequence and none for a phase
the table does not declare, and every declared phase is run by some sequence (or by
``colocate`` / ``release_on_fault``); every sequence uses declared phases only; every sequence of
every schedule, the lease sequences included, has residency rows; ``BOTH_RESIDENT_OK`` agrees
with the table's residency. Each check is a function returning its problems, and each is shown to
report a broken table (the ``*_can_fail`` tests), so none passes by construction. That a run
records exactly these sequences is checked in ``test_lifecycle_inprocess.py`` and
``test_multitask_leases.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from mllm_rl import lifecycle, phase_table
from mllm_rl.memplan import residency
from mllm_rl.phase_table import PHASES, SCHEDULES, STEP_ALWAYS, sequences

ENGINE = {"engine_weights", "kv_pool"}
# Phases recorded outside a sequence's handlers: colocate builds the trainer, a fault's release.
OUTSIDE_HANDLERS = {"trainer_init", "release_on_fault"}


def handler_problems(handlers: dict, seqs: dict[str, phase_table.Sequence]) -> dict[str, list[str]]:
    """Phases of ``seqs`` without a handler, handlers of undeclared phases, declared phases that
    nothing runs."""
    used = {p for v in seqs.values() for p in v.phases}
    out = {
        "no handler": sorted(used - set(handlers) - OUTSIDE_HANDLERS),
        "undeclared": sorted(set(handlers) - set(PHASES)),
        "never run": sorted(set(PHASES) - used - OUTSIDE_HANDLERS),
    }
    return {k: v for k, v in out.items() if v}


def test_every_phase_of_every_sequence_has_a_handler():
    assert handler_problems(lifecycle.Colocated.HANDLERS, all_sequences()) == {}


def test_the_handler_check_can_fail():
    handlers = dict(lifecycle.Colocated.HANDLERS)
    del handlers["drain"]
    handlers["teleport"] = handlers["rollout"]
    seqs = {k: v for k, v in all_sequences().items() if not k.startswith("final_lease")}
    assert handler_problems(handlers, seqs) == {
        "no handler": ["drain"],
        "undeclared": ["teleport"],
        "never run": ["generate_result"],
    }


# -- sequences -------------------------------------------------------------------------------------
def all_sequences() -> dict[str, phase_table.Sequence]:
    out = {}
    for check in (False, True):
        out |= {f"{k}{'+check' if check else ''}": v for k, v in sequences(check).items()}
    return out


def unknown_in_sequences(seqs: dict[str, phase_table.Sequence]) -> dict[str, list[str]]:
    bad = {k: [p for p in v.phases if p not in PHASES] for k, v in seqs.items()}
    return {k: v for k, v in bad.items() if v}


def test_every_sequence_uses_table_phases_only():
    declared = {
        **{f"STEP[{s}]": phase_table.STEP[s] for s in SCHEDULES},
        "SETUP": phase_table.SETUP,
        "LEASE_SETUP": phase_table.LEASE_SETUP,
        "BUILD": phase_table.BUILD,
        "FIRST_SYNC": phase_table.FIRST_SYNC,
        "PARK": phase_table.PARK,
        "AWAKE": phase_table.AWAKE,
        "ASLEEP": phase_table.ASLEEP,
        "TRAIN_LEASE": phase_table.TRAIN_LEASE,
        "LEASE_WORK": phase_table.LEASE_WORK,
    }
    assert {k: [p for p in v if p not in PHASES] for k, v in declared.items() if set(v) - set(PHASES)} == {}
    assert unknown_in_sequences(all_sequences()) == {}
    # each schedule-specific phase is in its schedules' steps only
    for s in SCHEDULES:
        assert all(s in PHASES[p].schedules for p in phase_table.step_sequence(s, True))


def test_unknown_sequence_phase_can_fail():
    seqs = {"x": phase_table.Sequence(("rollout", "teleport"), "multi_stage", True)}
    assert unknown_in_sequences(seqs) == {"x": ["teleport"]}


def test_lifecycle_names_are_the_tables():
    assert lifecycle.SCHEDULES == SCHEDULES
    assert lifecycle.STEP_PHASES == {s: list(phase_table.STEP[s]) for s in SCHEDULES}
    assert lifecycle.SETUP_PHASES == list(phase_table.SETUP)
    assert lifecycle.LEASE_SETUP_PHASES == list(phase_table.LEASE_SETUP)
    assert lifecycle.TRAIN_LEASE_PHASES == list(phase_table.TRAIN_LEASE)
    for check in (False, True):
        for s in SCHEDULES:
            opts = lifecycle.LifecycleOptions(schedule=s, check_weights=check)
            assert lifecycle.step_phases(opts) == list(sequences(check)[f"step:{s}"].phases)
            assert lifecycle.rollout_lease_phases(opts) == list(sequences(check)["rollout_lease"].phases)
            final = lifecycle.rollout_lease_phases(opts, "generate_result")
            assert final == list(sequences(check)["final_lease"].phases)


# -- residency -------------------------------------------------------------------------------------
def missing_rows(seqs: dict[str, phase_table.Sequence]) -> list[str]:
    """Sequences whose phases ``residency.phase_rows`` cannot lay out: under their own schedule,
    and a sequence that is the same in every schedule (setup, leases) under every schedule."""
    bad = []
    for name, seq in seqs.items():
        schedules = [seq.schedule] if name.startswith("step:") else list(SCHEDULES)
        for s in schedules:
            try:
                rows = residency.phase_rows(list(seq.phases), s, seq.step)
            except KeyError as e:
                bad.append(f"{name} ({s}): {e}")
                continue
            if [r[0] for r in rows] != list(seq.phases):
                bad.append(f"{name} ({s}): rows {[r[0] for r in rows]}")
    return bad


def test_every_sequence_of_every_schedule_has_residency_rows():
    seqs = all_sequences()
    kinds = {
        "step:multi_stage",
        "step:naive",
        "setup",
        "lease_setup",
        "rollout_lease",
        "final_lease",
        "train_lease",
    }
    assert {k.removesuffix("+check") for k in seqs} == kinds
    assert missing_rows(seqs) == []


def test_missing_residency_row_can_fail(monkeypatch):
    table = dict(PHASES)
    del table["onload_trainer_params"]
    monkeypatch.setattr(residency, "PHASES", table)
    bad = missing_rows(all_sequences())
    assert bad and all("onload_trainer_params" in b for b in bad)
    assert any(b.startswith("rollout_lease (") for b in bad)


def lease_rows(name: str, check: bool = False) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    seq = sequences(check)[name]
    return residency.phase_rows(list(seq.phases), seq.schedule, seq.step)


def test_lease_rows_follow_what_colocated_does():
    """``rollout_lease`` onloads the trainer's params alone, the engine still asleep; ``park`` and
    ``train_lease`` never wake the engine; every lease ends holding nothing a release could free
    (``Colocated.check_asleep``)."""
    awake = lease_rows("rollout_lease")
    assert awake[0][0] == "onload_trainer_params"
    assert set(awake[0][1]) == {"trainer_params", *STEP_ALWAYS}
    for name in ("train_lease", "lease_setup"):
        rows = lease_rows(name)
        after_release = rows[1:] if rows[0][0] == "release_rollout" else rows
        assert not any(ENGINE & set(r[1]) for r in after_release), name
    for name in ("lease_setup", "rollout_lease", "final_lease", "train_lease"):
        for check in (False, True):
            seq = sequences(check)[name]
            *_, last = residency.phase_rows(list(seq.phases), seq.schedule, step=False)
            assert residency.end_state(last[0], last[1]) == (), name
    assert dict((r[0], r[2]) for r in lease_rows("final_lease"))["generate_result"] == ("engine_step",)


# -- BOTH_RESIDENT_OK ------------------------------------------------------------------------------
def both_at_end(seqs: dict[str, phase_table.Sequence]) -> set[str]:
    """The phases at whose end the residency rows hold trainer params and engine weights."""
    out = set()
    for seq in seqs.values():
        for name, resident, _ in residency.phase_rows(list(seq.phases), seq.schedule, seq.step):
            if {"trainer_params", "engine_weights"} <= set(residency.end_state(name, resident)):
                out.add(name)
    return out


def test_both_resident_ok_is_the_tables():
    assert lifecycle.BOTH_RESIDENT_OK == {p.name for p in PHASES.values() if p.both_resident_ok}
    assert lifecycle.BOTH_RESIDENT_OK == {
        "resume_weights",
        "update_weights",
        "resume_rollout",
        "weights_swapped",
    }


def test_both_resident_ok_agrees_with_the_residency_rows():
    """Allowed exactly where the table's own rows end with both (no row breaks the lifecycle's
    check, no permission is granted that no row needs)."""
    assert both_at_end(all_sequences()) == set(phase_table.BOTH_RESIDENT_OK)


def test_residency_disagreement_can_fail(monkeypatch):
    table = dict(PHASES)
    kept = table["offload_trainer_params"]
    table["offload_trainer_params"] = dataclasses.replace(kept, drops=("staging",))  # forgets the params
    monkeypatch.setattr(residency, "PHASES", table)
    assert "offload_trainer_params" in both_at_end(all_sequences()) - set(phase_table.BOTH_RESIDENT_OK)


@pytest.mark.parametrize("bad", [{"resident": ("teleporter",)}, {"functions": ("warp",)}, {"inherit": "x"}])
def test_a_phase_declaration_is_validated(bad):
    with pytest.raises(ValueError):
        phase_table.Phase("p", "doc", **bad)


def test_a_phase_that_runs_a_compiled_function_has_the_full_watchdog_limit():
    from mllm_rl.phases.watchdog import HEAVY_PHASES, PhaseLimits

    assert {p.name for p in PHASES.values() if p.functions} <= phase_table.HEAVY <= HEAVY_PHASES
    limits = PhaseLimits(base_s=100.0)
    assert limits.limit("train_step") == 100.0 and limits.limit("drain") < 100.0
