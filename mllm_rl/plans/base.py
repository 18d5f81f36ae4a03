"""The plan interface: what ``python -m mllm_rl.run --plan NAME`` runs. A plan turns the flags into
typed options, checks what it can before the run exists, says what ``run.json`` records and runs
its phases; ``mllm_rl.run`` does the rest (runtime, run directory, sinks, watchdog, report). Also
the plans ``--plan`` chooses from, by name, each imported only when asked for, and the setup
phases every plan starts with: ``wandb_init``, ``<backend>_ready``, ``engine_ready_dummy`` (a
rollout engine with dummy weights, behind ``ManagedEngine``)."""

from __future__ import annotations

import abc
import argparse
import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from mllm_rl.engine_state import ManagedEngine
from mllm_rl.hugepages import state as hugepages_state
from mllm_rl.options.schema import BY_KEY
from mllm_rl.progress import waiting

if TYPE_CHECKING:
    from mllm_rl.backend import Backend
    from mllm_rl.checkpoint.model_dir import ModelDir
    from mllm_rl.engine import EngineOptions
    from mllm_rl.phases.recorder import PhaseRecorder, Sink


@dataclasses.dataclass
class PlanRun:
    """What a plan runs with, once the runtime, run directory and recorder exist."""

    backend: Backend
    rec: PhaseRecorder
    model: ModelDir
    make_wandb: Callable[[], Sink | None]  # the W&B sink (``None``: disabled), made in ``wandb_init``
    run_dir: Path
    runtime: dict[str, Any]  # what ``backend.init_runtime`` returned
    on_engine: Callable[[Any], None]  # gets each engine as it exists (the caller shuts it down)
    on_started: Callable[[], None]  # once the setup is done (a resumed run rewrites run.json then)
    # run.json with these fields over what the run writes itself (process 0 writes; others ignore)
    write_run_json: Callable[[dict[str, Any]], None] = lambda extra: None
    process_index: int = 0


OptionsT = TypeVar("OptionsT")  # a plan's typed options (RLOptions, SwapOptions, MultitaskOptions)


class Plan(abc.ABC, Generic[OptionsT]):
    """One way of running: its options, checks, expected phases and phases."""

    name: ClassVar[str]  # the --plan value
    summary: ClassVar[str]  # one line for --help
    scope: ClassVar[str]  # the options it takes (``mllm_rl.options.schema``): usually its name
    tasks: ClassVar[bool] = False  # records name their task (phase schema v2: multi-task runs)

    @abc.abstractmethod
    def options(self, args: argparse.Namespace, engine: EngineOptions, platform: str) -> OptionsT:
        """The plan's typed options from the flags (``engine``: shared by every plan); ``ValueError``
        naming a flag whose value or presence this plan refuses."""

    def preflight(
        self, args: argparse.Namespace, opts: OptionsT, backend: Backend, run_dir: Path
    ) -> tuple[OptionsT, list[str]]:
        """Checks that read files (resume target, data): the options to run with and lines to tell the
        user; ``ValueError`` / ``CheckpointError`` refuse."""
        return opts, []

    def with_model(self, opts: OptionsT, model: ModelDir) -> tuple[OptionsT, list[str]]:
        """The options once the model is known (e.g. its learning rate), and lines to tell the user."""
        return opts, []

    def resolve_model(
        self, args: argparse.Namespace, opts: OptionsT
    ) -> tuple[OptionsT, ModelDir | None, list[str]]:
        """The ``--model`` (``ModelDir``), checked against ``--tp``, and ``with_model``'s options."""
        from mllm_rl.checkpoint.resolve import resolve_model

        model = resolve_model(args.model, seed=args.seed)
        model.check_tp(opts.engine.tp)  # heads divisible by --tp; devices are checked once the runtime is up
        opts, notes = self.with_model(opts, model)
        return opts, model, notes

    def require_release(self, backend: Backend, process_count: int) -> None:
        """A plan that releases its engine refuses a run across processes whose engine cannot."""
        if process_count > 1 and not backend.releases_across_processes:
            raise ValueError(
                f"{process_count} processes: the {backend.name} backend's engine cannot pause and "
                f"release across processes yet, which --plan {self.name} needs; run it as one process "
                f"(the swap plan runs across processes)"
            )

    def memory_plan(
        self, backend: Backend, model: ModelDir | None, opts: OptionsT, runtime: dict[str, Any]
    ) -> tuple[OptionsT, Any, list[str]]:
        """The run's memory plan (``mllm_rl.memplan.for_run``): options, ``RunPlan`` (None: not
        planned, the default) and lines to tell the user; ``DoesNotFit`` (exit 6) refuses the run."""
        return opts, None, []

    def check_runtime(
        self, backend: Backend, model: ModelDir | None, opts: OptionsT, process_count: int
    ) -> None:
        """Checks once the runtime is up: the engine options against the devices (``ValueError``)."""
        backend.check_engine_args(model, opts.engine)

    @abc.abstractmethod
    def phase_names(self) -> set[str]:
        """Every phase name this plan may record (``{ready}`` for the backend's ready phase)."""

    @abc.abstractmethod
    def run_json(self, backend: Backend, opts: OptionsT) -> dict[str, Any]:
        """``run.json``'s plan fields: at least ``steps``, ``expected_phases``, ``expected_step_phases``."""

    @abc.abstractmethod
    def run(self, ctx: PlanRun, opts: OptionsT) -> dict[str, Any]:
        """Record the plan's phases; returns a summary (``history``: per-step metrics, if any)."""


# name -> "module:attribute" of its ``Plan`` instance; the first is the default
PLANS = {
    "rl": "mllm_rl.plans.rl:PLAN",
    "swap": "mllm_rl.plans.swap:PLAN",
    "multitask": "mllm_rl.multitask.plan:PLAN",
}
TASKS_PLAN = "multitask"  # run by ``--tasks FILE``, not by a --plan value
DEFAULT_PLAN = BY_KEY["plan"].default  # declared with the option (``mllm_rl.options.schema``)


def plan_names() -> list[str]:
    """What ``--plan`` offers (a multi-task run is chosen by ``--tasks``)."""
    return [n for n in PLANS if n != TASKS_PLAN]


def plan_of(args: Any) -> Plan:
    """The plan a command line runs: ``--tasks`` or ``--plan``."""
    return get_plan(TASKS_PLAN if getattr(args, "tasks", None) else args.plan)


def get_plan(name: str) -> Plan:
    """The plan called ``name``; ``ValueError`` (one line) when there is none."""
    if name not in PLANS:
        raise ValueError(f"--plan {name!r}: choose one of {', '.join(plan_names())}")
    module, attr = PLANS[name].split(":")
    plan = getattr(importlib.import_module(module), attr)
    if not isinstance(plan, Plan) or plan.name != name:
        raise TypeError(f"{PLANS[name]} is not the Plan {name!r}")
    return plan


def all_plans() -> list[Plan]:
    return [get_plan(n) for n in PLANS]


def run_level(
    backend: Any,
    rec: PhaseRecorder,
    make_wandb: Callable[[], Sink | None],
    runtime: dict[str, Any],
    **info: Any,
) -> None:
    """``wandb_init`` (the W&B sink joins the recorder) and ``<backend>_ready`` (installs the probe)."""
    with rec.phase("wandb_init", **info) as ph, waiting("W&B start"):
        sink = make_wandb()
        if sink is not None:
            rec.sinks.append(sink)
            ph.info["wandb_dir"] = getattr(sink, "offline_dir", None)
            ph.info["wandb_mode"] = getattr(sink, "mode", None)
            if getattr(sink, "fallback_reason", None):
                ph.info["wandb_fallback"] = sink.fallback_reason
        ph.info["wandb"] = "disabled" if sink is None else "enabled"
    with rec.phase(backend.ready_phase) as ph:
        ph.info.update(runtime, hugepages=hugepages_state())
        rec.set_probe(backend.memory_probe())


def start(
    backend: Any,
    rec: PhaseRecorder,
    model: ModelDir,
    make_wandb: Callable[[], Sink | None],
    runtime: dict[str, Any],
    engine_opts: EngineOptions,
    on_engine: Callable[[Any], None],
    **wandb_info: Any,
) -> ManagedEngine:
    """Record the three setup phases; the engine (also to ``on_engine`` as soon as it exists)."""
    run_level(backend, rec, make_wandb, runtime, **wandb_info)
    with rec.phase("engine_ready_dummy", model=str(model.path), tp=engine_opts.tp) as ph:
        with waiting("engine start"):
            engine = ManagedEngine(backend.create_engine(model, engine_opts))
        on_engine(engine)
        ph.info.update(engine_info(engine))
        opts = dataclasses.asdict(engine_opts)
        for key in ("context_length", "max_total_tokens", "max_running_requests"):
            if opts[key] is not None:
                ph.info[key] = opts[key]
    return engine


def engine_info(engine: ManagedEngine) -> dict[str, Any]:
    """What ``engine_ready_dummy`` records of the engine it started."""
    return {
        "engine_weight_bytes": engine.weight_bytes(),
        "engine": type(engine.engine).__name__,
        "tags": list(engine.tags),
        "weights_cpu_backup": engine.weights_cpu_backup,
    }
