"""What a memory plan is asked for, and the planner contract: ``mllm_rl.backends.<name>.memplan``
has ``measure(req) -> Measured`` (optionally ``targets()`` and ``check(req)``, refusals needing no
compiler). Nothing here imports jax or torch."""

from __future__ import annotations

import dataclasses
from typing import Any

from mllm_rl.memplan.compose import Component, FunctionMemory, Target
from mllm_rl.presets import ModelConfig

ENGINES = ("auto", "sglang", "embedded")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """One plan's inputs: a micro-batch is ``micro_batch`` sequences of ``seq_len`` tokens, a rollout
    ``prompts x group_size`` sequences."""

    backend: str  # "jax" | "torch"
    target: str  # "v4-8", "v5e-8", "h100x8", "cpu", ... (the backend lists what it knows)
    model: ModelConfig
    micro_batch: int = 4
    seq_len: int = 4096
    group_size: int = 8
    prompts: int = 8
    tp: int = 1  # tensor parallel of the rollout engine
    fsdp: int = 0  # the trainer's data/FSDP axis; 0: every device not used by trainer_tp
    lora_rank: int = 0
    kl: bool = False  # full fine-tune with a KL term keeps reference params
    precision: str = "mixed"  # the trainer's (TrainConfig.precision; the run's --precision)
    schedule: str = "multi_stage"
    kv_tokens: int | None = None  # None: size the pool by the engine's own rule
    mem_fraction_static: float | None = None  # None: derived (the plan says which value to pass)
    margin: float = 0.9  # the fraction of device memory a phase may use
    param_dtype: str = "bfloat16"
    optimizer_dtype: str = "float32"
    max_running_requests: int = 128  # the engine's batch limit (the run's --max-running-requests)
    trainer_tp: int = 1  # tensor parallel of the trainer's mesh (fsdp x trainer_tp = devices)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # backend model options (by name)
    # the rollout engine planned: "auto" (the backend's choice for the target), "sglang", "embedded"
    engine: str = "auto"
    weights_cpu_backup: bool = False  # the engine keeps a host copy of released weights (host memory)
    checkpoint_background: bool = False  # a background checkpoint's host copy of the trainer state
    host_ram_gib: float | None = None  # one host's RAM of the target (None: the backend's, where known)
    # --kv-tokens auto: the most tokens the fitted pool takes (None: all the room the plan leaves)
    kv_fit_cap: int | None = None
    engine_forward: str = "compile"  # JAX on TPU/GPU: "compile" sglang-jax's forward, or "estimate" it

    def __post_init__(self) -> None:
        for name in "micro_batch seq_len group_size prompts tp trainer_tp max_running_requests".split():
            if getattr(self, name) < 1:
                raise ValueError(f"PlanRequest.{name} must be >= 1, got {getattr(self, name)}")
        if self.fsdp < 0 or self.lora_rank < 0:
            raise ValueError("PlanRequest.fsdp and PlanRequest.lora_rank must be >= 0")
        from mllm_rl.trainer import PRECISIONS

        if self.precision not in PRECISIONS:
            raise ValueError(
                f"PlanRequest.precision: {self.precision!r}: choose one of {', '.join(PRECISIONS)}"
            )
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"PlanRequest.kv_tokens must be >= 1, got {self.kv_tokens}")
        if self.engine not in ENGINES:
            raise ValueError(f"PlanRequest.engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        if self.engine_forward not in ("compile", "estimate"):
            raise ValueError(f"PlanRequest.engine_forward {self.engine_forward!r}: compile or estimate")
        if not 0 < self.margin <= 1:
            raise ValueError(f"PlanRequest.margin must be in (0, 1], got {self.margin}")


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a backend's planner returns for one request."""

    target: Target
    components: dict[str, Component]
    functions: dict[str, FunctionMemory]
    notes: list[str] = dataclasses.field(default_factory=list)
    # Backend facts used when present: kv_cell_bytes, kv_pad_tokens (a pool of N tokens is (N + pad)
    # x cell bytes), kv_tokens, mem_fraction_static, compile_seconds {function: s},
    # host_peak_rss_bytes, engine_forward_pool_slots (the pool the compiled forward read).
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
