"""``ModelOptions``: how the JAX trainer lays out and runs the model (not what it computes).

Only the dtypes change the numbers beyond float32 reduction order (``tests/jax/test_model_paths.py``).
Imports nothing heavy. The defaults are the TPU path everywhere, so CPU tests exercise it; only
attention depends on the platform (``splash`` on TPU, ``dense`` elsewhere).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mllm_rl.trainer import PRECISIONS

REMAT = ("none", "block", "dots")
ATTENTION = ("dense", "xla", "chunked", "splash")
DTYPES = ("float32", "bfloat16")
OPTIMIZER_MEMORY = ("device", "host")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    tp: int = 1  # tensor-parallel size of the ("fsdp", "tp") mesh; fsdp = devices / tp
    scan_layers: bool = True  # blocks stacked [L, ...] under jax.lax.scan (compile time flat in depth)
    remat: str = "block"  # none | block (jax.checkpoint per block) | dots (keep matmul outputs)
    attention: str = "dense"  # dense | xla | chunked | splash (attention.py)
    attention_chunk: int = 512  # query positions per chunk of ``chunked``
    logprob_chunk: int = 256  # positions per head chunk (model.token_logprobs); 0 = whole [B, T, V] logits
    param_dtype: str | None = None  # the three dtypes: None leaves them to ``resolved`` (precision)
    compute_dtype: str | None = None
    opt_dtype: str | None = None
    # device (offloaded between steps) or host (pinned_host, streamed by host_optimizer.py; same numbers)
    optimizer_memory: str = "device"

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"ModelOptions.tp must be >= 1, got {self.tp}")
        choices = {"remat": REMAT, "attention": ATTENTION, "optimizer_memory": OPTIMIZER_MEMORY}
        for name, allowed in choices.items():
            if (v := getattr(self, name)) not in allowed:
                raise ValueError(f"ModelOptions.{name}: {v!r} is not one of {', '.join(allowed)}")
        if self.attention_chunk < 1 or self.logprob_chunk < 0:
            raise ValueError("ModelOptions.attention_chunk must be >= 1 and logprob_chunk >= 0")
        for name in ("param_dtype", "compute_dtype", "opt_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DTYPES:
                raise ValueError(f"ModelOptions.{name}: {v!r} is not one of {', '.join(DTYPES)} (or None)")

    @classmethod
    def for_platform(cls, platform: str, tp: int = 1) -> ModelOptions:
        """The trainer's default on ``platform``: splash attention on TPU, dense elsewhere."""
        return cls(tp=tp, attention="splash") if platform == "tpu" else cls(tp=tp)

    @classmethod
    def for_run(cls, platform: str, tp: int = 1, options: dict[str, Any] | None = None) -> ModelOptions:
        """``for_platform`` with ``options`` (``--model-option`` pairs) applied; ValueError naming a bad one."""
        base = cls.for_platform(platform, tp=tp)
        options = dict(options or {})
        if "remat" in options and options["remat"] is None:  # KEY=VALUE parses ``remat=none`` as None
            options["remat"] = "none"
        known = {f.name for f in dataclasses.fields(cls)} - {"tp"}
        bad = sorted(set(options) - known)
        if bad:
            raise ValueError(
                f"--model-option {bad[0]}: unknown; the JAX trainer's options are {', '.join(sorted(known))}"
            )
        try:
            return dataclasses.replace(base, **options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--model-option: {e}") from None

    def compute_jnp_dtype(self) -> Any:
        """``compute_dtype`` as a numpy dtype, or None (compute in the params' dtype)."""
        if self.compute_dtype is None:
            return None
        import jax.numpy as jnp

        return jnp.dtype(self.compute_dtype)

    def resolved(self, checkpoint: Any, precision: str = "mixed", lora: bool = False) -> Dtypes:
        """The dtypes the trainer stores, computes and optimises in: ``mixed`` on a 16-bit
        checkpoint keeps float32 trainable params and moments, computing in the checkpoint dtype
        (a LoRA base stays 16-bit); ``pure`` keeps everything in the checkpoint dtype."""
        import jax.numpy as jnp

        if precision not in PRECISIONS:
            raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
        ckpt = jnp.dtype(checkpoint).name
        master = "float32" if precision == "mixed" and jnp.dtype(checkpoint).itemsize < 4 else ckpt
        params = self.param_dtype or (ckpt if lora else master)
        adapters = self.param_dtype or master
        trainable = adapters if lora else params
        return Dtypes(
            params=params,
            adapters=adapters,
            compute=self.compute_dtype or self.param_dtype or ckpt,
            opt=self.opt_dtype or trainable,
            export=ckpt,
            lora=lora,
        )


@dataclasses.dataclass(frozen=True)
class Dtypes:
    """``ModelOptions.resolved``: dtype names of what the trainer holds and computes."""

    params: str  # the model's ``Param``s as stored (in LoRA mode the frozen base)
    adapters: str  # the LoRA adapters, the trainable state in LoRA mode
    compute: str  # every matmul of forward and backward (gradients accumulate in the stored dtype)
    opt: str  # the AdamW moments and the update arithmetic
    export: str  # the checkpoint's dtype: what the engine gets and the fingerprint hashes
    lora: bool = False

    @property
    def trainable(self) -> str:
        return self.adapters if self.lora else self.params
