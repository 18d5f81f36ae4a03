"""``TorchModelOptions``: the torch backend's ``--model-option KEY=VALUE``, how the trainer runs its
Qwen3 (not what it computes). Imports no torch.

- ``remat``: ``true`` checkpoints each decoder layer's training forward (``model.py: run_block``),
  same numbers. JAX's ``block`` / ``none`` are accepted; ``dots`` is refused.
- ``adamw``: ``auto`` (default; ``none`` too) is ``fused`` on CUDA (docs/PLAN.md), torch's choice
  elsewhere; ``foreach`` / ``fused`` force one.
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
        """The options of parsed ``--model-option`` pairs (or a dict); ValueError naming a bad one."""
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
        """The implementation ``adamw`` means on a ``device_type`` device: ``auto`` is ``fused`` on cuda."""
        return "fused" if self.adamw == "auto" and device_type == "cuda" else self.adamw

    def adamw_kwargs(self, device_type: str) -> dict[str, bool]:
        """The ``torch.optim.AdamW`` arguments of ``adamw`` on a ``device_type`` device."""
        return {"auto": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[
            self.adamw_on(device_type)
        ]


def remat_flag(value: Any) -> bool:
    """``remat``'s value as a bool: a bool, ``None`` (false), or a ``REMAT_NAMES`` string."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.lower() in REMAT_NAMES:
        return REMAT_NAMES[value.lower()]
    raise ValueError(
        f"--model-option remat={value!r}: expected true or false (JAX's block / none also accepted; "
        "JAX's dots has no torch counterpart)"
    )


def adamw_name(value: Any) -> str:
    """``adamw``'s value: one of ``ADAMW_NAMES`` (case-insensitive), ``None`` meaning ``auto``."""
    if value is None:
        return "auto"
    if isinstance(value, str) and value.lower() in ADAMW_NAMES:
        return value.lower()
    raise ValueError(f"--model-option adamw={value!r}: expected one of {', '.join(ADAMW_NAMES)}")
