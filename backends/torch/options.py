"""``TorchModelOptions``: how the torch trainer runs its Qwen3 (not what it computes), the torch
backend's ``--model-option KEY=VALUE`` (``TrainConfig.model_options`` of a run,
``PlanRequest.options`` of a memory plan: the same pairs reach both).

- ``remat``: per-block activation checkpointing. ``false`` (the default) keeps every decoder
  layer's activations for the backward; ``true`` runs each layer's training forward under
  ``torch.utils.checkpoint`` (non-reentrant): only the layer's input [B, T, H] is kept, the layer
  is recomputed in the backward (``backends/torch/model.py: run_block``). Same loss and gradients;
  a forward without grad (log-probs, the KL reference, the engine) is unchanged. JAX's spellings
  are accepted too: ``block`` (= ``true``, what JAX's ``remat=block`` does) and ``none`` (=
  ``false``); JAX's ``dots`` (keep the matmul outputs) has no torch counterpart and is refused.

Imports nothing heavy (no torch): the backend's argument check and the planner's request check
use it before torch starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

REMAT_NAMES = {"true": True, "block": True, "false": False, "none": False}  # remat's string spellings


@dataclasses.dataclass(frozen=True)
class TorchModelOptions:
    remat: bool = False

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, Any]] | dict[str, Any]) -> TorchModelOptions:
        """The options of ``pairs`` (``--model-option`` KEY=VALUE pairs, parsed:
        ``mllm_rl.options.check.parse_key_value``), or a dict of them; ``ValueError`` naming
        ``--model-option KEY`` for an unknown key or a bad value."""
        options = dict(pairs.items() if isinstance(pairs, dict) else pairs)
        known = [f.name for f in dataclasses.fields(cls)]
        bad = sorted(set(options) - set(known))
        if bad:
            raise ValueError(
                f"--model-option {bad[0]}: unknown; the torch trainer's options are {', '.join(known)}"
            )
        if "remat" in options:
            options["remat"] = remat_flag(options["remat"])
        return cls(**options)


def remat_flag(value: Any) -> bool:
    """``remat``'s value as a bool: a bool, ``None`` (false), or a ``REMAT_NAMES`` string
    (case-insensitive; JAX's ``block`` / ``none`` among them); ``ValueError`` otherwise."""
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    if isinstance(value, str) and value.lower() in REMAT_NAMES:
        return REMAT_NAMES[value.lower()]
    raise ValueError(
        f"--model-option remat={value!r}: expected true or false (JAX's block / none also accepted; "
        "JAX's dots has no torch counterpart)"
    )
