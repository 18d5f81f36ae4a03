"""The colocated step: a trainer and a rollout engine take turns on the same devices (docs/DESIGN.md).

``Colocated`` runs the sequences of ``mllm_rl.phase_table``, one handler per phase
(``Colocated.HANDLERS``). Checked at every phase end (``LifecycleError``): params and engine
weights both resident only where ``BOTH_RESIDENT_OK``. Also guarded: update fingerprints, partial
updates only onto valid weights, finite loss and grad norm, the greedy probe (``check_weights``)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mllm_rl import phase_table
from mllm_rl.engine import TAG_CUDA_GRAPH, TAG_KV, TAG_WEIGHTS, SamplingParams, WeightMismatch
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.faults import fault_value
from mllm_rl.option_error import OptionError
from mllm_rl.options.check import check_fields, opt
from mllm_rl.phases.recorder import PhaseHandle, PhaseRecorder
from mllm_rl.progress import waiting
from mllm_rl.rl.old_logp import with_trainer_old_logp
from mllm_rl.trainer import OPTIMIZER, PARAMS, RolloutBatch, Trainer

if TYPE_CHECKING:
    from mllm_rl.backend import Backend

# Views of the phase table as lists (the plans and the report concatenate them).
SCHEDULES = phase_table.SCHEDULES
STEP_PHASES = {s: list(phase_table.STEP[s]) for s in SCHEDULES}
SETUP_PHASES = list(phase_table.SETUP)
LEASE_SETUP_PHASES = list(phase_table.LEASE_SETUP)
TRAIN_LEASE_PHASES = list(phase_table.TRAIN_LEASE)
# Phases at whose end trainer params and engine weights may both be resident.
BOTH_RESIDENT_OK = set(phase_table.BOTH_RESIDENT_OK)
GREEDY_TIE = 1e-3  # top-2 logit margin below which a greedy token may differ across implementations
FINITE_METRICS = ("loss", "grad_norm")  # train metrics that must be finite for the step to count


class LifecycleError(RuntimeError):
    """A lifecycle invariant broke (never silently continued)."""


class NonFiniteTraining(RuntimeError):
    """A train step's loss or grad norm is NaN/inf (raised before its checkpoint and update)."""


def check_finite(step: int | None, train: dict[str, Any], info: dict[str, Any]) -> None:
    """``NonFiniteTraining`` when a ``FINITE_METRICS`` value is not finite (named in ``info``)."""
    bad = [k for k in FINITE_METRICS if k in train and not math.isfinite(float(train[k]))]
    if bad:
        info["non_finite"] = bad
        values = ", ".join(f"{k} {float(train[k])}" for k in bad)
        raise NonFiniteTraining(
            f"train_step of step {step}: non-finite {values}; stopped before the checkpoint and the "
            f"weight update (the trainer's weights are no longer usable)"
        )


@dataclasses.dataclass
class LifecycleOptions:
    schedule: str = opt("schedule")
    check_weights: bool = opt("check_weights")
    probe_ids: tuple[int, ...] = ()  # garbage-guard prompt (token ids)
    probe_tokens: int = 8
    drain_timeout_s: float = 120.0
    # PPO old log-probs from the trainer (verl's default) or the engine (mllm_rl.rl.old_logp);
    # tis_cap > 0: truncated importance sampling of the mismatch (needs old_logp="trainer").
    old_logp: str = opt("old_logp")
    tis_cap: float = opt("tis_cap")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.tis_cap > 0 and self.old_logp != "trainer":
            raise OptionError(
                "tis_cap",
                "truncated importance sampling needs the trainer's old log-probs "
                "(old_logp trainer): it weighs the engine/trainer mismatch",
            )


def step_phases(opts: LifecycleOptions) -> list[str]:
    """The phase names of one step, in order."""
    return list(phase_table.step_sequence(opts.schedule, opts.check_weights))


def rollout_lease_phases(opts: LifecycleOptions, work: str = "rollout") -> list[str]:
    """Phase names of ``Colocated.rollout_lease`` (``work="generate_result"``: ``final_lease``)."""
    return list(phase_table.rollout_lease_sequence(opts.check_weights, work))


RolloutFn = Callable[[ManagedEngine, int], tuple[RolloutBatch, dict[str, Any]]]
# The checkpoint phase's work; returns its info (mllm_rl.checkpoint.writer.Checkpointer).
SaveFn = Callable[[int], dict[str, Any]]


def colocate(
    backend: Backend,
    engine: ManagedEngine,
    rec: PhaseRecorder,
    opts: LifecycleOptions,
    make_trainer: Callable[[], tuple[Trainer, dict[str, Any]]],
    **trainer_info: Any,
) -> Colocated:
    """``phase_table.BUILD``: the engine (dummy weights) releases everything before
    ``make_trainer() -> (trainer, info)`` runs. Next: ``first_sync`` (one task) or ``park``."""
    _require_probe(opts)
    trainer: Trainer | None = None
    for name in phase_table.BUILD:
        info = trainer_info if name == "trainer_init" else {}
        with _checked_phase(rec, engine, trainer, name, None, info) as ph:
            if name == "release_rollout":
                _release_body(ph.info, engine, opts.drain_timeout_s)  # the engine has run nothing yet
            else:
                with waiting("trainer build"):
                    trainer, built = make_trainer()
                ph.info.update(built, state_bytes=trainer.state_bytes())
    assert trainer is not None, "phase_table.BUILD ends with trainer_init"
    return Colocated(backend, engine, trainer, rec, opts)


def release_on_fault(
    backend: Backend,
    engine: ManagedEngine,
    trainer: Trainer | None,
    rec: PhaseRecorder,
    opts: LifecycleOptions,
    step: int | None,
) -> dict[str, Any]:
    """Phase ``release_on_fault``: free what a failed task still holds (``trainer``: ``None`` when
    ``colocate`` failed)."""
    with _checked_phase(rec, engine, trainer, "release_on_fault", step, {}) as ph:
        held: dict[str, int] = {}
        keep = [t for t in release_tags(engine) if t not in engine.released]
        if keep:
            if engine.in_flight or not engine.paused:
                ph.info.update(engine.drain(opts.drain_timeout_s))
            held = engine.release(keep)
        resident = [k for k, v in trainer.resident().items() if v] if trainer is not None else []
        offloaded = trainer.offload(resident) if resident else 0
        backend.empty_cache()
        ph.info.update(held=_memory_names(engine, held), expected_freed_bytes=sum(held.values()) + offloaded)
    return ph.info


def _require_probe(opts: LifecycleOptions) -> None:
    if opts.check_weights and not opts.probe_ids:
        raise ValueError("check_weights needs LifecycleOptions.probe_ids")


def _release_body(info: dict[str, Any], engine: ManagedEngine, drain_timeout_s: float | None) -> None:
    """Phase ``release_rollout`` (drained first when given ``drain_timeout_s``: at setup)."""
    tags = release_tags(engine)
    info["tags"] = tags
    if drain_timeout_s is not None:
        info.update(engine.drain(drain_timeout_s))
    held = engine.release(tags)
    info.update(expected_freed_bytes=sum(held.values()), held=_memory_names(engine, held))


def release_tags(engine: ManagedEngine) -> list[str]:
    """The engine's releasable memory tags, in release order (KV cache first)."""
    return [t for t in (TAG_KV, TAG_WEIGHTS, TAG_CUDA_GRAPH) if t in engine.tags]


def _memory_names(engine: ManagedEngine, held: dict[str, int]) -> dict[str, int]:
    """``held`` keyed by the engine's memory tag names (``<task>/weights``)."""
    return {engine.memory_tag(t): b for t, b in held.items()}


WorkFn = Callable[[ManagedEngine, int | None], tuple[Any, dict[str, Any]]]


@dataclasses.dataclass
class Turn:
    """What the phases of one sequence share: ``work(engine, step) -> (batch, metrics)`` of
    ``rollout``/``generate_result``, the ``batch`` ``train_step`` trains on; ``step_probes``: take
    the garbage-guard probes in ``rollout`` and ``train_step`` (a lease: when params come back)."""

    step: int | None
    work: WorkFn | None = None
    save: SaveFn | None = None
    batch: Any = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    step_probes: bool = False


class Colocated:
    """Built by ``colocate``; each public method runs one phase-table sequence, ``HANDLERS`` maps
    phase name -> work."""

    def __init__(
        self,
        backend: Backend,
        engine: ManagedEngine,
        trainer: Trainer,
        rec: PhaseRecorder,
        opts: LifecycleOptions,
    ) -> None:
        _require_probe(opts)
        self.backend, self.engine, self.trainer, self.rec, self.opts = backend, engine, trainer, rec, opts
        self.release_tags = release_tags(engine)
        self.kv_tags = [t for t in self.release_tags if t != TAG_WEIGHTS]  # what resume_kv brings back
        self._expected_probe: tuple[list[int], list[float]] | None = None
        self._host_leaked: list[bytearray] = []  # the host_leak_mb fault's buffers

    def _run(self, phases: tuple[str, ...], turn: Turn) -> Turn:
        for name in phases:
            handler = self.HANDLERS[name]
            with _checked_phase(self.rec, self.engine, self.trainer, name, turn.step, {}) as ph:
                handler(self, ph.info, turn)
        return turn

    # -- the sequences ---------------------------------------------------------------------
    def first_sync(self) -> None:
        """Rest of a one-task setup (``phase_table.FIRST_SYNC``): the full weight sync."""
        self._run(phase_table.FIRST_SYNC, Turn(None))

    def step(self, step: int, rollout: RolloutFn, save: SaveFn | None = None) -> dict[str, Any]:
        """One colocated step (``phase_table.step_sequence``); returns rollout + train metrics."""
        o = self.opts
        turn = Turn(step, work=rollout, save=save, step_probes=True)
        return self._run(phase_table.step_sequence(o.schedule, o.check_weights), turn).metrics

    def park(self) -> None:
        """A task's setup lease (``phase_table.PARK``): the trainer to the host; the first
        ``rollout_lease`` sends the full weights."""
        self._run(phase_table.PARK, Turn(None))

    def rollout_lease(
        self, step: int | None, work: WorkFn, name: str = "rollout"
    ) -> tuple[Any, dict[str, Any]]:
        """Weight update + ``work(engine, step)`` (phase ``name``) under one lease; the engine
        releases everything again after."""
        turn = self._run(
            phase_table.rollout_lease_sequence(self.opts.check_weights, name), Turn(step, work=work)
        )
        return turn.batch, turn.metrics

    def train_lease(self, step: int, batch: RolloutBatch, save: SaveFn | None = None) -> dict[str, Any]:
        """Train under one lease (``phase_table.TRAIN_LEASE``); returns the train metrics."""
        return self._run(phase_table.TRAIN_LEASE, Turn(step, save=save, batch=batch)).metrics

    def final_lease(self, evaluate: Callable[[ManagedEngine], dict[str, Any]]) -> dict[str, Any]:
        """``rollout_lease`` with ``evaluate`` as its work, in phase ``generate_result``."""
        _, info = self.rollout_lease(None, lambda engine, step: (None, evaluate(engine)), "generate_result")
        return info

    def check_asleep(self) -> None:
        """``LifecycleError`` unless the task holds nothing on the devices (between leases)."""
        held = [t for t in self.release_tags if t not in self.engine.released]
        resident = [k for k, v in self.trainer.resident().items() if v]
        if held or resident:
            raise LifecycleError(
                f"between leases: engine still holds {held or 'nothing'}, trainer still holds "
                f"{resident or 'nothing'} on the devices"
            )

    def release_on_fault(self, step: int | None) -> dict[str, Any]:
        """After a failure inside a lease: free what this task holds so other tasks can go on."""
        return release_on_fault(self.backend, self.engine, self.trainer, self.rec, self.opts, step)

    # -- one handler per phase: (self, the record's info, the turn) ---------------------------
    def _work(self, info: dict[str, Any], turn: Turn) -> None:
        """``rollout`` / ``generate_result``: the turn's work on the awake engine."""
        # the engine's probe before the rollout fills the prefix cache (see _engine_probe)
        if turn.step_probes and self.opts.check_weights:
            info["probe_tokens"] = self._engine_probe()
        assert turn.work is not None, "a rollout phase needs the turn's work"
        turn.batch, metrics = turn.work(self.engine, turn.step)
        turn.metrics.update(metrics)
        info.update(metrics)

    def _onload_params(self, info: dict[str, Any], turn: Turn) -> None:
        info["expected_alloc_bytes"] = self.trainer.onload([PARAMS])
        if self.opts.check_weights:  # the reference: the very params about to be streamed
            self._expected_probe = self.trainer.greedy(list(self.opts.probe_ids), self.opts.probe_tokens)

    def _train_step(self, info: dict[str, Any], turn: Turn) -> None:
        """Old log-probs (trainer source), then the update; ``NonFiniteTraining`` stops here."""
        batch = turn.batch
        assert batch is not None, "train_step needs the turn's batch"
        info["batch"] = batch.size
        extra: dict[str, float] = {}
        if self.opts.old_logp == "trainer":
            batch, extra = with_trainer_old_logp(batch, self.trainer.logprobs(batch), self.opts.tis_cap)
        train = {**self.trainer.train_step(batch), **extra}
        leak = fault_value("host_leak_mb")
        if leak:  # host memory kept forever, as a leak would: the report's host_growth must see it
            self._host_leaked.append(bytearray(b"\x01" * (int(leak) << 20)))
        info.update(train)
        check_finite(turn.step, train, info)
        turn.metrics.update(train)
        if turn.step_probes and self.opts.check_weights:
            self._expected_probe = self.trainer.greedy(list(self.opts.probe_ids), self.opts.probe_tokens)

    def _resume(self, info: dict[str, Any], tags: list[str]) -> None:
        info["expected_alloc_bytes"] = sum(self.engine.resume(tags).values())

    def _offload(self, info: dict[str, Any], what: list[str]) -> None:
        info["expected_freed_bytes"] = self.trainer.offload(what)

    HANDLERS: dict[str, Callable[[Colocated, dict[str, Any], Turn], None]] = {
        "rollout": _work,
        "generate_result": _work,
        "drain": lambda self, info, turn: info.update(self.engine.drain(self.opts.drain_timeout_s)),
        "release_rollout": lambda self, info, turn: _release_body(info, self.engine, None),  # after drain
        "onload_trainer": lambda self, info, turn: info.update(
            expected_alloc_bytes=self.trainer.onload([PARAMS, OPTIMIZER])
        ),
        "onload_trainer_params": _onload_params,
        "train_step": _train_step,
        "checkpoint": lambda self, info, turn: info.update(
            turn.save(turn.step) if turn.save is not None else {"saved": False, "path": None}
        ),
        "offload_optimizer": lambda self, info, turn: self._offload(info, [OPTIMIZER]),
        "offload_trainer_params": lambda self, info, turn: self._offload(info, [PARAMS]),
        "empty_cache": lambda self, info, turn: self.backend.empty_cache(),
        "resume_weights": lambda self, info, turn: self._resume(info, [TAG_WEIGHTS]),
        "resume_kv": lambda self, info, turn: self._resume(info, self.kv_tags),
        "resume_rollout": lambda self, info, turn: self._resume(info, self.release_tags),
        "update_weights": lambda self, info, turn: info.update(self._update(full=None)),
        "weights_swapped": lambda self, info, turn: info.update(mode="streaming", **self._update(full=True)),
        "continue_generation": lambda self, info, turn: self.engine.continue_generation(),
        "check_weights": lambda self, info, turn: info.update(self._check_probe()),
    }

    # -- pieces --------------------------------------------------------------------------
    def _update(self, full: bool | None) -> dict[str, Any]:
        """Stream the trainer's weights into the engine, fingerprint-checked. ``full=None``:
        partial only onto valid base weights."""
        if full is None:
            full = not self.engine.weights_valid
        export = self.trainer.export_weights(full=full)
        # the trainer's fingerprint of what it sends, from the export's own pass where it has one
        want = export.fingerprint or self.trainer.weights_fingerprint(export.names)
        stats = self.engine.update_weights(export, on_tensor=self._high_point, expected=want)
        return {
            "full": export.full,
            "tensors": stats.tensors,
            "bytes": stats.bytes,
            "seconds": round(stats.seconds, 4),
            "gbps": round(stats.gbps, 3),
            "fingerprint_ok": True,
            "read_back": stats.read_back,  # tensors the check read back from the engine
            "check_s": round(stats.check_seconds, 4),
            "weights_version": self.engine.weights_version,
        }

    def _high_point(self, name: str, nbytes: int) -> None:
        self.rec.sample_high_point(nbytes)

    def _engine_probe(self) -> list[int]:
        """Greedy probe from an empty prefix cache, alone in its batch: bitwise reproducible (a
        reused prefix has another batch layout, and a near tie can flip)."""
        self.engine.flush_cache()
        sampling = SamplingParams(max_new_tokens=self.opts.probe_tokens, temperature=0.0)
        return self.engine.generate([list(self.opts.probe_ids)], sampling)[0].token_ids

    def _check_probe(self) -> dict[str, Any]:
        got = self._engine_probe()
        if self._expected_probe is None:
            raise LifecycleError("check_weights: no trainer probe from this step")
        want, margins = self._expected_probe
        for i, (a, b) in enumerate(zip(want, got, strict=False)):
            if a != b:
                if margins[i] < GREEDY_TIE:
                    return {"probe_tokens": got, "trainer_tokens": want, "agree_until": i, "near_tie": True}
                raise WeightMismatch(
                    f"check_weights: engine greedy token {i} is {b}, the trainer's is {a} (top-2 margin "
                    f"{margins[i]:.3g}): the engine's weights are not the trainer's (garbage output)"
                )
        return {"probe_tokens": got, "trainer_tokens": want, "agree_until": min(len(want), len(got))}


def check_residency(engine: ManagedEngine, trainer: Trainer | None, phase: str) -> None:
    """``LifecycleError``: params and engine weights both resident at the end of ``phase`` outside
    ``BOTH_RESIDENT_OK``."""
    both = trainer is not None and trainer.resident()[PARAMS] and TAG_WEIGHTS not in engine.released
    if both and phase not in BOTH_RESIDENT_OK:
        raise LifecycleError(
            f"{phase}: trainer params and engine weights are both resident (allowed only in "
            f"{sorted(BOTH_RESIDENT_OK)})"
        )


@contextlib.contextmanager
def _checked_phase(
    rec: PhaseRecorder,
    engine: ManagedEngine,
    trainer: Trainer | None,
    name: str,
    step: int | None,
    info: dict[str, Any],
) -> Iterator[PhaseHandle]:
    """``rec.phase`` that records engine/trainer state and checks residency at its end
    (``trainer`` is ``None`` before ``trainer_init``)."""
    with rec.phase(name, step=step, **info) as ph:
        yield ph
        ph.info["engine"] = engine.state()
        if trainer is not None:
            ph.info["trainer"] = trainer.resident()
        check_residency(engine, trainer, name)
