"""The RL plan: GRPO-style colocated training with the full memory lifecycle, any backend.

Every attempt records the setup phases, then ``steps`` colocated steps, ``checkpoint_flush`` and a
greedy ``generate_result``. Data is a pure function of ``(seed, step)``: a resumed run sees the
prompts it would have seen."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.backend import Backend
from mllm_rl.checkpoint.hf_config import REQUIRED as REQUIRED_SHAPE
from mllm_rl.checkpoint.resolve import RLCheckpoint
from mllm_rl.checkpoint.writer import Checkpointer, check_shared_dir
from mllm_rl.coordination import Coordinator, LocalCoordinator, coordinator_for
from mllm_rl.engine import ABORT, EngineOptions, SamplingParams
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.faults import fault
from mllm_rl.lifecycle import SETUP_PHASES as LIFECYCLE_SETUP
from mllm_rl.lifecycle import STEP_PHASES, LifecycleOptions, colocate, step_phases
from mllm_rl.memplan.kv import pool_requests
from mllm_rl.option_error import OptionError
from mllm_rl.options.check import check_fields, from_args, opt, parse_key_value
from mllm_rl.options.schema import FINE_TUNE_LR, FROM_SCRATCH_LR, KV_AUTO, default
from mllm_rl.plans.base import Plan, PlanRun, start
from mllm_rl.profiling import Profiled, parse_steps
from mllm_rl.progress import progress_bar
from mllm_rl.rl.advantages import group_advantages
from mllm_rl.rl.batch import build_batch
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.tasks import Example, Task, TaskConfig, build_task, check_config, default_reward, task_name
from mllm_rl.tasks.render import check_lengths, render_all, token_ids, uses_template
from mllm_rl.tasks.reward import check_reward
from mllm_rl.trainer import TrainConfig

SETUP_PHASES = ["wandb_init", "{ready}", "engine_ready_dummy", *LIFECYCLE_SETUP]
FINAL_PHASES = ["checkpoint_flush", "generate_result"]
PROBE_PROMPT = "abcabcab"
KEEP_CHECKPOINTS = 2
FROM_SCRATCH_PRESETS = ("tiny",)  # trained from random initialisation (``FROM_SCRATCH_LR``)
RL_MAX_NEW_TOKENS = 8  # --max-new-tokens unset
DEFAULT_RUNNING = 128  # requests per batch when sizing the KV cache of an unset --max-running-requests
REWARDS_FILE = "rewards{p}.jsonl"  # every sample's reward (``RewardsFile``)
EVAL_PHASE = "evaluate"  # --eval-every: after every step (scoring on the steps it names: ``evaluate_phase``)
# Settings a task of a --tasks file cannot take yet (a task's leases have no evaluate phase)
TASKS_FILE_LACKS = ("eval_every",)


@dataclasses.dataclass
class RLOptions:
    steps: int = opt("steps")
    prompts_per_step: int = opt("prompts_per_step")
    group_size: int = opt("group_size")
    max_new_tokens: int = opt("max_new_tokens", default=RL_MAX_NEW_TOKENS, given=True)
    temperature: float = opt("temperature")
    top_p: float = opt("top_p")
    estimator: str = opt("estimator")
    adv_std: str = opt("adv_std")  # the GRPO group std (``mllm_rl.rl.advantages``)
    lr_from_model: bool = False  # --lr unset: ``RLPlan.with_model`` sets ``train.lr`` from the model
    task: str | None = opt("task")  # None: ``data`` with ``task_data``, else ``pattern``
    task_data: str | None = opt("task_data")
    prompt_key: str | None = opt("prompt_key")
    answer_key: str | None = opt("answer_key")
    chat_template: str = opt("chat_template")
    reward: str | None = opt("reward")  # None: the task's own (``mllm_rl.tasks``)
    reward_timeout: float = opt("reward_timeout")
    eval_data: str | None = opt("eval_data")
    eval_every: int = opt("eval_every")  # 0 = no ``evaluate`` phase (only ``generate_result``)
    eval_prompts: int = opt("eval_prompts")
    checkpoint_every: int = opt("checkpoint_every")  # 0 = never; else every N steps and the last one
    # True: a trainer with a host snapshot (``Trainer.snapshot``) has it written in the background
    checkpoint_background: bool = opt("checkpoint_background")
    resume_from: RLCheckpoint | None = None  # verified by the caller (``find_resumable``)
    seed: int = opt("seed")
    platform: str = opt("platform", given=True)  # as the backends name it (``platform_of``)
    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    lifecycle: LifecycleOptions = dataclasses.field(default_factory=LifecycleOptions)
    # The run's memory plan before start-up (mllm_rl.memplan.for_run): check | warn | off, budget
    # (fraction of device memory), --kv-tokens auto (engine pool sized by the plan).
    memory_plan: str = opt("memory_plan")
    plan_margin: float = opt("margin")
    kv_auto: bool = False
    profile_steps: frozenset[int] = frozenset()  # --profile (``mllm_rl.profiling``)

    def __post_init__(self) -> None:
        check_fields(self)
        self.task = task_name(self.task, self.task_data)
        if self.temperature == 0:  # the option's range is >= 0 (its message for a negative value); 0 says why
            raise OptionError(
                "temperature",
                f"{self.temperature}: RL samples its groups (a temperature of 0 is greedy: every "
                f"completion of a prompt the same, advantage 0, nothing trains)",
            )
        if self.train.temperature != self.temperature:
            raise OptionError(
                "temperature",
                f"the trainer's log-prob temperature {self.train.temperature} "
                f"differs from the rollout's {self.temperature}",
            )
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

    @property
    def task_config(self) -> TaskConfig:
        return task_config(self)

    def evaluates_after(self, step: int) -> bool:
        """Does ``step``'s ``evaluate`` phase (recorded every step) score the held-out prompts?"""
        return self.eval_every > 0 and ((step + 1) % self.eval_every == 0 or step == self.steps - 1)


def task_config(s: Any) -> TaskConfig:
    """What ``build_task`` builds the task from: the flags' or ``RLOptions``' (the same names)."""
    keys = (s.task, s.task_data, s.prompt_key, s.answer_key, s.eval_data, s.eval_prompts)
    return TaskConfig(*keys, s.reward, s.reward_timeout)


def default_lr(model_name: str) -> float:
    """The learning rate of a run without ``--lr`` (see ``FROM_SCRATCH_LR``)."""
    return FROM_SCRATCH_LR if model_name in FROM_SCRATCH_PRESETS else FINE_TUNE_LR


# -- checkpoints -------------------------------------------------------------------------
def checkpoint_meta(backend: str, opts: RLOptions) -> dict[str, Any]:
    """``meta.json`` fields beyond step and files, which ``--resume`` requires to match."""
    return {
        "seed": opts.seed,
        "backend": backend,
        "lora_rank": opts.train.lora_rank,
        "precision": opts.train.precision,
    }


SHAPE_KEYS = (
    *REQUIRED_SHAPE,
    "head_dim",
    "tie_word_embeddings",
)  # what a checkpoint's state has the shapes of


def model_shape(model: Any) -> dict[str, Any]:
    """The architecture a checkpoint's state has the shapes of (``meta.json``'s ``model_shape``)."""
    return {k: getattr(model.config, k) for k in SHAPE_KEYS}


def check_model_shape(ckpt: RLCheckpoint, model: Any) -> None:
    """``CheckpointError`` naming the first field that differs when a resumed checkpoint was trained
    on a model of another shape (one without recorded shapes passes)."""
    from mllm_rl.checkpoint.model_dir import CheckpointError

    saved = ckpt.meta.get("model_shape")
    if not isinstance(saved, dict):
        return
    for key, now in model_shape(model).items():
        if key in saved and saved[key] != now:
            raise CheckpointError(
                f"{ckpt.path / 'meta.json'}: written for a model with {key} {saved[key]}, "
                f"--model {model.path} has {now}"
            )


def trainer_maker(backend: Any, model: Any, opts: RLOptions, resume_from: RLCheckpoint | None) -> Callable:
    """``colocate``'s ``make_trainer``: the trainer, restored from ``resume_from`` when given, and its info."""

    def make_trainer():
        trainer = backend.create_trainer(model, opts.train)
        if resume_from is None:
            return trainer, {}
        trainer.restore(resume_from.path)
        return trainer, {"restored_from": str(resume_from.path), "restored_verified": resume_from.verified}

    return make_trainer


def checkpointer(
    trainer: Any,
    run_dir: Path,
    backend: str,
    opts: RLOptions,
    background: bool,
    model: Any = None,
    coord: Coordinator | None = None,
) -> Checkpointer:
    """The ``checkpoint`` phase's work, keeping the newest ``KEEP_CHECKPOINTS``."""
    meta = checkpoint_meta(backend, opts) | ({} if model is None else {"model_shape": model_shape(model)})
    return Checkpointer(
        trainer, run_dir, meta, opts.checkpoint_every, opts.steps, KEEP_CHECKPOINTS, background, coord
    )


# -- rollout -----------------------------------------------------------------------------
RewardLog = Callable[[str, int, list[Example], np.ndarray], None]  # (phase, step, examples, rewards)


def prompts_of(
    task: Task, tok: Any, opts: RLOptions, examples: list[Example]
) -> tuple[list[str], list[list[int]]]:
    """The prompts as the model sees them (``--chat-template``) and their token ids."""
    texts = render_all(tok, examples, task.templated, opts.chat_template)
    return texts, token_ids(tok, texts)


def process_0_rewards(coord: Coordinator, name: str, rewards: np.ndarray) -> np.ndarray:
    """Process 0's rewards on every process (a non-deterministic reward must not split one SPMD step)."""
    if coord.count == 1:
        return rewards
    got = coord.gather(f"rewards/{name}", json.dumps([float(x) for x in rewards]))
    return np.asarray(json.loads(got[0]), dtype=rewards.dtype)


def make_rollout(
    task: Task,
    tok: Any,
    opts: RLOptions,
    eos: int,
    on_rewards: RewardLog | None = None,
    coord: Coordinator | None = None,
):
    """The ``rollout`` phase's work: this step's prompts, ``group_size`` samples each, their rewards
    (also to ``on_rewards``), group-relative advantages, the batch and its metrics."""
    coord = coord or LocalCoordinator()

    def rollout(engine: ManagedEngine, step: int):
        examples = task.batch(opts.seed, step, opts.prompts_per_step)
        texts, prompt_ids = prompts_of(task, tok, opts, examples)
        g = opts.group_size
        ids = [p for p in prompt_ids for _ in range(g)]
        sampling = SamplingParams(
            max_new_tokens=opts.max_new_tokens,
            temperature=opts.temperature,
            top_p=opts.top_p,
            stop_token_ids=(eos,),
            seed=int(np.random.default_rng([opts.seed, step, 1]).integers(2**31)),
        )
        outs = engine.generate(ids, sampling)
        completions = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        samples = [examples[i // g] for i in range(len(outs))]
        rewards = task.rewards(
            [texts[i // g] for i in range(len(outs))], completions, samples, f"step {step}"
        )
        rewards = process_0_rewards(coord, f"step {step}", rewards)
        if on_rewards is not None:
            on_rewards("rollout", step, samples, rewards)
        if fault("reward_nan"):  # behind the reward's own check: the non-finite loss guard (exit 5)
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
            "prompt_tokens_cached": int(sum(o.cached_tokens for o in outs)),
            "aborted": int(sum(o.finish_reason == ABORT for o in outs)),
            "sample": {"prompt": texts[0], "answer": examples[0].answer, "completion": completions[0]},
        }
        return batch, metrics

    return rollout


def size_engine(task: Task, tok: Any, opts: RLOptions) -> EngineOptions:
    """``opts.engine`` with unset ``context_length`` / ``max_total_tokens`` filled in: the longest
    prompt plus ``max_new_tokens`` as a power of two >= 64 (CPU attention costs O(batch x context)),
    and a pool of ``memplan.kv.pool_requests`` x context: every request of a generate at full length, no more
    (a colocated pool takes memory from the trainer; on CPU each engine step rewrites all of it)."""
    eng = opts.engine
    ctx = eng.context_length
    if ctx is None:
        _, ids = prompts_of(task, tok, opts, task.sizing(opts.seed))
        need = max(len(p) for p in ids) + opts.max_new_tokens + 1
        ctx = max(64, 1 << (need - 1).bit_length())
    running = eng.max_running_requests or DEFAULT_RUNNING
    total = (
        eng.max_total_tokens
        or pool_requests(opts.prompts_per_step, opts.group_size, running, opts.eval_prompts) * ctx
    )
    return dataclasses.replace(eng, context_length=ctx, max_total_tokens=total)


def evaluate(
    engine: ManagedEngine,
    task: Task,
    tok: Any,
    opts: RLOptions,
    eos: int,
    on_rewards: RewardLog | None = None,
    phase: str = "generate_result",
    step: int | None = None,
) -> dict[str, Any]:
    """Greedy completions of ``eval_prompts`` held-out prompts (``Task.heldout``) and their rewards."""
    examples = task.heldout(opts.seed, opts.eval_prompts)
    texts, ids = prompts_of(task, tok, opts, examples)
    sampling = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=0.0, stop_token_ids=(eos,))
    outs = engine.generate(ids, sampling)
    completions = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    what = phase if step is None else f"{phase} after step {step}"
    rewards = task.rewards(texts, completions, examples, what)
    if on_rewards is not None:
        on_rewards(phase, -1 if step is None else step, examples, rewards)
    return {
        "prompts": texts,
        "answers": [e.answer for e in examples],
        "text": completions,
        "token_ids": [o.token_ids for o in outs],
        "greedy_reward_mean": float(np.mean(rewards)),
    }


def evaluate_phase(
    engine: ManagedEngine,
    task: Task,
    tok: Any,
    opts: RLOptions,
    eos: int,
    step: int,
    on_rewards: RewardLog | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``evaluate`` phase of ``step``: its record's info and the step's metrics it adds (none,
    and the next step that evaluates, on a step that does not)."""
    if not opts.evaluates_after(step):
        nxt = min(s for s in range(step + 1, opts.steps) if opts.evaluates_after(s))
        return {"evaluated": False, "next": nxt}, {}
    out = evaluate(engine, task, tok, opts, eos, on_rewards, "evaluate", step)
    lens = [len(t) for t in out["token_ids"]]
    reward, length = out["greedy_reward_mean"], float(np.mean(lens))
    sample = {"prompt": out["prompts"][0], "answer": out["answers"][0], "completion": out["text"][0]}
    info = {"evaluated": True, "reward_mean": reward, "prompts": len(lens), "completion_len_mean": length}
    return {**info, "sample": sample}, {"eval_reward_mean": reward, "eval_completion_len_mean": length}


class RewardsFile:
    """``rewards.jsonl`` (``.p<i>`` for process i > 0): a ``{step, phase, sample, row, reward}`` line
    per sample (``row`` null: a generated prompt; ``step`` -1: ``generate_result``); appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: Any = None

    @classmethod
    def of(cls, directory: Path, process_index: int) -> RewardsFile:
        return cls(directory / REWARDS_FILE.format(p=f".p{process_index}" if process_index else ""))

    def __call__(self, phase: str, step: int, examples: list[Example], rewards: np.ndarray) -> None:
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- closed by close()
        for i, (e, r) in enumerate(zip(examples, rewards, strict=True)):
            line = {"step": step, "phase": phase, "sample": i, "row": e.index, "reward": float(r)}
            self._f.write(json.dumps(line, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# -- the plan ----------------------------------------------------------------------------
def with_probe(lifecycle: LifecycleOptions, tok: Any) -> LifecycleOptions:
    """A copy of ``lifecycle``; with ``check_weights``, ``PROBE_PROMPT``'s ids as its probe."""
    lifecycle = dataclasses.replace(lifecycle)
    if lifecycle.check_weights and not lifecycle.probe_ids:
        lifecycle.probe_ids = tuple(tok(PROBE_PROMPT, add_special_tokens=False, verbose=False).input_ids)
    return lifecycle


def run_rl(ctx: PlanRun, opts: RLOptions) -> dict[str, Any]:
    """Run the plan; returns this attempt's summary. ``ctx.on_started`` runs after setup."""
    from transformers import AutoTokenizer

    task = build_task(opts.task_config)
    rewards_file = RewardsFile.of(ctx.run_dir, ctx.process_index)
    try:
        return _run_rl(ctx, opts, task, AutoTokenizer.from_pretrained(str(ctx.model.path)), rewards_file)
    finally:
        task.close()  # the reward worker
        rewards_file.close()


def _run_rl(ctx: PlanRun, opts: RLOptions, task: Task, tok: Any, on_rewards: RewardLog) -> dict[str, Any]:
    backend, rec, model = ctx.backend, ctx.rec, ctx.model
    eos = model.config.eos_token_id
    resume_from, first_step = opts.resume_from, opts.first_step
    lifecycle = with_probe(opts.lifecycle, tok)

    coord = coordinator_for(backend)
    if opts.checkpoint_every:  # several processes write one checkpoint: they must share the directory
        check_shared_dir(coord, ctx.run_dir)
    sized = size_engine(task, tok, opts)
    engine = start(
        backend, rec, model, ctx.make_wandb, ctx.runtime, sized, ctx.on_engine, attempt_first_step=first_step
    )

    make_trainer = trainer_maker(backend, model, opts, resume_from)
    life = colocate(backend, engine, rec, lifecycle, make_trainer, lora_rank=opts.train.lora_rank)
    life.first_sync()
    ctx.on_started()

    rollout = make_rollout(task, tok, opts, eos, on_rewards, coord)
    save = checkpointer(
        life.trainer, ctx.run_dir, backend.name, opts, opts.checkpoint_background, model, coord
    )
    profiled = profiled_steps(backend, opts, ctx)
    history = []
    try:
        with progress_bar(total=opts.steps, desc="rl", unit="step") as bar:
            bar.update(first_step)
            for step in range(first_step, opts.steps):
                with profiled.step(rec, step):
                    metrics = life.step(step, rollout, save)
                    if opts.eval_every:
                        with rec.phase("evaluate", step=step) as ph:
                            info, scores = evaluate_phase(engine, task, tok, opts, eos, step, on_rewards)
                            ph.info.update(info)
                        metrics.update(scores)
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
        ph.info.update(evaluate(engine, task, tok, opts, eos, on_rewards))
    return {"first_step": first_step, "history": history, "eval": ph.info, "lines": profiled.lines()}


def profiled_steps(backend: Backend, opts: RLOptions, ctx: PlanRun) -> Profiled:
    """``--profile``: the steps traced by the backend's profiler (none without the flag)."""
    profiler = backend.profiler() if opts.profile_steps else None
    return Profiled(profiler, opts.profile_steps, ctx.run_dir, backend.name, ctx.process_index)


def check_prompts(opts: RLOptions, model: Any) -> list[str]:
    """``ValueError`` (naming the flag, or the file and row) unless every rendered prompt plus
    ``--max-new-tokens`` fits ``--context-length`` (else the model's); lines to tell the user."""
    ctx = opts.engine.context_length
    allowed, why = ctx, "--context-length"
    what = f"--context-length {ctx}"
    if not ctx:
        allowed, why = model.config.max_position_embeddings, f"{model.path}'s max_position_embeddings"
        what = f"the model's context length, {allowed} tokens ({model.path / 'config.json'}: max_position_embeddings)"
    if opts.max_new_tokens + 2 > allowed:  # a prompt of one token, and the engine's one of slack
        raise ValueError(
            f"--max-new-tokens {opts.max_new_tokens} does not fit {what}, with a prompt before it"
        )
    from transformers import AutoTokenizer

    task = build_task(opts.task_config)  # the rows read by ``preflight`` (cached)
    tok = AutoTokenizer.from_pretrained(str(model.path))
    check_lengths(
        tok, task.sizing(opts.seed), task.templated, opts.chat_template, opts.max_new_tokens, allowed, why
    )
    if uses_template(tok, task.templated, opts.chat_template):
        return ["note: prompts go through the checkpoint's chat template (--chat-template off: as they are)"]
    return []


class RLPlan(Plan[RLOptions]):
    """GRPO-style colocated RL: ``SETUP_PHASES``, ``steps`` lifecycle steps, ``FINAL_PHASES``."""

    name = "rl"
    scope = "rl"
    summary = "colocated GRPO with every memory phase recorded"

    def options(self, args: argparse.Namespace, engine: EngineOptions, platform: str) -> RLOptions:
        if engine.task is not None:  # a task of a --tasks file (its engine carries the task's name)
            if args.max_total_tokens == KV_AUTO:
                raise OptionError(
                    "max_total_tokens",
                    "auto: a task of a --tasks file is not memory-planned "
                    "before start-up; give it a number of tokens",
                )
            for key in TASKS_FILE_LACKS:
                if getattr(args, key, None) != default(key):
                    raise OptionError(
                        key,
                        "is not taken in a --tasks file yet (a task's leases have no evaluate "
                        "phase; its held-out prompts are scored once, in generate_result); run it "
                        "with --plan rl",
                    )
        check_config(task_config(args))
        max_new_tokens = args.max_new_tokens or RL_MAX_NEW_TOKENS
        loss = from_args(LossConfig, args, max_len=max_new_tokens)
        model_options = tuple(parse_key_value(o, "--model-option") for o in args.model_option or [])
        train = from_args(
            TrainConfig,
            args,
            lr=FROM_SCRATCH_LR if args.lr is None else args.lr,  # the model's default: ``with_model``
            temperature=args.temperature or 1.0,  # 0: RLOptions refuses it, saying why
            loss=loss,
            model_options=model_options,
        )
        return from_args(
            RLOptions,
            args,
            max_new_tokens=max_new_tokens,
            lr_from_model=args.lr is None,
            platform=platform,
            engine=engine,
            train=train,
            lifecycle=from_args(LifecycleOptions, args),
            kv_auto=args.max_total_tokens == KV_AUTO,
            profile_steps=parse_steps(args.profile, args.steps) if args.profile else frozenset(),
        )

    def with_model(self, opts: RLOptions, model: Any) -> tuple[RLOptions, list[str]]:
        """``--lr`` unset: ``default_lr``; checks a resumed checkpoint's model shape and the prompts."""
        if opts.resume_from is not None:
            check_model_shape(opts.resume_from, model)
        notes = check_prompts(opts, model)
        if not opts.lr_from_model:
            return opts, notes
        lr = default_lr(model.config.name)
        train = dataclasses.replace(opts.train, lr=lr)
        return dataclasses.replace(opts, train=train, lr_from_model=False), notes

    def memory_plan(
        self, backend: Backend, model: Any, opts: RLOptions, runtime: dict[str, Any]
    ) -> tuple[RLOptions, Any, list[str]]:
        from mllm_rl.memplan.for_run import plan_for_rl

        def sized(o: RLOptions) -> EngineOptions:
            from transformers import AutoTokenizer

            task = build_task(o.task_config)
            try:
                return size_engine(task, AutoTokenizer.from_pretrained(str(model.path)), o)
            finally:
                task.close()

        return plan_for_rl(backend, model, opts, runtime, sized)

    def preflight(
        self, args: argparse.Namespace, opts: RLOptions, backend: Backend, run_dir: Path
    ) -> tuple[RLOptions, list[str]]:
        """Checks the ``--resume`` checkpoint, the task's data (every row) and ``--reward``."""
        from mllm_rl.plans.preflight import resolve_resume

        notes: list[str] = []
        if args.resume or args.resume_or_start:
            overridden = set(args.override or [])  # accepted changes: a checkpoint is not held to them
            expect = {k: v for k, v in checkpoint_meta(backend.name, opts).items() if k not in overridden}
            ckpt, notes = resolve_resume(run_dir, expect, args.resume_or_start)
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
            task = build_task(opts.task_config)  # every row read and checked (one line naming file and row)
        except OSError as e:
            raise ValueError(f"--task-data {opts.task_data}: {e.strerror or e}") from None
        notes += getattr(task, "notes", [])
        if opts.reward is not None:  # imported and its signature checked in a worker, which then stops
            check_reward(opts.reward, opts.reward_timeout)
        if opts.task == "boxed" and opts.task_data is None:
            from mllm_rl.tasks.boxed import SAMPLE_DATA

            notes.append(
                f"note: --task boxed without --task-data: training on the shipped sample {SAMPLE_DATA}"
            )
        return opts, notes

    def check_runtime(self, backend: Backend, model: Any, opts: RLOptions, process_count: int) -> None:
        self.require_release(backend, process_count)
        if process_count > 1 and opts.checkpoint_background:
            raise ValueError(
                f"--checkpoint-background: one process only ({process_count} processes each write "
                f"their shards in the checkpoint phase)"
            )
        if opts.profile_steps and backend.profiler() is None:
            raise ValueError(f"--profile: the {backend.name} backend has no profiler")
        super().check_runtime(backend, model, opts, process_count)
        backend.check_trainer_args(model, opts.train)

    def phase_names(self) -> set[str]:
        names = {*SETUP_PHASES, *FINAL_PHASES, "check_weights", EVAL_PHASE}
        return names | {p for phases in STEP_PHASES.values() for p in phases}

    def run_json(self, backend: Backend, opts: RLOptions) -> dict[str, Any]:
        return {
            "steps": opts.steps,
            "first_step": 0,
            "expected_phases": [p.format(ready=backend.ready_phase) for p in SETUP_PHASES] + FINAL_PHASES,
            "expected_step_phases": step_phases(opts.lifecycle) + ([EVAL_PHASE] if opts.eval_every else []),
            "schedule": opts.lifecycle.schedule,
            "task": opts.task,
            "reward": opts.reward or default_reward(opts.task),
            "eval_every": opts.eval_every,
            "group_size": opts.group_size,
            "prompts_per_step": opts.prompts_per_step,
            "train": dataclasses.asdict(opts.train),
            "checkpoint_every": opts.checkpoint_every,
            "checkpoint_background": opts.checkpoint_background,
        }

    def run(self, ctx: PlanRun, opts: RLOptions) -> dict[str, Any]:
        return run_rl(ctx, opts)


PLAN = RLPlan()
