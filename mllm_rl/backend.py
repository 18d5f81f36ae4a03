"""The backend interface: what ``--backend NAME`` resolves to (docs/DESIGN.md, "Contracts").

Registered in the ``mllm_rl.backends`` entry-point group (``mllm_rl.backend_registry``); optional
capabilities have the right default for a backend without them. Subclasses import their framework
inside methods (``--backend jax`` never imports torch, and the reverse)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from mllm_rl.checkpoint.model_dir import ModelDir
    from mllm_rl.coordination import Coordinator
    from mllm_rl.engine import EngineOptions, EnginePrimitives
    from mllm_rl.phases.probe import MemoryProbe
    from mllm_rl.profiling import StepProfiler
    from mllm_rl.trainer import TrainConfig, Trainer

SINGLE_PROCESS = {"process_index": 0, "process_count": 1}


class Backend(abc.ABC):
    """One ML framework's runtime, engines and trainer."""

    name: ClassVar[str]  # "jax" | "torch": the --backend name, the phase records' ``backend``
    ready_phase: ClassVar[str]  # the setup phase that records init_runtime ("jax_ready")
    engines: ClassVar[dict[str, str]]  # --engine choices -> what each starts (EngineOptions.check_backend)
    # Can an engine spanning several processes pause, release and resume? Without it only plans
    # that never release run across processes.
    releases_across_processes: ClassVar[bool] = False

    # -- required --------------------------------------------------------------------------
    @abc.abstractmethod
    def init_runtime(self, tp: int = 1, platform: str = "auto") -> dict[str, Any]:
        """Import the framework, find the devices, assert ``platform``; returns what the
        ``<name>_ready`` phase records. ``RuntimeError`` when the platform is not as asserted."""

    @abc.abstractmethod
    def memory_probe(self) -> MemoryProbe:
        """Device memory (per device, peak) and host RSS, read at every phase boundary."""

    @abc.abstractmethod
    def check_engine_args(self, model: ModelDir, opts: EngineOptions) -> None:
        """Reject ``create_engine``'s options before any engine starts (``ValueError`` naming the flag)."""

    @abc.abstractmethod
    def create_engine(self, model: ModelDir, opts: EngineOptions) -> EnginePrimitives:
        """A rollout engine for ``model`` started with dummy weights (``opts`` unset sizes are
        filled by ``EngineOptions.resolved``)."""

    def check_trainer_args(self, model: ModelDir, cfg: TrainConfig) -> None:
        """Like ``check_engine_args``, for ``create_trainer``'s settings. Default: no model options,
        no trainer tp."""
        if cfg.model_options:
            raise ValueError(
                f"--model-option {cfg.model_options[0][0]}: the {self.name} backend's model takes no options"
            )
        if cfg.trainer_tp != 1:
            raise ValueError(
                f"--trainer-tp {cfg.trainer_tp}: the {self.name} trainer has no tensor parallelism"
            )

    @abc.abstractmethod
    def create_trainer(self, model: ModelDir, cfg: TrainConfig) -> Trainer:
        """A trainer holding ``model``'s weights on the devices."""

    # -- optional, with the single-process / nothing-to-do default -------------------------
    def init_distributed(self, tp: int = 1) -> dict[str, int]:
        """Join a multi-process run when the environment describes one; runs before
        ``init_runtime``. Returns ``{"process_index", "process_count"}``."""
        return dict(SINGLE_PROCESS)

    def shutdown_distributed(self) -> None:
        """Leave the multi-process run (every process, before exiting; idempotent)."""
        return None

    def coordinator(self) -> Coordinator | None:
        """Lease handoffs between the processes of a multi-task run; ``None``: single-process."""
        return None

    def empty_cache(self) -> None:
        """Return cached-but-free device memory to the device (nothing to do by default)."""
        return None

    def rollout_engine(self, engine: str) -> str:
        """The rollout engine ``--engine engine`` starts (``PlanRequest.engine``); default: itself."""
        return engine

    def profiler(self) -> StepProfiler | None:
        """The framework's profiler for ``--profile`` (``mllm_rl.profiling``); ``None``: this
        backend has none (``--profile`` is refused before start-up)."""
        return None
