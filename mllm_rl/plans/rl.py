"""The RL plan: GRPO-style colocated training with the full memory lifecycle, any backend.

Setup phases (once per attempt; a ``--resume`` attempt repeats them):

1. ``wandb_init``, ``jax_ready``/``torch_ready``
2. ``engine_ready_dummy``  rollout engine up with dummy weights
3. ``mllm_rl.lifecycle.SETUP_PHASES``: the engine releases its dummy weights and KV cache,
   ``trainer_init`` builds the trainer from the checkpoint (or restores the run's last
   checkpoint with ``--resume``), ``weights_swapped`` streams its weights in (fingerprint-
   checked), the trainer goes to the host, the KV cache comes back

Then ``steps`` colocated steps (``mllm_rl.lifecycle``: rollout ... continue_generation), and
a final ``generate_result`` (greedy completions of held-out prompts and their reward).

Data is a pure function of ``(seed, step)``, so a resumed run sees the prompts it would
have seen; checkpoints are begun in the ``checkpoint`` phase of a step (written there, or from a
host snapshot in the background: ``mllm_rl.checkpoint.writer``), are complete only once their
``meta.json`` exists, and ``checkpoint_flush`` waits for the last write before the final phase.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.backend import Backend
from mllm_rl.checkpoint.resolve import RLCheckpoint
from mllm_rl.checkpoint.writer import Checkpointer
from mllm_rl.engine import ABORT, EngineOptions, SamplingParams
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.faults import fault
from mllm_rl.lifecycle import SETUP_PHASES as LIFECYCLE_SETUP
from mllm_rl.lifecycle import STEP_PHASES, LifecycleOptions, colocate, step_phases
from mllm_rl.option_error import OptionError
from mllm_rl.options.check import parse_key_value
from mllm_rl.options.schema import default
from mllm_rl.plans import setup
from mllm_rl.plans.base import Plan, PlanRun
from mllm_rl.progress import progress_bar
from mllm_rl.rl.advantages import ESTIMATORS, STDS, group_advantages
from mllm_rl.rl.batch import build_batch
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.tasks import Task, get_task
from mllm_rl.trainer import TrainConfig

SETUP_PHASES = ["wandb_init", "{ready}", "engine_ready_dummy", *LIFECYCLE_SETUP]
FINAL_PHASES = ["checkpoint_flush", "generate_result"]
PROBE_PROMPT = "abcabcab"
KEEP_CHECKPOINTS = 2
# Default learning rates (``--lr`` unset): ``tiny`` trains from random initialisation; any other
# model is taken as pretrained and fine-tuned at verl's default actor learning rate.
FROM_SCRATCH_LR = 3e-3
FINE_TUNE_LR = 1e-6
FROM_SCRATCH_PRESETS = ("tiny",)
DEFAULT_RUNNING = 128  # requests per batch when sizing the KV cache of an unset --max-running-requests
EVAL_STREAM = 2**31 - 1  # the held-out prompts' RNG stream (never a training step)


@dataclasses.dataclass
class RLOptions:
    steps: int = default("steps")
    prompts_per_step: int = default("prompts_per_step")
    group_size: int = default("group_size")
    max_new_tokens: int = 8
    temperature: float = default("temperature")
    top_p: float = default("top_p")
    estimator: str = default("estimator")
    adv_std: str = default("adv_std")  # the GRPO group std (``mllm_rl.rl.advantages``)
    lr_from_model: bool = False  # --lr unset: ``RLPlan.with_model`` sets ``train.lr`` from the model
    task: str = default("task")
    task_data: str | None = default("task_data")
    eval_prompts: int = default("eval_prompts")
    checkpoint_every: int = default(
        "checkpoint_every"
    )  # 0 = never; otherwise every N steps and always the last one
    # True: a trainer with a host snapshot (``Trainer.snapshot``) has it written in the background
    checkpoint_background: bool = default("checkpoint_background")
    resume_from: RLCheckpoint | None = None  # verified by the caller (``find_resumable``)
    seed: int = default("seed")
    platform: str = default("platform")
    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    lifecycle: LifecycleOptions = dataclasses.field(default_factory=LifecycleOptions)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise OptionError("steps", f"must be >= 1, got {self.steps}")
        if self.prompts_per_step < 1:
            raise OptionError("prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        if self.group_size < 2:
            raise OptionError(
                "group_size",
                f"{self.group_size}: group-relative advantages need >= 2 completions per "
                f"prompt (a group of one has advantage 0 and trains nothing)",
            )
        if self.estimator not in ESTIMATORS:
            raise OptionError("estimator", f"{self.estimator!r}: choose one of {', '.join(ESTIMATORS)}")
        if self.adv_std not in STDS:
            raise OptionError("adv_std", f"{self.adv_std!r}: choose one of {', '.join(STDS)}")
        if self.temperature <= 0:
            raise OptionError(
                "temperature",
                f"{self.temperature}: RL samples its groups (a temperature of 0 is greedy: every "
                f"completion of a prompt the same, advantage 0, nothing trains)",
            )
        if self.train.temperature != self.temperature:
            raise OptionError("temperature", f"the trainer's log-prob temperature {self.train.temperature} "
                              f"differs from the rollout's {self.temperature}")  # fmt: skip
        if self.checkpoint_every < 0:
            raise OptionError("checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
        if self.resume_from is not None and self.resume_from.step + 1 >= self.steps:
            raise OptionError(
                "steps",
                f"{self.steps}: the run is already past it ({self.resume_from.path} is step "
                f"{self.resume_from.step}); pass a larger --steps to continue it",
            )
        SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)

    @property
    def first_step(self) -> int:
        return 0 if self.resume_from is None else self.resume_from.step + 1


def default_lr(model_name: str) -> float:
    """The learning rate of a run without ``--lr`` (see ``FROM_SCRATCH_LR``)."""
    return FROM_SCRATCH_LR if model_name in FROM_SCRATCH_PRESETS else FINE_TUNE_LR


# -- checkpoints -------------------------------------------------------------------------
def checkpoint_meta(backend: str, opts: RLOptions) -> dict[str, Any]:
    """What a checkpoint's ``meta.json`` records besides its step and files, and what ``--resume``
    requires of it (``verify_rl_checkpoint(expect=...)``)."""
    return {"seed": opts.seed, "backend": backend, "lora_rank": opts.train.lora_rank,
            "precision": opts.train.precision}  # fmt: skip


SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings")  # fmt: skip


def model_shape(model: Any) -> dict[str, Any]:
    """The architecture a checkpoint's state has the shapes of (``meta.json``'s ``model_shape``)."""
    return {k: getattr(model.config, k) for k in SHAPE_KEYS}


def check_model_shape(ckpt: RLCheckpoint, model: Any) -> None:
    """A resumed checkpoint must have been trained on a model of this shape (``CheckpointError``
    naming its ``meta.json`` and the first field that differs), checked before any engine starts;
    a checkpoint written before shapes were recorded passes."""
    from mllm_rl.checkpoint.model_dir import CheckpointError

    saved = ckpt.meta.get("model_shape")
    if not isinstance(saved, dict):
        return
    for key, now in model_shape(model).items():
        if key in saved and saved[key] != now:
            raise CheckpointError(f"{ckpt.path / 'meta.json'}: written for a model with {key} {saved[key]}, "
                                  f"--model {model.path} has {now}")  # fmt: skip


def checkpointer(
    trainer: Any, run_dir: Path, backend: str, opts: RLOptions, background: bool, model: Any = None
) -> Checkpointer:
    """The ``checkpoint`` phase's work: save on the cadence (and the last step), then the manifest
    (sizes and sha256 of every file) in ``meta.json``; keeps the newest ``KEEP_CHECKPOINTS``.
    ``background``: from the trainer's host snapshot on another thread, when it has one."""
    meta = checkpoint_meta(backend, opts) | ({} if model is None else {"model_shape": model_shape(model)})
    return Checkpointer(trainer, run_dir, meta, opts.checkpoint_every, opts.steps,
                        KEEP_CHECKPOINTS, background)  # fmt: skip


# -- rollout -----------------------------------------------------------------------------
def _rng(seed: int, step: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, stream])


def make_rollout(task: Task, tok: Any, opts: RLOptions, eos: int):
    """The ``rollout`` phase's work: prompts of this step, ``group_size`` samples each,
    rewards, group-relative advantages, the training batch and its metrics."""

    def rollout(engine: ManagedEngine, step: int):
        examples = task.sample(_rng(opts.seed, step, 0), opts.prompts_per_step)
        prompt_ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in examples]
        g = opts.group_size
        ids = [p for p in prompt_ids for _ in range(g)]
        sampling = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                                  top_p=opts.top_p, stop_token_ids=(eos,),
                                  seed=int(_rng(opts.seed, step, 1).integers(2**31)))  # fmt: skip
        outs = engine.generate(ids, sampling)
        texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        rewards = np.array([task.reward(t, examples[i // g]) for i, t in enumerate(texts)], np.float64)
        if fault("reward_nan"):
            rewards[0] = np.nan
        adv = group_advantages(rewards, g, opts.estimator, std=opts.adv_std)
        batch = build_batch(ids, outs, adv)
        groups = rewards.reshape(-1, g)
        lens = np.array([len(o.token_ids) for o in outs])
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "reward_max": float(rewards.max()),
            "groups_zero_std": float((groups.std(axis=1) == 0).mean()),
            "completion_len_mean": float(lens.mean()),
            "rollout_tokens": int(lens.sum()),
            "aborted": int(sum(o.finish_reason == ABORT for o in outs)),
            "sample": {"prompt": examples[0].prompt, "answer": examples[0].answer, "completion": texts[0]},
        }
        return batch, metrics

    return rollout


def size_engine(task: Task, tok: Any, opts: RLOptions) -> EngineOptions:
    """``opts.engine`` with ``context_length`` / ``max_total_tokens`` filled in where unset.

    The context is the longest prompt seen in a sample of the task (every prompt of a
    file-backed task) plus ``max_new_tokens``, rounded up to a power of two (>= 64): the
    native CPU attention of sglang-jax costs O(batch x context) per decoded token, so a
    context sized to the task makes a tiny-model rollout ~10x faster than a generic 512.
    """
    eng = opts.engine
    ctx = eng.context_length
    if ctx is None:
        sample = getattr(task, "examples", None) or task.sample(_rng(opts.seed, EVAL_STREAM, 3), 512)
        longest = max(len(tok(e.prompt, add_special_tokens=False).input_ids) for e in sample)
        need = longest + opts.max_new_tokens + 1
        ctx = max(64, 1 << (need - 1).bit_length())
    total = eng.max_total_tokens or (eng.max_running_requests or DEFAULT_RUNNING) * ctx
    return dataclasses.replace(eng, context_length=ctx, max_total_tokens=total)


def evaluate(engine: ManagedEngine, task: Task, tok: Any, opts: RLOptions, eos: int) -> dict[str, Any]:
    """Greedy completions of ``eval_prompts`` held-out prompts (their own RNG stream)."""
    examples = task.sample(_rng(opts.seed, EVAL_STREAM, 2), opts.eval_prompts)
    ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in examples]
    sampling = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=0.0, stop_token_ids=(eos,))
    outs = engine.generate(ids, sampling)
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    rewards = [task.reward(t, e) for t, e in zip(texts, examples, strict=True)]
    return {
        "prompts": [e.prompt for e in examples],
        "answers": [e.answer for e in examples],
        "text": texts,
        "token_ids": [o.token_ids for o in outs],
        "greedy_reward_mean": float(np.mean(rewards)),
    }


# -- the plan ----------------------------------------------------------------------------
def run_rl(ctx: PlanRun, opts: RLOptions) -> dict[str, Any]:
    """Run the plan; returns a summary with the per-step metrics of this attempt; ``ctx.on_started``
    runs once the setup is done (engine up, trainer built or restored, weights synced)."""
    from transformers import AutoTokenizer

    backend, rec, model = ctx.backend, ctx.rec, ctx.model
    task = get_task(opts.task, opts.task_data)
    tok = AutoTokenizer.from_pretrained(str(model.path))
    eos = model.config.eos_token_id
    resume_from, first_step = opts.resume_from, opts.first_step
    lifecycle = dataclasses.replace(opts.lifecycle)
    if lifecycle.check_weights and not lifecycle.probe_ids:
        lifecycle.probe_ids = tuple(tok(PROBE_PROMPT, add_special_tokens=False).input_ids)

    engine = setup.start(backend, rec, model, ctx.make_wandb, ctx.runtime, size_engine(task, tok, opts),
                         ctx.on_engine, attempt_first_step=first_step)  # fmt: skip

    def make_trainer():
        trainer = backend.create_trainer(model, opts.train)
        if resume_from is None:
            return trainer, {}
        trainer.restore(resume_from.path)
        return trainer, {"restored_from": str(resume_from.path), "restored_verified": resume_from.verified}

    life = colocate(backend, engine, rec, lifecycle, make_trainer, lora_rank=opts.train.lora_rank)
    life.first_sync()
    ctx.on_started()

    rollout = make_rollout(task, tok, opts, eos)
    save = checkpointer(life.trainer, ctx.run_dir, backend.name, opts, opts.checkpoint_background, model)
    history = []
    try:
        with progress_bar(total=opts.steps, desc="rl", unit="step") as bar:
            bar.update(first_step)
            for step in range(first_step, opts.steps):
                metrics = life.step(step, rollout, save)
                rec.log_metrics(step, {k: v for k, v in metrics.items() if k != "sample"})
                history.append({"step": step, **metrics})
                bar.update(1)
                bar.set_postfix_str(f"reward {metrics['reward_mean']:.3f}")
        with rec.phase("checkpoint_flush") as ph:
            ph.info["written"] = save.flush()
    except BaseException:
        save.abandon()  # a checkpoint begun before the failure is still completed (and resumable)
        raise
    with rec.phase("generate_result") as ph:
        ph.info.update(evaluate(engine, task, tok, opts, eos))
    return {"first_step": first_step, "history": history, "eval": ph.info}


class RLPlan(Plan[RLOptions]):
    """GRPO-style colocated RL: ``SETUP_PHASES``, ``steps`` lifecycle steps, ``FINAL_PHASES``."""

    name = "rl"
    scope = "rl"
    summary = "colocated GRPO with every memory phase recorded"

    def options(self, args: argparse.Namespace, engine: EngineOptions, platform: str) -> RLOptions:
        loss = LossConfig(eps_low=args.eps_low, eps_high=args.eps_high, beta=args.kl_beta,
                          aggregation=args.loss_agg, max_len=args.max_new_tokens or 8,
                          clip_ratio_c=args.clip_ratio_c)  # fmt: skip
        lr = FROM_SCRATCH_LR if args.lr is None else args.lr  # the model's default: ``with_model``
        train = TrainConfig(lr=lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                            mini_batches=args.mini_batches, micro_batch_size=args.micro_batch_size, loss=loss,
                            lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, seed=args.seed,
                            temperature=args.temperature or 1.0,  # 0: RLOptions refuses it, saying why
                            precision=args.precision, trainer_tp=args.trainer_tp,
                            model_options=tuple(parse_key_value(o, "--model-option") for o in args.model_option or []))  # fmt: skip
        return RLOptions(
            steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
            max_new_tokens=args.max_new_tokens or 8, temperature=args.temperature, top_p=args.top_p,
            estimator=args.estimator, adv_std=args.adv_std, lr_from_model=args.lr is None, task=args.task,
            task_data=args.task_data, eval_prompts=args.eval_prompts, checkpoint_every=args.checkpoint_every,
            checkpoint_background=args.checkpoint_background, seed=args.seed, platform=platform, engine=engine,
            train=train,
            lifecycle=LifecycleOptions(schedule=args.schedule, check_weights=args.check_weights,
                                       old_logp=args.old_logp, tis_cap=args.tis_cap),
        )  # fmt: skip

    def with_model(self, opts: RLOptions, model: Any) -> tuple[RLOptions, list[str]]:
        """``--lr`` unset: ``FROM_SCRATCH_LR`` for the ``tiny`` preset (random initialisation),
        ``FINE_TUNE_LR`` for every other model (a pretrained checkpoint is fine-tuned)."""
        if opts.resume_from is not None:
            check_model_shape(opts.resume_from, model)
        if not opts.lr_from_model:
            return opts, []
        lr = default_lr(model.config.name)
        train = dataclasses.replace(opts.train, lr=lr)
        return dataclasses.replace(opts, train=train, lr_from_model=False), []

    def preflight(
        self, args: argparse.Namespace, opts: RLOptions, backend: Backend, run_dir: Path
    ) -> tuple[RLOptions, list[str]]:
        """The checkpoint ``--resume`` continues from (every newer one it skips, said), and the
        task's data file."""
        from mllm_rl.plans.preflight import resolve_resume

        notes: list[str] = []
        if args.resume or args.resume_or_start:
            ckpt, notes = resolve_resume(run_dir, checkpoint_meta(backend.name, opts), args.resume_or_start)
            if ckpt is not None:
                opts = dataclasses.replace(opts, resume_from=ckpt)
                notes.append(
                    f"resume: from {ckpt.path} (step {ckpt.step}; continuing at step {ckpt.step + 1})"
                )
            else:
                notes.append(
                    f"resume: nothing to resume in {run_dir}: starting at step 0 (--resume-or-start)"
                )
        try:
            get_task(args.task, args.task_data)
        except (ValueError, OSError) as e:
            msg = str(e)
            named = not args.task_data or args.task_data in msg or "--task-data" in msg
            raise ValueError(msg if named else f"--task-data {args.task_data}: {msg}") from None
        if args.task == "boxed" and args.task_data is None:
            from mllm_rl.tasks.boxed import SAMPLE_DATA

            notes.append(
                f"note: --task boxed without --task-data: training on the shipped sample {SAMPLE_DATA}"
            )
        return opts, notes

    def check_runtime(self, backend: Backend, model: Any, opts: RLOptions, process_count: int) -> None:
        self.require_release(backend, process_count)
        super().check_runtime(backend, model, opts, process_count)
        backend.check_trainer_args(model, opts.train)

    def phase_names(self) -> set[str]:
        names = {*SETUP_PHASES, *FINAL_PHASES, "check_weights"}
        return names | {p for phases in STEP_PHASES.values() for p in phases}

    def run_json(self, backend: Backend, opts: RLOptions) -> dict[str, Any]:
        """``run.json``'s plan fields (the report's completeness check reads them)."""
        return {
            "steps": opts.steps,
            "first_step": 0,
            "expected_phases": [p.format(ready=backend.ready_phase) for p in SETUP_PHASES] + FINAL_PHASES,
            "expected_step_phases": step_phases(opts.lifecycle),
            "schedule": opts.lifecycle.schedule,
            "task": opts.task,
            "group_size": opts.group_size,
            "prompts_per_step": opts.prompts_per_step,
            "train": dataclasses.asdict(opts.train),
            "checkpoint_every": opts.checkpoint_every,
            "checkpoint_background": opts.checkpoint_background,
        }

    def run(self, ctx: PlanRun, opts: RLOptions) -> dict[str, Any]:
        return run_rl(ctx, opts)


PLAN = RLPlan()
