"""The setup phases every plan starts with: ``wandb_init``, ``<backend>_ready``,
``engine_ready_dummy`` (a rollout engine with dummy weights, behind ``ManagedEngine``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.phases.recorder import PhaseRecorder, Sink


def start(
    backend: Any,
    rec: PhaseRecorder,
    model: ModelDir,
    make_wandb: Callable[[], Sink | None],
    tp: int,
    platform: str,
    engine_kwargs: dict[str, Any],
    on_engine: Callable[[Any], None],
    **wandb_info: Any,
) -> ManagedEngine:
    """Record the three setup phases; returns the engine (handed to ``on_engine`` as soon as it
    exists: the caller owns its shutdown, after the sinks are closed)."""
    with rec.phase("wandb_init", **wandb_info) as ph:
        sink = make_wandb()
        if sink is not None:
            rec.sinks.append(sink)
            ph.info["wandb_dir"] = getattr(sink, "offline_dir", None)
        ph.info["wandb"] = "disabled" if sink is None else "enabled"
    with rec.phase(backend.ready_phase) as ph:
        ph.info.update(backend.init_runtime(tp=tp, platform=platform))
        rec.set_probe(backend.memory_probe())
    backend.check_engine_args(model, tp, **engine_kwargs)  # the engine choice decides what is valid
    with rec.phase("engine_ready_dummy", model=str(model.path), tp=tp) as ph:
        engine = ManagedEngine(backend.create_engine(model, tp=tp, **engine_kwargs))
        on_engine(engine)
        ph.info.update(engine_weight_bytes=engine.weight_bytes(), engine=type(engine.engine).__name__,
                       tags=list(engine.tags), weights_cpu_backup=engine.weights_cpu_backup)  # fmt: skip
        for key in ("context_length", "max_total_tokens", "max_running_requests"):
            if key in engine_kwargs:
                ph.info[key] = engine_kwargs[key]
    return engine
