"""``ModelOptions``: how the JAX trainer lays out and runs the model (not what it computes).

Every option trades speed for memory or changes a layout; none changes the numbers beyond
float32 reduction order (``tests/jax/test_model_paths.py`` compares each path with the
default one). Imports nothing heavy, so a CLI can build one before jax starts.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    tp: int = 1  # tensor-parallel size of the trainer's ("fsdp", "tp") mesh; fsdp = devices / tp

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"ModelOptions.tp must be >= 1, got {self.tp}")
