"""The param-swap plan, backend-neutral: the setup phases (an engine with dummy weights), then
``weights_swapped`` (the checkpoint streamed in a tensor at a time, or the ``naive`` baseline:
every tensor placed, then installed) and a greedy ``generate_result`` of fixed prompts."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from mllm_rl.backend import Backend
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import EngineOptions, SamplingParams, UpdateStats, WeightExport, WeightMismatch
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.options.check import check_fields, from_args, opt
from mllm_rl.phases.recorder import PhaseRecorder
from mllm_rl.plans.base import Plan, PlanRun, start
from mllm_rl.progress import progress_bar

DEFAULT_PROMPTS = ("你是谁", "The capital of France is")
PHASES = ("wandb_init", "{ready}", "engine_ready_dummy", "weights_swapped", "generate_result")
SWAP_MAX_NEW_TOKENS = 16  # --max-new-tokens unset


@dataclasses.dataclass
class SwapOptions:
    platform: str = opt("platform", given=True)  # as the backends name it (``platform_of``)
    mode: str = opt("swap_mode")
    prompts: tuple[str, ...] = DEFAULT_PROMPTS  # --prompt, repeatable
    max_new_tokens: int = opt("max_new_tokens", default=SWAP_MAX_NEW_TOKENS, given=True)
    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        check_fields(self)


def encode_prompts(model: ModelDir, prompts: tuple[str, ...]) -> list[list[int]]:
    """Token ids of each prompt with the checkpoint's own tokenizer, ``[n_prompts][T_i]``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model.path))
    return [tok(p, add_special_tokens=False, verbose=False).input_ids for p in prompts]


class SwapPlan(Plan[SwapOptions]):
    """Dummy-init engine, then the checkpoint streamed in (``PHASES``); no steps."""

    name = "swap"
    scope = "swap"
    summary = "dummy-init engine + streamed weight swap"

    def options(self, args: argparse.Namespace, engine: EngineOptions, platform: str) -> SwapOptions:
        # a flag of another plan (--resume, --task-data, ...) was refused by ``mllm_rl.run.check_mode``
        return from_args(
            SwapOptions,
            args,
            platform=platform,
            prompts=tuple(args.prompt) if args.prompt else DEFAULT_PROMPTS,
            max_new_tokens=args.max_new_tokens or SWAP_MAX_NEW_TOKENS,
            engine=engine,
        )

    def phase_names(self) -> set[str]:
        return set(PHASES)

    def run_json(self, backend: Backend, opts: SwapOptions) -> dict[str, Any]:
        phases = [p.format(ready=backend.ready_phase) for p in PHASES]
        return {"steps": 0, "expected_phases": phases, "expected_step_phases": []}

    def run(self, ctx: PlanRun, opts: SwapOptions) -> dict[str, Any]:
        """The five phases; ``ctx.on_started`` once the weights are in."""
        prompt_ids = encode_prompts(ctx.model, opts.prompts)
        rec, model = ctx.rec, ctx.model
        engine = start(
            ctx.backend, rec, model, ctx.make_wandb, ctx.runtime, opts.engine.resolved(), ctx.on_engine
        )
        with rec.phase("weights_swapped", mode=opts.mode, checkpoint_bytes=model.nbytes) as ph:
            try:
                stats = swap_weights(engine, model, opts.mode, rec)
            except WeightMismatch as e:
                ph.info["fingerprint_ok"] = False
                raise WeightMismatch(f"weights_swapped: {e}") from None
            ph.info.update(
                tensors=stats.tensors,
                bytes=stats.bytes,
                seconds=round(stats.seconds, 4),
                gbps=round(stats.gbps, 3),
                fingerprint_ok=True,
                read_back=stats.read_back,
                check_s=round(stats.check_seconds, 4),
            )
        ctx.on_started()
        sampling = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=0.0)
        with rec.phase("generate_result", prompts=list(opts.prompts)) as ph:
            outs = engine.generate(prompt_ids, sampling)
            ph.info.update(
                prompt_ids=prompt_ids,
                token_ids=[o.token_ids for o in outs],
                logprobs=[[round(x, 6) for x in o.logprobs] for o in outs],
                text=[o.text for o in outs],
            )
        return {"swap": ph.info, "tensors": stats.tensors, "gbps": stats.gbps}


def swap_weights(
    engine: ManagedEngine, model: ModelDir, mode: str, rec: PhaseRecorder | None = None
) -> UpdateStats:
    """Stream (or naively load, then install) every checkpoint tensor into ``engine``, fingerprint
    checked (``WeightMismatch``)."""
    with progress_bar(total=len(model.tensors), desc=f"swap ({mode})", unit="tensor") as bar:

        def on_tensor(name: str, nbytes: int) -> None:
            if rec is not None:
                rec.sample_high_point(nbytes)
            bar.update(1)

        if mode == "naive":
            placed = engine.place_all(model.iter_tensors())
            if rec is not None:
                rec.sample()  # both copies are resident now
            return engine.update_weights(placed, on_tensor=on_tensor)
        export = WeightExport(list(model.tensors), model.iter_tensors(), full=True)
        return engine.update_weights(export, on_tensor=on_tensor)


PLAN = SwapPlan()
