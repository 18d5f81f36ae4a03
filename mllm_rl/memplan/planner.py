"""Find a backend's planner (the ``memplan`` module next to its entry point; contract:
``mllm_rl.memplan.request``; importing it must not import jax/torch) and turn its measurement into
plans, one per schedule; ``--fit``: the largest micro-batch (or sequence length), searched by
compiling (doubling, then bisecting), and the largest KV pool, solved from its layout formula once
the rest fits."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from types import ModuleType

from mllm_rl.backend_registry import GROUP, available_backends
from mllm_rl.lifecycle import SCHEDULES, SETUP_PHASES
from mllm_rl.memplan.compose import Component, Plan, compose
from mllm_rl.memplan.kv import max_pool_tokens, mem_fraction_for, pool_bytes
from mllm_rl.memplan.request import Measured, PlanRequest
from mllm_rl.phase_table import step_sequence


def load_planner(backend: str) -> ModuleType:
    """The planner module of ``backend``; ``ValueError`` (one line) if it has none."""
    eps = {ep.name: ep for ep in entry_points(group=GROUP)}
    if backend not in eps:
        have = ", ".join(available_backends()) or "none (is mllm-rl installed?)"
        raise ValueError(f"--backend {backend!r}: not installed; available: {have}")
    module = eps[backend].value.split(":")[0] + ".memplan"
    try:
        planner = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            raise ValueError(f"--backend {backend!r}: no memory planner ({module} not found)") from None
        raise ValueError(
            f"--backend {backend!r}: cannot import its planner ({e}); install the '{backend}' extra"
        ) from None
    if not callable(getattr(planner, "measure", None)):
        raise ValueError(f"--backend {backend!r}: {module} has no measure(req)")
    return planner


def step_phases(check_weights: bool = False) -> dict[str, list[str]]:
    return {s: list(step_sequence(s, check_weights)) for s in SCHEDULES}


def plans(m: Measured, req: PlanRequest, check_weights: bool = False) -> dict[str, Plan]:
    """One plan per schedule (setup phases first), ``req.schedule``'s first."""
    order = [req.schedule] + [s for s in SCHEDULES if s != req.schedule]
    inputs = dataclasses.asdict(req) | {"model": req.model.name}  # what the plan was made for (JSON-able)
    inputs.update({k: m.info[k] for k in ("kv_tokens", "mem_fraction_static") if k in m.info})
    phases = step_phases(check_weights)
    target = m.target
    if req.host_ram_gib is not None:  # the user's figure for the target's host
        target = dataclasses.replace(target, host_ram_bytes=int(req.host_ram_gib * 2**30))
    kw = {"setup": SETUP_PHASES, "backup": req.weights_cpu_backup, "snapshot": req.checkpoint_background}
    args = (m.components, m.functions, req.margin, inputs, list(m.notes))
    return {s: compose(target, s, phases[s], *args, **kw) for s in order}


def fit_kv(
    m: Measured, req: PlanRequest, check_weights: bool, cap: int | None = None
) -> tuple[Measured, PlanRequest, int, str]:
    """``m`` and ``req`` with the largest KV pool every phase leaves room for (at most ``cap``), that
    room in tokens and the tightest phase; unchanged when the room is under one token."""
    room, phase = kv_room(plans(m, req, check_weights)[req.schedule], m)
    if room < 1:
        return m, req, room, phase
    tokens = room if cap is None else min(room, cap)
    return with_kv_tokens(m, tokens), dataclasses.replace(req, kv_tokens=tokens), room, phase


def with_kv_tokens(m: Measured, tokens: int) -> Measured:
    """``m`` with a KV pool of ``tokens`` (and the ``mem_fraction_static`` that sizes it, when the
    backend says what is free at engine start)."""
    cell, pad = int(m.info["kv_cell_bytes"]), int(m.info.get("kv_pad_tokens", 0))
    b = pool_bytes(tokens, cell, pad)
    comps = dict(m.components)
    old = comps.get("kv_pool")
    detail = f"{tokens} + {pad} tokens x {cell} B/token (fitted)"
    comps["kv_pool"] = Component("kv_pool", b, old.method if old else "layout", detail)
    info = dict(m.info, kv_tokens=tokens)
    notes = list(m.notes)
    read = m.info.get("engine_forward_pool_slots")  # the compiled forward read the whole pool it had
    if read is not None and tokens > read:
        notes.append(
            f"engine forward compiled reading {read} KV slots (the pool it was measured with); with "
            f"{tokens} its prefill may read more: plan --kv-tokens {tokens} to compile it there"
        )
    free = m.info.get("engine_free_bytes")
    if free and "engine_weights" in comps:
        info["mem_fraction_static"] = mem_fraction_for(
            comps["engine_weights"].bytes_per_device, tokens * cell, free
        )
    return dataclasses.replace(m, components=comps, info=info, notes=notes)


FIT_KNOBS = {"micro_batch": 1, "seq_len": 1024}  # knob -> search granularity


@dataclasses.dataclass(frozen=True)
class Probe:
    value: int
    fits: bool
    detail: str  # one line: what decided it


def fits_without_kv(plan: Plan) -> tuple[bool, str]:
    """Does every phase fit once the KV pool is left out (the pool is sized afterwards)?"""
    rest = [(p.total - p.resident.get("kv_pool", 0), p.phase) for p in plan.phases]
    used, phase = max(rest)
    if used > plan.budget:
        return (
            False,
            f"{phase} needs {used / 2**30:.2f} GiB without the KV pool > budget {plan.budget / 2**30:.2f} GiB",
        )
    peak = max(plan.phases, key=lambda p: p.total - p.resident.get("kv_pool", 0))
    return True, f"peak without KV pool {used / 2**30:.2f} GiB in {peak.phase}"


def kv_room(plan: Plan, m: Measured) -> tuple[int, str]:
    """``(tokens, phase)``: the most KV tokens the tightest phase holding the pool leaves room for."""
    if "kv_cell_bytes" not in m.info:
        raise ValueError(
            f"backend planner for {plan.target.name} reports no kv_cell_bytes: cannot fit the KV pool"
        )
    cell, pad = int(m.info["kv_cell_bytes"]), int(m.info.get("kv_pad_tokens", 0))
    best: tuple[int, str] | None = None
    for p in plan.phases:
        if "kv_pool" not in p.resident:
            continue
        room = plan.budget - (p.total - p.resident["kv_pool"])
        tokens = max_pool_tokens(room, cell, pad)
        if best is None or tokens < best[0]:
            best = (tokens, p.phase)
    if best is None:
        raise ValueError("no phase holds a KV pool")
    return best


def search(
    fits: Callable[[int], Probe], start: int, step: int, cap: int, on_probe: Callable[[Probe], None]
) -> tuple[int | None, list[Probe]]:
    """The largest multiple of ``step`` in ``[step, cap]`` that ``fits`` (monotone): double from
    ``start`` until a miss (or ``cap``), then bisect; ``None`` if even ``step`` misses."""
    probes: list[Probe] = []

    def probe(v: int) -> bool:
        p = fits(v)
        probes.append(p)
        on_probe(p)
        return p.fits

    v = max(step, start // step * step)
    lo, hi = 0, None  # lo: largest fit so far; hi: smallest miss so far
    while True:
        if probe(v):
            lo = v
            if v >= cap:
                return lo, probes
            v = min(cap, v * 2)
        else:
            hi = v
            break
    if lo == 0:
        while hi > step:  # the start missed: go down
            v = max(step, hi // 2 // step * step)
            if probe(v):
                lo = v
                break
            hi = v
        if lo == 0:
            return None, probes
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes
