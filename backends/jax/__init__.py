"""JAX backend: sglang-jax rollout engine, flax nnx model, JAX memory probe.

Import-light: jax is imported only in ``init_distributed`` and ``init_runtime``, so that XLA
flags (fake CPU devices for ``--tp``) and ``jax.distributed`` come first.
"""

from __future__ import annotations

import os
from typing import Any

from mllm_rl.backend import Backend
from mllm_rl.backends.jax import compile_cache, distributed
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import EngineOptions

PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"


def gpu_allocates_on_demand(env: dict[str, str] | None = None) -> None:
    """Unless set, ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (JAX would reserve 75% of a GPU)."""
    env = os.environ if env is None else env
    env.setdefault(PREALLOCATE, "false")


class JaxBackend(Backend):
    name = "jax"
    # sglang-jax: node 0 pauses and flushes, every process releases its own shards
    releases_across_processes = True
    ready_phase = "jax_ready"
    engines = {"auto": "sglang-jax"}  # --engine choices (EngineOptions.check_backend)

    def __init__(self) -> None:
        compile_cache.configure()  # before anything imports jax: the memory plan compiles first

    def init_distributed(self, tp: int = 1) -> dict[str, int]:
        """Join a multi-process run when the environment describes one (before ``init_runtime``)."""
        gpu_allocates_on_demand()
        return distributed.init_distributed(tp=tp)

    def coordinator(self) -> Any:
        return distributed.coordination()

    def shutdown_distributed(self) -> None:
        distributed.shutdown()

    def init_runtime(self, tp: int = 1, platform: str = "auto") -> dict[str, Any]:
        """Import jax with enough (fake) CPU devices for ``tp``; RuntimeError when ``platform`` is
        not what jax came up with, or processes came up on different platforms."""
        procs = distributed.procs()
        if tp > 1 and procs.count == 1:  # multi-process: init_distributed asked for tp // count each
            distributed.force_cpu_devices(tp)
        gpu_allocates_on_demand()
        if platform == "cpu":
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        got = jax.devices()[0].platform
        distributed.agree_on_platform(got)  # first: a process failing alone would leave others waiting
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
            "global_device_count": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind,
            "xla_python_client_preallocate": os.environ.get(PREALLOCATE),
            "compile_cache": jax.config.jax_compilation_cache_dir or None,
        }

    def memory_probe(self):
        from mllm_rl.backends.jax.probe import JaxMemoryProbe

        return JaxMemoryProbe()

    def check_engine_args(self, model: ModelDir, opts: EngineOptions) -> None:
        """Validate before any engine starts (sglang-jax kills the host on a bad init)."""
        import jax

        from mllm_rl.backends.jax.sglang_engine import validate_engine_args

        opts.check_backend(self.name, self.engines)
        validate_engine_args(model, opts.tp, len(jax.devices()), distributed.procs().count)

    def create_engine(self, model: ModelDir, opts: EngineOptions):
        """An sglang-jax engine with dummy weights (``opts.ports[0]``: a multi-process engine's port)."""
        from mllm_rl.backends.jax.sglang_engine import SglangJaxEngine

        opts.check_backend(self.name, self.engines)
        return SglangJaxEngine(model, ports=opts.ports, **opts.start_kwargs())

    def check_trainer_args(self, model: ModelDir, cfg: Any) -> None:
        """``--model-option`` names ``ModelOptions`` fields; ``--trainer-tp`` divides devices and heads."""
        import jax

        from mllm_rl.backends.jax.topologies import check_trainer_mesh

        self._model_options(cfg)
        c = model.config
        check_trainer_mesh(
            cfg.trainer_tp, cfg.fsdp, len(jax.devices()), c.num_attention_heads, c.num_key_value_heads
        )

    def _model_options(self, cfg: Any) -> Any:
        import jax

        from mllm_rl.backends.jax.options import ModelOptions

        return ModelOptions.for_run(
            jax.devices()[0].platform, tp=cfg.trainer_tp, options=dict(cfg.model_options)
        )

    def create_trainer(self, model: ModelDir, cfg: Any):
        from mllm_rl.backends.jax.trainer import JaxTrainer

        return JaxTrainer(model, cfg, self._model_options(cfg))

    def empty_cache(self) -> None:
        """Nothing to do: XLA returns a deleted array's memory to its allocator at once."""

    def profiler(self):
        from mllm_rl.backends.jax.profiler import JaxProfiler

        return JaxProfiler()
