"""Compose a memory plan (pure): per phase, the resident components' bytes per device plus the
largest compiled function's ``peak - arguments`` (its inputs are resident already), against the
device's memory; rows from ``residency.phase_rows``."""

from __future__ import annotations

import dataclasses
from typing import Any

from mllm_rl.memplan.residency import end_state, host_rows, phase_rows
from mllm_rl.phase_table import COMPONENTS
from mllm_rl.text_table import aligned

GIB = 1024**3
SCHEMA = "mllm_rl.memplan/1"


@dataclasses.dataclass(frozen=True)
class Target:
    """A device topology a plan is made for; ``hbm_bytes``: one device's memory, from ``source``."""

    name: str  # e.g. "v4-8", "h100x8", "cpu"
    platform: str  # "tpu" | "gpu" | "cpu"
    num_devices: int
    num_hosts: int
    hbm_bytes: int
    device_kind: str
    source: str
    host_ram_bytes: int | None = None  # one host's RAM, where known (this machine's: psutil)

    @property
    def devices_per_host(self) -> int:
        return max(1, self.num_devices // max(1, self.num_hosts))


CHECKPOINT_COPY = "checkpoint_copy"  # a host row's background checkpoint copy (compose's ``snapshot``)


@dataclasses.dataclass(frozen=True)
class Component:
    name: str  # one of phase_table.COMPONENTS
    bytes_per_device: int
    method: str  # "layout" | "compiler" | "fake_tensor"
    detail: str = ""
    # "device": on the device in its row's phases, on the host while offloaded; "host": always on
    # the host (e.g. an optimizer state streamed through the device by the update's function)
    memory: str = "device"

    def __post_init__(self) -> None:
        if self.name not in COMPONENTS:
            raise ValueError(f"Component.name {self.name!r}: expected one of {', '.join(COMPONENTS)}")
        if self.bytes_per_device < 0:
            raise ValueError(f"Component {self.name}: bytes_per_device must be >= 0")
        if self.memory not in ("device", "host"):
            raise ValueError(f"Component {self.name}: memory {self.memory!r}: expected device or host")


@dataclasses.dataclass(frozen=True)
class FunctionMemory:
    """One compiled function's memory per device; ``peak_bytes`` includes the arguments."""

    name: str  # one of phase_table.FUNCTIONS
    peak_bytes: int
    argument_bytes: int
    output_bytes: int = 0
    temp_bytes: int = 0
    alias_bytes: int = 0
    compile_seconds: float | None = None
    method: str = "compiler"
    detail: str = ""
    rejected: str = ""  # the compiler refused it (does not fit alone): its message; peak_bytes >= the memory

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak_bytes - self.argument_bytes)


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    phase: str
    resident: dict[str, int]  # component -> bytes per device
    function: str | None  # the function whose extra bytes set this phase's peak
    function_extra: int
    total: int
    # the lifecycle's host copies (residency.host_rows), bytes per host: during the phase / at its end
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    host_end: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def overflow(self, budget: int) -> str | None:
        """The component that crosses ``budget`` first in this phase's sum (None: it fits)."""
        if self.total <= budget:
            return None
        acc = 0
        for name, b in list(self.resident.items()) + [(f"temp:{self.function}", self.function_extra)]:
            acc += b
            if acc > budget:
                return name
        return None  # unreachable: total > budget


@dataclasses.dataclass(frozen=True)
class Plan:
    target: Target
    schedule: str
    margin: float  # the fraction of device memory a phase may use (e.g. 0.9)
    components: dict[str, Component]
    functions: dict[str, FunctionMemory]
    phases: list[PhasePlan]
    inputs: dict[str, Any]  # model, batch, mesh, ... (what the plan was made for)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def budget(self) -> int:
        return int(self.target.hbm_bytes * self.margin)

    @property
    def peak(self) -> PhasePlan:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return all(p.total <= self.budget for p in self.phases)

    def host_ram_used(self, p: PhasePlan) -> int:
        """One host's RAM that phase ``p`` takes: its host copies (and the devices' bytes on a CPU target)."""
        devices = p.total * self.target.devices_per_host if self.target.platform == "cpu" else 0
        return p.host_total + devices

    @property
    def host_peak(self) -> PhasePlan:
        return max(self.phases, key=self.host_ram_used)

    @property
    def host_fits(self) -> bool | None:
        """Every phase within ``margin`` of the host's RAM; None where the target's RAM is unknown."""
        ram = self.target.host_ram_bytes
        if not ram:
            return None
        return all(self.host_ram_used(p) <= ram * self.margin for p in self.phases)

    def first_overflow(self) -> tuple[str, str] | None:
        """``(phase, component)`` of the first phase over budget, in schedule order."""
        for p in self.phases:
            comp = p.overflow(self.budget)
            if comp is not None:
                return p.phase, comp
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kind": "predicted",
            "target": dataclasses.asdict(self.target),
            "schedule": self.schedule,
            "margin": self.margin,
            "budget_bytes": self.budget,
            "fits": self.fits,
            "first_overflow": self.first_overflow(),
            "peak_phase": self.peak.phase,
            "peak_bytes": self.peak.total,
            "components": {k: dataclasses.asdict(v) for k, v in self.components.items()},
            "functions": {
                k: dict(dataclasses.asdict(v), extra_bytes=v.extra_bytes) for k, v in self.functions.items()
            },
            "phases": [dataclasses.asdict(p) for p in self.phases],
            "host": {
                "ram_bytes": self.target.host_ram_bytes,
                "peak_phase": self.host_peak.phase,
                "peak_bytes": self.host_ram_used(self.host_peak),
                "fits": self.host_fits,
            },
            "inputs": self.inputs,
            "notes": self.notes,
        }


SETUP_PREFIX = "setup:"


def compose(
    target: Target,
    schedule: str,
    phases: list[str],
    components: dict[str, Component],
    functions: dict[str, FunctionMemory],
    margin: float = 0.9,
    inputs: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    setup: list[str] | None = None,
    backup: bool = False,
    snapshot: bool = False,
) -> Plan:
    """Lay ``components`` and ``functions`` over ``phases`` of ``schedule`` (``setup`` phases first,
    as ``setup:<phase>``; absent ones count nothing). Each phase gets its host copies per host
    (``residency.host_rows``; ``backup``: the engine's copy of released weights; a ``memory ==
    "host"`` component is only there); ``snapshot``: the background checkpoint's copy of the
    trainer state, ``checkpoint_copy``, in every step phase (its write may end a step later)."""
    if not 0 < margin <= 1:
        raise ValueError(f"margin {margin}: expected 0 < margin <= 1")
    rows = []
    ref = components.get("ref_params") is not None and components["ref_params"].bytes_per_device > 0
    per_host = target.devices_per_host
    tables = [(SETUP_PREFIX, setup, "multi_stage", False)] if setup else []
    tables.append(("", phases, schedule, True))

    pinned = tuple(c for c, comp in components.items() if comp.memory == "host")
    copy = sum(components[c].bytes_per_device for c in ("trainer_params", "optimizer") if c in components)

    def on_host(names: tuple[str, ...], resident: tuple[str, ...]) -> dict[str, int]:
        names = names + tuple(c for c in pinned if c in resident and c not in names)
        return {c: components[c].bytes_per_device * per_host for c in names if c in components}

    for prefix, names, sched, step in tables:
        table, hosts = phase_rows(names, sched, step=step), host_rows(names, sched, step, backup, ref)
        for (name, resident, fns), (_, during, at_end) in zip(table, hosts, strict=True):
            ends = end_state(name, resident)
            host, host_end = on_host(during, resident), on_host(at_end, ends)
            if snapshot and not prefix and copy:
                host[CHECKPOINT_COPY] = host_end[CHECKPOINT_COPY] = copy * per_host
            res = {c: components[c].bytes_per_device for c in resident if c in components and c not in pinned}
            best, extra = None, 0
            for f in fns:
                if f in functions and functions[f].extra_bytes >= extra:
                    best, extra = f, functions[f].extra_bytes
            total = sum(res.values()) + extra
            rows.append(PhasePlan(prefix + name, res, best, extra, total, host, host_end))
    inputs, notes = dict(inputs or {}), list(notes or [])
    return Plan(target, schedule, margin, dict(components), dict(functions), rows, inputs, notes)


def unit_for(b: int) -> tuple[str, int]:
    """``("GiB", 2**30)`` for figures of a GiB or more, else ``("MiB", 2**20)``."""
    return ("GiB", GIB) if b >= GIB else ("MiB", 2**20)


def fmt(b: int, scale: int) -> str:
    return f"{b / scale:.2f}"


def format_table(plan: Plan) -> str:
    """Phase x component per device (GiB, or MiB for a small plan) against the budget; the last
    column the phase's host copies per host."""
    unit, scale = unit_for(plan.peak.total)
    used = [c for c in COMPONENTS if any(c in p.resident for p in plan.phases)]
    head = ["phase"] + used + ["temp", "total", "of HBM", "host"]
    rows = [head]
    for p in plan.phases:
        cells = [p.phase] + [fmt(p.resident[c], scale) if c in p.resident else "-" for c in used]
        temp = f"{fmt(p.function_extra, scale)} ({p.function})" if p.function else "-"
        mark = "" if p.total <= plan.budget else "  OVER"
        host = fmt(p.host_total, scale) if p.host_total else "-"
        rows.append(cells + [temp, fmt(p.total, scale), f"{p.total / plan.target.hbm_bytes:.0%}{mark}", host])
    lines = aligned(rows)
    t = plan.target
    title = (
        f"PREDICTED memory plan, {plan.schedule} schedule, {t.name} ({t.num_devices} x {t.device_kind}, "
        f"{fmt(t.hbm_bytes, GIB)} GiB per device from {t.source}); {unit} per device; budget "
        f"{plan.margin:.0%} = {fmt(plan.budget, GIB)} GiB"
    )
    verdict = (
        f"fits: peak {fmt(plan.peak.total, scale)} {unit} in {plan.peak.phase}"
        if plan.fits
        else "DOES NOT FIT: {} overflows in {}".format(*reversed(plan.first_overflow() or ("?", "?")))
    )
    return "\n".join([title, *lines, verdict, host_line(plan)])


def host_line(plan: Plan) -> str:
    """The host-memory verdict: the largest phase's RAM per host against the host's RAM."""
    peak = plan.host_peak
    used = plan.host_ram_used(peak)
    unit, scale = unit_for(used)
    what = "host copies" + (" and the CPU devices' bytes" if plan.target.platform == "cpu" else "")
    head = f"host ({what}, per host): peak {fmt(used, scale)} {unit} in {peak.phase}"
    ram = plan.target.host_ram_bytes
    if not ram:
        return head + "; the target's host RAM is not known here"
    verdict = "fits" if plan.host_fits else "OVER"
    return f"{head} of {fmt(ram, GIB)} GiB RAM ({used / ram:.0%}): {verdict} (budget {plan.margin:.0%})"
