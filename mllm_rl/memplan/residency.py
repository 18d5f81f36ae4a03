"""What is resident on every device during each phase of a colocated step.

One row per phase name of ``mllm_rl.lifecycle`` (``STEP_PHASES`` for both schedules and
``SETUP_PHASES``): the components whose bytes are on the device at some point *during*
the phase (for a transition such as ``offload_optimizer`` the bytes being moved are still
there until the phase ends, so both sides count), and the compiled functions that run in it
(their extra bytes come on top, one function at a time).

Components (per-device bytes):

- ``engine_weights``  the rollout engine's weights
- ``kv_pool``         the engine's KV cache pool (its size follows the engine's sizing rule)
- ``trainer_params``  the trainer's parameters (trainable + frozen)
- ``optimizer``       the optimizer state
- ``grads``           the gradient accumulator (one trainable-sized tree)
- ``ref_params``      a full fine-tune with a KL term: the reference params, on device in train_step
- ``staging``         the weight update's staging chunk (one bucket in flight)
- ``engine_logits``   what the engine keeps between generate calls (sglang-jax: the last decode
                      batch's logits and log-probs); from the first rollout on it is in every
                      step phase (no release frees it), in no setup phase
"""

from __future__ import annotations

COMPONENTS = (
    "engine_weights",
    "kv_pool",
    "trainer_params",
    "optimizer",
    "grads",
    "ref_params",
    "staging",
    "engine_logits",
)
# Resident in every step phase (never in setup, which runs before the first generate).
STEP_ALWAYS = ("engine_logits",)

# Functions whose compiled temporaries a phase adds (the largest one of its list).
FUNCTIONS = ("engine_step", "logprob", "grad_step", "optimizer_apply")

_ENGINE = ("engine_weights", "kv_pool")
_TRAIN = ("trainer_params", "optimizer")

# phase -> (components resident during the phase, functions that run in it)
_COMMON: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rollout": (_ENGINE, ("engine_step",)),
    "drain": (_ENGINE, ()),
    "release_rollout": (_ENGINE, ()),
    "trainer_init": (_TRAIN, ()),
    "onload_trainer": (_TRAIN, ()),
    "train_step": (_TRAIN + ("grads", "ref_params"), ("logprob", "grad_step", "optimizer_apply")),
    "checkpoint": (_TRAIN, ()),
    "offload_optimizer": (_TRAIN, ()),
    "empty_cache": ((), ()),  # filled by context: whatever the previous phase left (see below)
    "resume_weights": (("trainer_params", "engine_weights"), ()),
    "update_weights": (("trainer_params", "engine_weights", "staging"), ()),
    "weights_swapped": (("trainer_params", "engine_weights", "staging"), ()),
    "offload_trainer_params": (("trainer_params", "engine_weights"), ()),
    "resume_kv": (_ENGINE, ()),
    "continue_generation": (_ENGINE, ()),
    "check_weights": (_ENGINE, ("engine_step",)),
}

# The naive schedule brings the whole engine back before the update.
_NAIVE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "resume_rollout": (("trainer_params",) + _ENGINE, ()),
    "update_weights": (("trainer_params",) + _ENGINE + ("staging",), ()),
    "offload_trainer_params": (("trainer_params",) + _ENGINE, ()),
}


def phase_rows(
    phases: list[str], schedule: str, step: bool = True
) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """``[(phase, resident components, functions)]`` for a phase list of ``schedule``; ``step``:
    the phases of an RL step (``STEP_ALWAYS`` resident in each), not the once-per-run setup.

    ``empty_cache`` holds what the phase before it ended with; in the multi-stage schedule
    ``offload_optimizer -> empty_cache`` keeps the trainer params, ``offload_trainer_params ->
    empty_cache`` keeps the engine weights (and, naive, the KV pool). ``KeyError`` for a phase
    this table does not know (a lifecycle change must update the plan).
    """
    table = dict(_COMMON)
    if schedule == "naive":
        table.update(_NAIVE)
    elif schedule != "multi_stage":
        raise ValueError(f"schedule {schedule!r}: expected multi_stage or naive")
    rows = []
    prev_end: tuple[str, ...] = ()
    for name in phases:
        if name not in table:
            raise KeyError(f"phase {name!r} has no residency row in mllm_rl.memplan.residency")
        resident, fns = table[name]
        if name == "empty_cache":
            resident = prev_end
        prev_end = end_state(name, resident)
        if step:
            resident = resident + tuple(c for c in STEP_ALWAYS if c not in resident)
        rows.append((name, resident, fns))
    return rows


def end_state(phase: str, resident: tuple[str, ...]) -> tuple[str, ...]:
    """What is still resident when ``phase`` ends (what a following ``empty_cache`` holds, and
    what a phase record's ``bytes_in_use`` at the phase's end shows)."""
    drop = {
        "release_rollout": ("engine_weights", "kv_pool"),
        "offload_optimizer": ("optimizer", "grads", "ref_params"),
        "offload_trainer_params": ("trainer_params", "staging"),
        "train_step": ("grads", "ref_params"),
        "update_weights": ("staging",),
        "weights_swapped": ("staging",),
    }.get(phase, ())
    return tuple(c for c in resident if c not in drop)
