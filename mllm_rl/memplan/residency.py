"""What is resident on every device (and in host memory) during each phase of a colocated step:
rows from ``mllm_rl.phase_table``, the components on the device at some point *during* a phase and
the compiled functions that run in it."""

from __future__ import annotations

from mllm_rl.phase_table import INHERIT_DURING, INHERIT_END, PHASES, SCHEDULES, STEP_ALWAYS

# What the lifecycle keeps in host memory while its device copy is gone (a run's own host RAM, beside
# the process's baseline): offloaded trainer state, the engine's weight backup, a KL reference.
HOST_COMPONENTS = ("trainer_params", "optimizer", "engine_weights", "ref_params")
_MOVED = ("trainer_params", "optimizer", "engine_weights")


def phase_rows(
    phases: list[str], schedule: str, step: bool = True
) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """``[(phase, resident components, functions)]`` of ``phases`` (``step``: ``STEP_ALWAYS`` in
    each); an inheriting phase holds what the one before left. ``KeyError`` for an unknown phase."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: expected multi_stage or naive")
    rows = []
    prev_during: tuple[str, ...] = ()
    prev_end: tuple[str, ...] = ()
    for name in phases:
        p = PHASES.get(name)
        if p is None or schedule not in p.schedules:
            raise KeyError(
                f"phase {name!r} has no residency row in mllm_rl.memplan.residency (mllm_rl.phase_table)"
            )
        if p.inherit == INHERIT_END:
            resident = prev_end
        elif p.inherit == INHERIT_DURING:
            resident = prev_during
        else:
            resident = p.row(schedule)
        prev_during, prev_end = resident, end_state(name, resident)
        if step:
            resident = resident + tuple(c for c in STEP_ALWAYS if c not in resident)
        rows.append((name, resident, p.functions))
    return rows


def end_state(phase: str, resident: tuple[str, ...]) -> tuple[str, ...]:
    """What is still resident when ``phase`` ends (what its record's ``bytes_in_use`` shows)."""
    p = PHASES.get(phase)
    drop = p.drops if p is not None else ()
    return tuple(c for c in resident if c not in drop)


def host_rows(
    phases: list[str], schedule: str, step: bool = True, backup: bool = False, ref: bool = False
) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """``[(phase, host components during it, at its end)]``: trainer state from ``offload_*`` until
    onloaded (both copies during the move), ``engine_weights`` while released with ``backup``,
    ``ref_params`` with ``ref`` throughout. ``step``: a step's phases (after its own last), else setup."""
    dev = phase_rows(phases, schedule, step=False)
    moved = [c for c in _MOVED if c != "engine_weights" or backup]
    if step:
        prev_end = end_state(dev[-1][0], dev[-1][1])
        exists = set(_MOVED)
    else:
        prev_end = ("engine_weights", "kv_pool")
        exists = {"engine_weights"}
    rows = []
    for name, resident, _ in dev:
        drops = PHASES[name].drops
        during = {c for c in moved if c in exists and (c not in prev_end or (c in resident and c in drops))}
        exists |= set(resident)
        end = end_state(name, resident)
        at_end = {c for c in moved if c in exists and c not in end}
        if ref and "trainer_params" in exists:
            during.add("ref_params")
            at_end.add("ref_params")
        rows.append((name, _ordered(during), _ordered(at_end)))
        prev_end = end
    return rows


def _ordered(names: set[str]) -> tuple[str, ...]:
    return tuple(c for c in HOST_COMPONENTS if c in names)
