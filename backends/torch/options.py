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
- ``adamw``: which ``torch.optim.AdamW`` implementation steps. ``auto`` (the default) is
  ``fused`` for parameters on a CUDA device and otherwise torch's own choice (no
  ``foreach``/``fused`` arguments: ``torch/optim/optimizer.py: _default_to_fused_or_foreach``
  loops over the tensors on CPU; its ``step`` counters are float32 CPU scalars). ``foreach`` asks
  for the multi-tensor implementation (``_foreach_*`` ops over the whole parameter list:
  full-size temporaries while it runs; torch's own choice on CUDA). ``fused`` asks for
  ``fused=True`` (one ``_fused_adamw_`` kernel per device and dtype, updating params and moments
  in place: no full-size temporaries; CUDA and, since torch 2.4, CPU); its ``step`` counters are
  float32 scalars on the params' device. The same update up to float32 rounding (with
  ``precision=pure`` bf16 roundings: foreach rounds every op to bf16, fused once). ``none`` =
  ``auto``. Why ``auto`` is ``fused`` on CUDA: on an H100, Qwen3-4B bf16 mixed with ``remat``, 1
  x 4096 tokens, fused steps in 0.571 s at a 61.14 GiB peak, foreach in 0.609 s at 75.44 GiB
  (``scripts/bench_plan_vs_cuda.py``; docs/PLAN.md, "One H100, torch backend").

Imports nothing heavy (no torch): the backend's argument check and the planner's request check
use it before torch starts.
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
