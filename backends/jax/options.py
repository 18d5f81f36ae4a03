"""``ModelOptions``: how the JAX trainer lays out and runs the model (not what it computes).

Every option trades speed for memory or changes a layout; none changes the numbers beyond
float32 reduction order, except the dtypes, which say what is stored and computed in
(``tests/jax/test_model_paths.py`` compares each path with the default one). Imports nothing
heavy, so a CLI can build one before jax starts.

- ``tp``: tensor-parallel size of the trainer's ``("fsdp", "tp")`` mesh (``sharding.py``);
  ``fsdp`` = devices / ``tp``.
- ``scan_layers``: decoder blocks stacked [L, ...] and run under ``jax.lax.scan`` (compile
  time and program size flat in depth) instead of a Python loop.
- ``remat``: ``none`` (keep every activation for the backward pass), ``block``
  (``jax.checkpoint`` per decoder block: only each block's input is kept, the block is
  recomputed), ``dots`` (per block, keeping the outputs of the weight matmuls).
- ``attention``: ``dense`` | ``xla`` | ``chunked`` | ``splash`` (``attention.py``);
  ``attention_chunk``: query positions per chunk of ``chunked``.
- ``logprob_chunk``: positions per chunk of the output head (``logprob.py``); 0 = the
  whole [B, T, V] logits at once.
- ``param_dtype``: dtype of the stored params (None: the checkpoint's); ``compute_dtype``:
  dtype the forward runs in (None: the params'); ``opt_dtype``: dtype of the AdamW moments
  and of the update arithmetic (None: the params'). E.g. bf16 params with
  ``opt_dtype="float32"``, or float32 master params with ``compute_dtype="bfloat16"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

REMAT = ("none", "block", "dots")
ATTENTION = ("dense", "xla", "chunked", "splash")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    tp: int = 1
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "dense"
    attention_chunk: int = 512
    logprob_chunk: int = 0
    param_dtype: str | None = None
    compute_dtype: str | None = None
    opt_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"ModelOptions.tp must be >= 1, got {self.tp}")
        if self.remat not in REMAT:
            raise ValueError(f"ModelOptions.remat: {self.remat!r} is not one of {', '.join(REMAT)}")
        if self.attention not in ATTENTION:
            raise ValueError(
                f"ModelOptions.attention: {self.attention!r} is not one of {', '.join(ATTENTION)}"
            )
        if self.attention_chunk < 1 or self.logprob_chunk < 0:
            raise ValueError("ModelOptions.attention_chunk must be >= 1 and logprob_chunk >= 0")
        for name in ("param_dtype", "compute_dtype", "opt_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DTYPES:
                raise ValueError(f"ModelOptions.{name}: {v!r} is not one of {', '.join(DTYPES)} (or None)")

    @classmethod
    def for_platform(cls, platform: str, tp: int = 1) -> ModelOptions:
        """The trainer's default: on TPU the memory-lean paths (stacked layers under scan,
        per-block remat, splash attention, the head in 256-position chunks), which the model
        needs to fit there; elsewhere today's reference paths."""
        if platform == "tpu":
            return cls(tp=tp, scan_layers=True, remat="block", attention="splash", logprob_chunk=256)
        return cls(tp=tp)

    @staticmethod
    def _jnp(name: str | None) -> Any:
        if name is None:
            return None
        import jax.numpy as jnp

        return jnp.dtype(name)

    def compute_jnp_dtype(self) -> Any:
        """``compute_dtype`` as a numpy dtype, or None (compute in the params' dtype)."""
        return self._jnp(self.compute_dtype)

    def param_jnp_dtype(self, checkpoint: Any) -> Any:
        """The stored params' dtype: ``param_dtype``, else ``checkpoint``."""
        return self._jnp(self.param_dtype) or checkpoint

    def opt_jnp_dtype(self) -> Any:
        return self._jnp(self.opt_dtype)
