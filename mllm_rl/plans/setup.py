"""The setup phases every plan starts with: ``wandb_init``, ``<backend>_ready``,
``engine_ready_dummy`` (a rollout engine with dummy weights, behind ``ManagedEngine``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import EngineOptions
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.phases.recorder import PhaseRecorder, Sink
from mllm_rl.progress import waiting


def run_level(
    backend: Any,
    rec: PhaseRecorder,
    make_wandb: Callable[[], Sink | None],
    runtime: dict[str, Any],
    **info: Any,
) -> None:
    """``wandb_init`` (the W&B sink joins the recorder) and ``<backend>_ready`` (installs the probe)."""
    with rec.phase("wandb_init", **info) as ph, waiting("W&B start"):
        sink = make_wandb()
        if sink is not None:
            rec.sinks.append(sink)
            ph.info["wandb_dir"] = getattr(sink, "offline_dir", None)
            ph.info["wandb_mode"] = getattr(sink, "mode", None)
            if getattr(sink, "fallback_reason", None):
                ph.info["wandb_fallback"] = sink.fallback_reason
        ph.info["wandb"] = "disabled" if sink is None else "enabled"
    with rec.phase(backend.ready_phase) as ph:
        ph.info.update(runtime)
        rec.set_probe(backend.memory_probe())


def start(
    backend: Any,
    rec: PhaseRecorder,
    model: ModelDir,
    make_wandb: Callable[[], Sink | None],
    runtime: dict[str, Any],
    engine_opts: EngineOptions,
    on_engine: Callable[[Any], None],
    **wandb_info: Any,
) -> ManagedEngine:
    """Record the three setup phases; the engine (also to ``on_engine`` as soon as it exists)."""
    run_level(backend, rec, make_wandb, runtime, **wandb_info)
    with rec.phase("engine_ready_dummy", model=str(model.path), tp=engine_opts.tp) as ph:
        with waiting("engine start"):
            engine = ManagedEngine(backend.create_engine(model, engine_opts))
        on_engine(engine)
        ph.info.update(
            engine_weight_bytes=engine.weight_bytes(),
            engine=type(engine.engine).__name__,
            tags=list(engine.tags),
            weights_cpu_backup=engine.weights_cpu_backup,
        )
        opts = dataclasses.asdict(engine_opts)
        for key in ("context_length", "max_total_tokens", "max_running_requests"):
            if opts[key] is not None:
                ph.info[key] = opts[key]
    return engine
