"""LoRA adapters for the torch Qwen3 (the math of ``backends/jax/model.py``'s ``Linear``).

``LoRALinear`` is an ``nn.Linear`` (``weight`` [out, in] keeps the HF name) plus PEFT's ``lora_a``
[R, in] ~ N(0, 1/in) and ``lora_b`` [out, R] = 0: ``y = x @ weight.T + x @ lora_a.T @ lora_b.T * alpha / R``,
the branch in the base weight's dtype (the adapters may be float32 masters).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from mllm_rl.backends.torch.cpu_half import linear

PROJECTIONS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("mlp", ("gate_proj", "up_proj", "down_proj")),
)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (no bias) with a low-rank adapter (see the module docstring)."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, generator, dtype: torch.dtype | None = None
    ) -> None:
        """``dtype``: the adapters' (master) dtype; by default the base weight's."""
        if base.bias is not None:
            raise ValueError("LoRALinear: linear layers with a bias are not supported")
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", None)
        w = base.weight
        a = torch.randn(rank, self.in_features, generator=generator, dtype=torch.float32)
        a = a / math.sqrt(self.in_features)
        dtype = dtype or w.dtype
        self.lora_a = nn.Parameter(a.to(device=w.device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=dtype))
        self.scale = alpha / rank
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [..., in] -> [..., out], the adapter branch in the base weight's dtype."""
        y = linear(x, self.weight)
        if self.enabled:
            dt = self.weight.dtype
            y = y + linear(linear(x, self.lora_a.to(dt)), self.lora_b.to(dt)) * self.scale
        return y


@torch.no_grad()
def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight`` [out, in] + ``lora_b`` [out, R] @ ``lora_a`` [R, in] * ``scale`` in float32."""
    return (weight.float() + (lora_b.float() @ lora_a.float()) * scale).to(weight.dtype)


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """HF weight name -> the linear layer holding it (every projection of every decoder layer)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for sub, names in PROJECTIONS:
            for n in names:
                out[f"model.layers.{i}.{sub}.{n}.weight"] = getattr(getattr(layer, sub), n)
    return out


def add_lora(
    model: nn.Module, rank: int, alpha: float, seed: int = 0, dtype: torch.dtype | None = None
) -> dict[str, LoRALinear]:
    """Replace every projection by a ``LoRALinear`` sharing its weight (in place); freeze all but
    the adapters (in ``dtype``, by default the base's). Returns HF weight name -> adapter layer."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    model.requires_grad_(False)
    out = {}
    for name, base in linear_layers(model).items():
        parent, attr = name.removesuffix(".weight").rsplit(".", 1)
        out[name] = LoRALinear(base, rank, alpha, gen, dtype)
        setattr(model.get_submodule(parent), attr, out[name])
    return out


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """Every adapter of ``model`` off inside the block (the base model's forward)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True
