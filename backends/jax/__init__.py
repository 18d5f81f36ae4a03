"""JAX backend: sglang-jax rollout engine, flax nnx model, JAX memory probe.

This module stays import-light: jax is imported only in ``init_runtime`` so that
XLA flags (fake CPU devices for ``--tp``) can be set first.
"""

from __future__ import annotations

import os
from typing import Any

from mllm_rl.checkpoint.model_dir import ModelDir


def _force_cpu_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


class JaxBackend:
    name = "jax"
    ready_phase = "jax_ready"

    def init_runtime(self, tp: int = 1, platform: str = "auto") -> dict[str, Any]:
        """Import jax with enough (fake) CPU devices for ``tp``, assert the platform.

        Raises ``RuntimeError`` when ``platform`` is not what jax came up with (e.g. a
        stale process holds the TPU and jax fell back to CPU).
        """
        if tp > 1:
            _force_cpu_devices(tp)
        if platform == "cpu":
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        got = jax.devices()[0].platform
        if platform != "auto" and got != platform:
            raise RuntimeError(f"--platform {platform}: jax came up on {got!r} ({jax.devices()[0]})")
        from mllm_rl.backends.jax.probe import per_device_counts

        return {
            "platform": got,
            "jax_version": jax.__version__,
            "devices": [str(d) for d in jax.local_devices()],
            "device_counts": per_device_counts(),
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
        }

    def memory_probe(self):
        from mllm_rl.backends.jax.probe import JaxMemoryProbe

        return JaxMemoryProbe()

    def check_engine_args(self, model: ModelDir, tp: int) -> None:
        """Validate before any engine starts (sglang-jax kills the host on a bad init)."""
        import jax

        from mllm_rl.backends.jax.sglang_engine import validate_engine_args

        validate_engine_args(model, tp, len(jax.devices()))

    def create_engine(self, model: ModelDir, tp: int = 1, **kw: Any):
        from mllm_rl.backends.jax.sglang_engine import SglangJaxEngine

        return SglangJaxEngine(model, tp=tp, **kw)

    def place_all(self, engine, model: ModelDir) -> list[tuple[str, Any]]:
        """Naive-swap baseline: every checkpoint tensor placed on device at once (2 copies)."""
        from mllm_rl.backends.jax.sglang_engine import Placed

        return [(name, Placed(engine.place(name, arr))) for name, arr in model.iter_tensors()]
