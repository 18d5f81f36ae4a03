"""``--fit``: the largest micro-batch (or sequence length), searched by compiling (doubling, then
bisecting), and the largest KV pool, solved from its layout formula once the rest fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mllm_rl.memplan.compose import Plan
from mllm_rl.memplan.kv import max_pool_tokens
from mllm_rl.memplan.request import Measured

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
