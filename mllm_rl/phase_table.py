"""The phase table: every phase of the colocated lifecycle, declared once (docs/DESIGN.md, "The lifecycle").

One ``Phase`` per recorded phase (what is resident, the compiled functions it runs, what it
drops), then the ordered sequences. Read by ``mllm_rl.lifecycle``, ``mllm_rl.memplan.residency``
and ``mllm_rl.phases.watchdog``; pure Python (the planner imports it before any compiler)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

SCHEDULES = ("multi_stage", "naive")

# -- components: what can be resident on a device (per-device bytes in a memory plan) -----------
COMPONENT_DOCS: dict[str, str] = {
    "engine_weights": "the rollout engine's weights",
    "kv_pool": "the engine's KV cache pool (its size follows the engine's sizing rule)",
    "trainer_params": "the trainer's parameters (trainable + frozen)",
    "optimizer": "the optimizer state",
    "grads": "the gradient accumulator (one trainable-sized tree)",
    "ref_params": "a full fine-tune with a KL term: the reference params, on device in train_step",
    "staging": "the weight update's staging chunk (one bucket in flight)",
    "engine_logits": "what the engine keeps between generate calls (sglang-jax: the last decode "
    "batch's logits and log-probs); no release tag frees it (STEP_ALWAYS)",
    "blas_workspaces": "the cuBLAS workspaces torch keeps once a matmul ran on CUDA, one per thread "
    "and stream; no release tag frees them (STEP_ALWAYS)",
}
COMPONENTS = tuple(COMPONENT_DOCS)
# Resident in every phase from the first generate on (never in a setup, which runs before it).
STEP_ALWAYS = ("engine_logits", "blas_workspaces")

# -- compiled functions whose temporaries a phase adds (the largest one of its list) ------------
FUNCTION_DOCS: dict[str, str] = {
    "engine_step": "the engine's forward/decode step (generation)",
    "logprob": "the trainer's log-prob pass (old log-probs at the start of train_step)",
    "grad_step": "the trainer's forward + backward of one micro-batch",
    "optimizer_apply": "the optimizer update",
}
FUNCTIONS = tuple(FUNCTION_DOCS)

# What ``Phase.inherit`` may say instead of a row of its own.
INHERIT_END = "end"  # what the phase before it ended with (a pure drop or cache flush)
INHERIT_DURING = "during"  # what the phase before it held during it (it stopped part-way)

_ENGINE = ("engine_weights", "kv_pool")
_TRAIN = ("trainer_params", "optimizer")
_GENERATES = {"resident": _ENGINE, "functions": ("engine_step",), "heavy": True}  # the engine generates


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase. ``resident``: components on the device at some point *during* it; ``naive``: the
    naive schedule's row where it differs; ``inherit``: instead of a row, what the phase before left
    (``INHERIT_END``) or held (``INHERIT_DURING``); ``drops``: gone at its end; ``heavy``: computes or
    moves a whole model (the watchdog's full limit)."""

    name: str
    doc: str
    resident: tuple[str, ...] = ()
    naive: tuple[str, ...] | None = None
    inherit: str | None = None
    functions: tuple[str, ...] = ()
    drops: tuple[str, ...] = ()
    both_resident_ok: bool = False
    schedules: tuple[str, ...] = SCHEDULES
    heavy: bool = False

    def __post_init__(self) -> None:
        for c in (*self.resident, *(self.naive or ()), *self.drops):
            if c not in COMPONENTS:
                raise ValueError(f"phase {self.name}: unknown component {c!r}")
        for f in self.functions:
            if f not in FUNCTIONS:
                raise ValueError(f"phase {self.name}: unknown function {f!r}")
        if self.inherit not in (None, INHERIT_END, INHERIT_DURING):
            raise ValueError(f"phase {self.name}: inherit {self.inherit!r}")
        if self.inherit is not None and (self.resident or self.naive is not None):
            raise ValueError(f"phase {self.name}: a row of its own or inherit, not both")
        if not set(self.schedules) <= set(SCHEDULES):
            raise ValueError(f"phase {self.name}: schedules {self.schedules}")

    def row(self, schedule: str) -> tuple[str, ...]:
        """The resident components of ``schedule``'s row (not for an ``inherit`` phase)."""
        return self.naive if schedule == "naive" and self.naive is not None else self.resident


PHASES: dict[str, Phase] = {
    p.name: p
    for p in [
        # -- the engine generates ------------------------------------------------------------
        Phase("rollout", "a step's rollout (with check_weights, the engine's probe first)", **_GENERATES),
        Phase("generate_result", "final_lease's work: the run's evaluation", **_GENERATES),
        Phase(
            "check_weights",
            "the garbage guard: the engine's greedy probe against the trainer's",
            **_GENERATES,
        ),
        # -- the engine goes to sleep --------------------------------------------------------
        Phase("drain", "the engine finishes or aborts what is in flight", resident=_ENGINE),
        Phase(
            "release_rollout",
            "the engine releases every releasable tag (KV cache, weights, CUDA graphs)",
            resident=_ENGINE,
            drops=_ENGINE,
        ),
        # -- the trainer -----------------------------------------------------------------------
        Phase(
            "trainer_init", "colocate builds the trainer (the engine released)", resident=_TRAIN, heavy=True
        ),
        Phase("onload_trainer", "the trainer's params and optimizer state come back", resident=_TRAIN),
        Phase(
            "train_step",
            "old log-probs, forward/backward and the optimizer update (with check_weights, the "
            "trainer's greedy probe after it)",
            resident=(*_TRAIN, "grads", "ref_params"),
            functions=("logprob", "grad_step", "optimizer_apply"),
            drops=("grads", "ref_params"),
            heavy=True,
        ),
        Phase(
            "checkpoint",
            "the step's checkpoint is written from the resident state",
            resident=_TRAIN,
            heavy=True,
        ),
        Phase(
            "offload_optimizer",
            "the optimizer state goes to the host",
            resident=_TRAIN,
            drops=("optimizer", "grads", "ref_params"),
        ),
        Phase(
            "onload_trainer_params",
            "rollout_lease's first phase: only the trainer's params come back, to stream the update "
            "(with check_weights, the trainer's greedy probe, unplanned as in train_step)",
            resident=("trainer_params",),
        ),
        Phase(
            "offload_trainer_params",
            "the trainer's params go to the host; it holds what the phase before it left",
            inherit=INHERIT_END,
            drops=("trainer_params", "staging"),
        ),
        Phase(
            "empty_cache",
            "the allocator's cache is emptied: it holds what the phase before it left",
            inherit=INHERIT_END,
        ),
        # -- the engine wakes and takes the trainer's weights ------------------------------------
        Phase(
            "resume_weights",
            "the engine's weights come back (the KV cache stays released), next to the trainer's params",
            resident=("trainer_params", "engine_weights"),
            both_resident_ok=True,
        ),
        Phase(
            "resume_rollout",
            "naive: the engine's weights and KV cache come back together, next to the trainer's params",
            resident=("trainer_params", *_ENGINE),
            both_resident_ok=True,
            schedules=("naive",),
        ),
        Phase(
            "update_weights",
            "the trainer's weights stream into the engine (partial onto valid base weights, else full)",
            resident=("trainer_params", "engine_weights", "staging"),
            naive=("trainer_params", *_ENGINE, "staging"),
            drops=("staging",),
            both_resident_ok=True,
            heavy=True,
        ),
        Phase(
            "weights_swapped",
            "first_sync: the trainer's full weights stream into the engine (its dummy weights)",
            resident=("trainer_params", "engine_weights", "staging"),
            drops=("staging",),
            both_resident_ok=True,
            heavy=True,
        ),
        Phase("resume_kv", "the engine's KV cache (and CUDA graphs) come back", resident=_ENGINE),
        Phase("continue_generation", "the engine accepts requests again", resident=_ENGINE),
        # -- faults --------------------------------------------------------------------------
        Phase(
            "release_on_fault",
            "after a failure (in no sequence): what the task holds is freed; it starts with what the "
            "failed phase held part-way and ends with only what no release frees (STEP_ALWAYS)",
            inherit=INHERIT_DURING,
            drops=tuple(c for c in COMPONENTS if c not in STEP_ALWAYS),
        ),
    ]
}

# Phases at whose end trainer params and engine weights may both be resident.
BOTH_RESIDENT_OK = frozenset(p.name for p in PHASES.values() if p.both_resident_ok)
HEAVY = frozenset(p.name for p in PHASES.values() if p.heavy)

# -- the ordered sequences ------------------------------------------------------------------------
CHECK = "check_weights"  # optional (LifecycleOptions.check_weights): after the engine is awake again
_SLEEP = ("drain", "release_rollout")
_TRAIN_PHASES = ("onload_trainer", "train_step", "checkpoint", "offload_optimizer")
_HEAD = ("rollout", *_SLEEP, *_TRAIN_PHASES, "empty_cache")
_SWAP = ("update_weights", "offload_trainer_params", "empty_cache")
# The multi-stage wake-up: weights first, updated, the trainer's params out, then the KV cache.
WAKE = ("resume_weights", *_SWAP, "resume_kv", "continue_generation")
# One step of each schedule (Colocated.step), without the optional check_weights at its end.
STEP: dict[str, tuple[str, ...]] = {
    "multi_stage": (*_HEAD, *WAKE),
    "naive": (*_HEAD, "resume_rollout", *_SWAP, "continue_generation"),
}
# Every setup starts with BUILD (colocate), then FIRST_SYNC (one task) or PARK (a multi-task lease).
BUILD = ("release_rollout", "trainer_init")
FIRST_SYNC = (
    "offload_optimizer",
    "resume_weights",
    "weights_swapped",
    "offload_trainer_params",
    "resume_kv",
    "continue_generation",
)
PARK = ("offload_optimizer", "offload_trainer_params", "empty_cache")
SETUP = BUILD + FIRST_SYNC
LEASE_SETUP = BUILD + PARK
# Colocated.rollout_lease: AWAKE, [check_weights], the work (rollout | generate_result), ASLEEP.
# It runs the multi-stage order whatever LifecycleOptions.schedule says (LEASE_SCHEDULE).
AWAKE = ("onload_trainer_params", *WAKE)
ASLEEP = (*_SLEEP, "empty_cache")
LEASE_WORK = ("rollout", "generate_result")
# Colocated.train_lease: the engine stays released throughout.
TRAIN_LEASE = (*_TRAIN_PHASES, "offload_trainer_params", "empty_cache")
LEASE_SCHEDULE = "multi_stage"


def step_sequence(schedule: str, check_weights: bool = False) -> tuple[str, ...]:
    """The phase names of one step of ``schedule``, in order."""
    return STEP[schedule] + ((CHECK,) if check_weights else ())


def rollout_lease_sequence(check_weights: bool = False, work: str = "rollout") -> tuple[str, ...]:
    """The phase names of ``Colocated.rollout_lease`` (``work="generate_result"``: ``final_lease``)."""
    if work not in LEASE_WORK:
        raise ValueError(f"rollout lease work {work!r}: expected one of {', '.join(LEASE_WORK)}")
    return AWAKE + ((CHECK,) if check_weights else ()) + (work,) + ASLEEP


class Sequence(NamedTuple):
    """A phase sequence as it runs: its phases, the schedule whose rows it takes; ``step``: count
    ``STEP_ALWAYS`` in each phase (nothing frees it after a generate)."""

    phases: tuple[str, ...]
    schedule: str
    step: bool


def sequences(check_weights: bool = False) -> dict[str, Sequence]:
    """Every phase sequence a run records, by name."""
    out = {f"step:{s}": Sequence(step_sequence(s, check_weights), s, True) for s in SCHEDULES}
    out["setup"] = Sequence(SETUP, "multi_stage", False)
    out["lease_setup"] = Sequence(LEASE_SETUP, LEASE_SCHEDULE, False)
    out["rollout_lease"] = Sequence(rollout_lease_sequence(check_weights), LEASE_SCHEDULE, True)
    out["final_lease"] = Sequence(
        rollout_lease_sequence(check_weights, "generate_result"), LEASE_SCHEDULE, True
    )
    out["train_lease"] = Sequence(TRAIN_LEASE, LEASE_SCHEDULE, True)
    return out
