"""One RL task of a multi-task run: its own model, engine, trainer, data, seed and checkpoints.

The single-task plan's pieces (``mllm_rl.plans.rl``), driven lease by lease through ``Colocated``;
every record it makes carries its name (``rec.for_task``). Checkpoints live in
``<run_dir>/tasks/<name>/checkpoints``; a resumed task restarts after its own last one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mllm_rl.backend import Backend
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.checkpoint.resolve import RLCheckpoint, find_resumable
from mllm_rl.engine import EngineOptions
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.faults import fault
from mllm_rl.lifecycle import (
    LEASE_SETUP_PHASES,
    TRAIN_LEASE_PHASES,
    Colocated,
    LifecycleOptions,
    colocate,
    release_on_fault,
    rollout_lease_phases,
)
from mllm_rl.multitask.driver import FINAL, ROLLOUT, SETUP, TRAIN, Lease, TaskSteps
from mllm_rl.multitask.spec import TaskSpec
from mllm_rl.phases.recorder import PhaseRecorder
from mllm_rl.plans.base import engine_info
from mllm_rl.plans.rl import (
    RewardsFile,
    check_model_shape,
    checkpoint_meta,
    checkpointer,
    evaluate,
    make_rollout,
    size_engine,
    trainer_maker,
    with_probe,
)
from mllm_rl.tasks import build_task

ENGINE_READY = "engine_ready_dummy"


def task_phases(opts: LifecycleOptions) -> dict[str, list[str]]:
    """What a task records: ``expected_phases`` (step None: start-up, then the final lease) and
    ``expected_step_phases`` (both leases of a step), for run.json and the report."""
    return {
        "expected_phases": [
            ENGINE_READY,
            *LEASE_SETUP_PHASES,
            *rollout_lease_phases(opts, "generate_result"),
        ],
        "expected_step_phases": rollout_lease_phases(opts) + TRAIN_LEASE_PHASES,
    }


class RLTask:
    """``TaskRuntime`` of one RL task (see the module doc)."""

    def __init__(
        self,
        spec: TaskSpec,
        run: Any,  # the run's MultitaskOptions
        backend: Backend,
        rec: PhaseRecorder,
        run_dir: Path,
        ports: list[int] | None = None,
        on_engine: Callable[[Any], None] = lambda engine: None,
    ) -> None:
        model: ModelDir = run.models[spec.name]
        self.spec, self.name, self.model, self.backend, self.rec = spec, spec.name, model, backend, rec
        self.opts = run.rl_options(spec, model.config.name)
        self.dir = run_dir / "tasks" / spec.name
        self.ports = ports
        self.on_engine = on_engine
        # --resume: the task's newest checkpoint that verifies; newer invalid ones are skipped
        self.resume_from: RLCheckpoint | None = None
        self.skipped: list[tuple[Path, str]] = []
        if run.resume:
            self.resume_from, self.skipped = find_resumable(
                self.dir, checkpoint_meta(backend.name, self.opts)
            )
            if self.resume_from is not None:
                check_model_shape(self.resume_from, model)
        self.first_step = self.resume_from.step + 1 if self.resume_from else 0
        self.engine: ManagedEngine | None = None
        self.life: Colocated | None = None
        self.history: list[dict[str, Any]] = []
        self.eval: dict[str, Any] | None = None
        self._pending: tuple[Any, dict[str, Any]] | None = None
        self.engine_opts: EngineOptions = self.opts.engine

    @property
    def steps(self) -> TaskSteps:
        return TaskSteps(self.name, min(self.first_step, self.opts.steps), self.opts.steps)

    def prepare(self) -> None:
        """Everything that can be checked before any engine starts (bad input: ``ValueError``):
        the task's data, tokenizer, engine size and engine arguments."""
        from transformers import AutoTokenizer

        self.task = build_task(self.opts.task_config)
        self.rewards = RewardsFile.of(self.dir, self.rec.process_index)  # as --plan rl writes them
        self.tok = AutoTokenizer.from_pretrained(str(self.model.path))
        self.eos = self.model.config.eos_token_id
        self.lifecycle = with_probe(self.opts.lifecycle, self.tok)
        eng = size_engine(self.task, self.tok, self.opts)  # task= set by the spec: <task>/weights, ...
        if self.ports is not None:
            # two ports for the engine; the rest of the block stays reserved (a multi-process
            # sglang-jax engine binds ports[0] + 5 and + 6)
            eng = dataclasses.replace(eng, ports=tuple(self.ports[:2]))
        self.backend.check_engine_args(self.model, eng)
        self.engine_opts = eng

    # -- leases ----------------------------------------------------------------------------
    def run_lease(self, lease: Lease) -> None:
        with self.rec.for_task(self.name):
            if lease.kind == SETUP:
                self._setup()
            elif lease.kind == ROLLOUT:
                self._pending = self._life().rollout_lease(lease.step, self.rollout)
            elif lease.kind == TRAIN:
                self._train(lease.step)
            elif lease.kind == FINAL:
                self.eval = self._life().final_lease(
                    lambda engine: evaluate(engine, self.task, self.tok, self.opts, self.eos, self.rewards)
                )
            else:
                raise ValueError(f"unknown lease kind {lease.kind!r}")
            self._life().check_asleep()

    def close(self) -> None:
        """Stop the task's reward worker and close its rewards file (idempotent; the engine and
        trainer are the run's to tear down)."""
        for part in (getattr(self, "task", None), getattr(self, "rewards", None)):
            if part is not None:
                part.close()

    def fail(self, lease: Lease, error: BaseException) -> None:
        if self.engine is None:  # failed before its engine existed: nothing of it is on the devices
            return
        with self.rec.for_task(self.name):
            if self.life is not None:
                self.life.release_on_fault(lease.step)
            else:  # failed while colocating: the engine may still hold memory, there is no trainer yet
                release_on_fault(self.backend, self.engine, None, self.rec, self.lifecycle, lease.step)

    def _life(self) -> Colocated:
        if self.life is None:
            raise RuntimeError(f"task {self.name!r}: a lease before its setup lease")
        return self.life

    def _setup(self) -> None:
        eng = self.engine_opts
        with self.rec.phase(ENGINE_READY, model=str(self.model.path), tp=eng.tp, ports=self.ports) as ph:
            engine = ManagedEngine(self.backend.create_engine(self.model, eng))
            self.on_engine(engine)
            ph.info.update(
                engine_info(engine), context_length=eng.context_length, max_total_tokens=eng.max_total_tokens
            )
        self.engine = engine

        make_trainer = trainer_maker(self.backend, self.model, self.opts, self.resume_from)
        self.life = colocate(
            self.backend, engine, self.rec, self.lifecycle, make_trainer, lora_rank=self.opts.train.lora_rank
        )
        self.life.park()
        # in the train lease itself: a task's lease ends with everything it began written
        save = checkpointer(self.life.trainer, self.dir, self.backend.name, self.opts, False, self.model)

        def save_checked(step: int) -> dict[str, Any]:
            if fault(f"checkpoint_fails:{self.name}:{step}"):  # a full disk, in one task only
                raise OSError(f"checkpoint of task {self.name!r} step {step} could not be written (injected)")
            return save(step)

        self.save = save_checked
        self.rollout = make_rollout(self.task, self.tok, self.opts, self.eos, self.rewards)

    def _train(self, step: int | None) -> None:
        if self._pending is None or step is None:
            raise RuntimeError(f"task {self.name!r}: train lease of step {step} without its rollout")
        batch, metrics = self._pending
        self._pending = None
        metrics = {**metrics, **self._life().train_lease(step, batch, self.save)}
        self.rec.log_metrics(step, {k: v for k, v in metrics.items() if k != "sample"}, task=self.name)
        self.history.append({"step": step, **metrics})
