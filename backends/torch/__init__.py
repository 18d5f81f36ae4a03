"""Torch backend (CUDA or CPU): the embedded torch engine (``engine.py``) or SGLang
(``sglang_engine.py``), the torch trainer and memory probe. Import-light: torch is imported inside
the methods."""

from __future__ import annotations

import importlib.util
from typing import Any

from mllm_rl.backend import Backend
from mllm_rl.backends.torch import distributed
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import EngineOptions

ENGINES = {
    "auto": "SGLang when importable on CUDA, else embedded",
    "embedded": "the torch engine of this package, one device",
    "sglang": "SGLang, CUDA",
}


class TorchBackend(Backend):
    name = "torch"
    ready_phase = "torch_ready"
    engines = ENGINES  # --engine choices (EngineOptions.check_backend)
    # several processes: each its own embedded engine (data parallel), released and resumed locally
    releases_across_processes = True

    def __init__(self) -> None:
        self.device: Any = None  # torch.device, set by init_runtime

    def init_runtime(self, tp: int = 1, platform: str = "auto") -> dict[str, Any]:
        """Import torch and pick the device (``auto``: CUDA when available; ``cpu``; ``gpu``/``cuda``)."""
        if platform not in ("auto", "cpu", "gpu", "cuda"):
            raise RuntimeError(f"--platform {platform}: the torch backend runs on cpu or cuda")
        import torch

        cuda = torch.cuda.is_available()
        if platform in ("gpu", "cuda") and not cuda:
            raise RuntimeError(
                f"--platform {platform}: torch {torch.__version__} sees no CUDA device "
                f"(torch.version.cuda={torch.version.cuda})"
            )
        procs = distributed.procs()
        if cuda and platform != "cpu" and procs.count > 1:  # one device per process
            self.device = torch.device("cuda", procs.local_index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cuda" if cuda and platform != "cpu" else "cpu")
        devices = ["cpu"]
        if self.device.type == "cuda":
            devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
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

    def init_distributed(self, tp: int = 1) -> dict[str, int]:
        """Join a multi-process run described by torchrun's variables (one process per device)."""
        procs = distributed.init_distributed()
        return {"process_index": procs.index, "process_count": procs.count}

    def shutdown_distributed(self) -> None:
        distributed.shutdown()

    def coordinator(self):
        return distributed.coordination()

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

    def rollout_engine(self, engine: str) -> str:
        return self.resolve_engine(engine)

    def check_engine_args(self, model: ModelDir, opts: EngineOptions) -> None:
        """Validate before any engine starts: the embedded engine runs on one device."""
        opts.check_backend(self.name, self.engines)
        tp, kind = opts.tp, self.resolve_engine(opts.engine)
        if kind == "embedded" and tp != 1:
            raise ValueError(
                f"--tp {tp}: the embedded torch engine runs on one device; tp > 1 needs SGLang on CUDA"
            )
        if kind == "embedded" and opts.mem_fraction_static is not None:
            raise ValueError(
                "--mem-fraction-static: the embedded torch engine sizes its KV cache by "
                "--max-total-tokens; the fraction is SGLang's"
            )
        if kind == "sglang":
            import torch

            if distributed.procs().count > 1:
                raise ValueError(
                    f"--engine {opts.engine}: SGLang across {distributed.procs().count} processes is not "
                    f"supported yet; --engine embedded runs one engine per process"
                )
            if tp > torch.cuda.device_count():
                raise ValueError(f"--tp {tp}: {torch.cuda.device_count()} CUDA device(s) visible")
            model.check_tp(tp)

    def create_engine(self, model: ModelDir, opts: EngineOptions):
        """The engine ``opts.engine`` resolves to, with dummy weights (SGLang binds ``opts.ports``)."""
        opts.check_backend(self.name, self.engines)
        kind = self.resolve_engine(opts.engine)
        kwargs = opts.start_kwargs()
        if kind == "sglang":
            from mllm_rl.backends.torch.sglang_engine import SglangEngine

            return SglangEngine(model, ports=list(opts.ports) if opts.ports else None, **kwargs)
        from mllm_rl.backends.torch.engine import EmbeddedEngine

        kwargs.pop("mem_fraction_static", None)  # refused by check_engine_args: the pool is max_total_tokens
        return EmbeddedEngine(model, device=self._device(), **kwargs)

    def check_trainer_args(self, model: ModelDir, cfg: Any) -> None:
        """``--model-option`` names ``TorchModelOptions`` fields; ``--fsdp`` 0, 1 or the process count;
        no tensor parallelism, no checkpoint compression."""
        from mllm_rl.backends.torch import fsdp
        from mllm_rl.backends.torch.options import TorchModelOptions

        TorchModelOptions.from_pairs(cfg.model_options)
        fsdp.resolve(cfg.fsdp, distributed.procs().count)
        if cfg.trainer_tp != 1:
            raise ValueError(
                f"--trainer-tp {cfg.trainer_tp}: the {self.name} trainer has no tensor parallelism"
            )
        if cfg.checkpoint_compression:
            raise ValueError(
                f"--checkpoint-compression: the {self.name} trainer writes its state uncompressed "
                "(the option is the JAX trainer's: orbax's zstd)"
            )

    def create_trainer(self, model: ModelDir, cfg: Any):
        """``TorchTrainer`` on the runtime's device."""
        from mllm_rl.backends.torch.trainer import TorchTrainer

        return TorchTrainer(model, cfg, device=self._device())

    def empty_cache(self) -> None:
        """Return cached-but-free CUDA memory to the driver (no-op on CPU)."""
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def profiler(self):
        from mllm_rl.backends.torch.profiler import TorchProfiler

        return TorchProfiler()
