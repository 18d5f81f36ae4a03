"""The plan interface: what ``python -m mllm_rl.run --plan NAME`` runs. A plan turns the flags into
typed options, checks what it can before the run exists, says what ``run.json`` records and runs
its phases; ``mllm_rl.run`` does the rest (runtime, run directory, sinks, watchdog, report)."""

from __future__ import annotations

import abc
import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

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
