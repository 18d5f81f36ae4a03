"""``TorchModelOptions``: how the torch trainer runs its Qwen3 (not what it computes), the torch
backend's ``--model-option KEY=VALUE`` (``TrainConfig.model_options`` of a run and
``PlanRequest.options`` of a memory plan get the same pairs).

- ``remat``: ``true`` runs each decoder layer's training forward under non-reentrant
  ``torch.utils.checkpoint`` (``backends/torch/model.py: run_block``), keeping only its input
  [B, T, H]; same loss and gradients. JAX's ``block`` / ``none`` are accepted; ``dots`` has no
  torch counterpart and is refused.
- ``adamw``: the ``torch.optim.AdamW`` implementation. ``auto`` (default; ``none`` too) is ``fused``
  on CUDA (faster and without ``foreach``'s full-size temporaries: docs/PLAN.md, "One H100, torch
  backend") and torch's own choice elsewhere (``torch/optim/optimizer.py:
  _default_to_fused_or_foreach``); ``foreach`` / ``fused`` force one. ``fused`` keeps its ``step``
  counters on the params' device, the others on the host. Same update up to rounding.

Imports no torch: the argument and plan-request checks use it before torch starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

REMAT_NAMES = {"true": True, "block": True, "false": False, "none": False}  # remat's string spellings
ADAMW_NAMES = ("auto", "foreach", "fused")  # adamw's values


@dataclasses.dataclass(frozen=True)
class TorchModelOptions:
    remat: bool = False
    adamw: str = "auto"

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
        if "adamw" in options:
            options["adamw"] = adamw_name(options["adamw"])
        return cls(**options)

    def adamw_on(self, device_type: str) -> str:
        """The implementation ``adamw`` means for parameters on a ``device_type`` device
        (``torch.device.type``): ``auto`` is ``fused`` on ``cuda``, else stays ``auto``."""
        return "fused" if self.adamw == "auto" and device_type == "cuda" else self.adamw

    def adamw_kwargs(self, device_type: str) -> dict[str, bool]:
        """The ``torch.optim.AdamW`` arguments of ``adamw`` on a ``device_type`` device: none
        (``auto`` off CUDA: torch's choice), ``foreach=True`` or ``fused=True``."""
        return {"auto": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[
            self.adamw_on(device_type)
        ]


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


def adamw_name(value: Any) -> str:
    """``adamw``'s value: one of ``ADAMW_NAMES`` (case-insensitive), ``None`` meaning ``auto``;
    ``ValueError`` naming ``--model-option adamw`` otherwise."""
    if value is None:
        return "auto"
    if isinstance(value, str) and value.lower() in ADAMW_NAMES:
        return value.lower()
    raise ValueError(f"--model-option adamw={value!r}: expected one of {', '.join(ADAMW_NAMES)}")
