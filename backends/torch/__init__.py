"""Torch backend (GPU parity; also CPU): embedded torch engine or SGLang, torch memory probe.

Import-light: loading this module (the ``mllm_rl.backends`` entry point) imports neither
torch nor jax; torch is imported inside the methods.

Engines (``create_engine(..., engine=...)``):

- ``"embedded"``: ``backends/torch/engine.py``, our torch Qwen3 on one device (CPU or CUDA),
  torch_memory_saver regions on CUDA;
- ``"sglang"``: ``backends/torch/sglang_engine.py``, an in-process ``sglang.Engine`` (CUDA);
- ``"auto"`` (default): SGLang when it is importable *and* the runtime is on CUDA, else embedded.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from mllm_rl.checkpoint.model_dir import ModelDir

ENGINES = ("auto", "embedded", "sglang")


class TorchBackend:
    name = "torch"
    ready_phase = "torch_ready"

    def __init__(self) -> None:
        self.device: Any = None  # torch.device, set by init_runtime

    def init_runtime(self, tp: int = 1, platform: str = "auto") -> dict[str, Any]:
        """Import torch and pick the device; assert ``platform``.

        ``platform``: ``auto`` (CUDA when available, else CPU), ``cpu`` (CPU even when CUDA
        exists), ``gpu``/``cuda`` (``RuntimeError`` when torch sees no CUDA device).
        """
        if platform not in ("auto", "cpu", "gpu", "cuda"):
            raise RuntimeError(f"--platform {platform}: the torch backend runs on cpu or cuda")
        import torch

        cuda = torch.cuda.is_available()
        if platform in ("gpu", "cuda") and not cuda:
            raise RuntimeError(
                f"--platform {platform}: torch {torch.__version__} sees no CUDA device "
                f"(torch.version.cuda={torch.version.cuda})"
            )
        self.device = torch.device("cuda" if cuda and platform != "cpu" else "cpu")
        devices = (
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if self.device.type == "cuda" else ["cpu"]
        )  # fmt: skip
        return {
            "platform": self.device.type,
            "torch_version": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cuda_available": cuda,
            "devices": devices,
            "device": str(self.device),
            "sglang_importable": importlib.util.find_spec("sglang") is not None,
            "torch_memory_saver_importable": importlib.util.find_spec("torch_memory_saver") is not None,
        }

    def _device(self) -> Any:
        if self.device is None:
            self.init_runtime()
        return self.device

    def memory_probe(self):
        from mllm_rl.backends.torch.probe import make_probe

        return make_probe(self._device())

    def resolve_engine(self, engine: str = "auto") -> str:
        """``embedded`` or ``sglang`` for an ``engine`` choice (ValueError when unknown/impossible)."""
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: choose one of {', '.join(ENGINES)}")
        sglang = importlib.util.find_spec("sglang") is not None
        if engine == "auto":
            return "sglang" if sglang and self._device().type == "cuda" else "embedded"
        if engine == "sglang" and not (sglang and self._device().type == "cuda"):
            raise ValueError("engine 'sglang' needs the sglang package and a CUDA device")
        return engine

    def check_engine_args(self, model: ModelDir, tp: int, engine: str = "auto", **engine_kwargs: Any) -> None:
        """Validate before any engine starts: the embedded engine runs on one device."""
        if tp < 1:
            raise ValueError(f"--tp must be >= 1, got {tp}")
        kind = self.resolve_engine(engine)
        if kind == "embedded" and tp != 1:
            raise ValueError(
                f"--tp {tp}: the embedded torch engine runs on one device; tp > 1 needs SGLang on CUDA"
            )
        if kind == "sglang":
            import torch

            if tp > torch.cuda.device_count():
                raise ValueError(f"--tp {tp}: {torch.cuda.device_count()} CUDA device(s) visible")
            model.check_tp(tp)

    def create_engine(
        self,
        model: ModelDir,
        tp: int = 1,
        max_total_tokens: int = 4096,
        context_length: int = 512,
        seed: int = 0,
        chunk_bytes: int = 64 * 2**20,
        weights_cpu_backup: bool = False,
        max_running_requests: int = 128,
        engine: str = "auto",
        task: str | None = None,
        ports: list[int] | None = None,
    ):
        """``task``/``ports`` (multi-task runs): the engine's memory tags are ``<task>/...``; a
        server engine (SGLang) binds ``ports`` (from the run's one allocator) instead of picking."""
        kind = self.resolve_engine(engine)
        if kind == "sglang":
            from mllm_rl.backends.torch.sglang_engine import SglangEngine

            return SglangEngine(model, tp=tp, max_total_tokens=max_total_tokens, context_length=context_length,
                                seed=seed, chunk_bytes=chunk_bytes, weights_cpu_backup=weights_cpu_backup,
                                max_running_requests=max_running_requests, task=task, ports=ports)  # fmt: skip
        from mllm_rl.backends.torch.engine import EmbeddedEngine

        return EmbeddedEngine(model, tp=tp, max_total_tokens=max_total_tokens, context_length=context_length,
                              seed=seed, chunk_bytes=chunk_bytes, weights_cpu_backup=weights_cpu_backup,
                              max_running_requests=max_running_requests, device=self._device(),
                              task=task)  # fmt: skip

    def place_all(self, engine: Any, model: ModelDir) -> list[tuple[str, Any]]:
        """Naive-swap baseline: every checkpoint tensor placed on the device first (two copies)."""
        from mllm_rl.backends.torch.engine import Placed

        return [(name, Placed(engine.place(name, arr))) for name, arr in model.iter_tensors()]

    def create_trainer(self, model: ModelDir, cfg: Any):
        """``TorchTrainer`` (``backends/torch/trainer.py``) on the runtime's device."""
        from mllm_rl.backends.torch.trainer import TorchTrainer

        return TorchTrainer(model, cfg, device=self._device())

    def empty_cache(self) -> None:
        """Return cached-but-free CUDA memory to the driver (no-op on CPU)."""
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
