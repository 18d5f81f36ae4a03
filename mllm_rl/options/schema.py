"""Every setting of a run, declared once: name, type, default, range, help, where it applies.

``key``: the argparse ``dest``, the ``--tasks`` file key and ``run.json``'s key; ``flag``: ``--`` +
the key with dashes. ``scope``: ``rl``/``swap`` (``--plan``), ``tasks`` (a flag next to
``--tasks``), ``task`` (a tasks-file key, then not a flag), ``memplan``; a flag given elsewhere is
refused. ``resume``: ``fixed`` (what is trained: a changed value needs ``--override``), ``inherit``
(from ``run.json`` unless given) or ``fresh`` (this invocation's own)."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable
from typing import Any

KV_AUTO = "auto"  # --kv-tokens auto: the KV pool the run's memory plan leaves room for
RUN = frozenset({"rl", "swap", "tasks"})  # every mode of ``python -m mllm_rl.run``
RL = frozenset({"rl", "task"})  # an RL setting: the rl plan's flag and a task key
CONSOLE_RENAMED = {"compact": "phases"}  # --console: old value -> its name now
# --lr unset: ``tiny`` trains from random init, any other model is fine-tuned (verl's default actor lr)
FROM_SCRATCH_LR = 3e-3
FINE_TUNE_LR = 1e-6


@dataclasses.dataclass(frozen=True)
class Option:
    key: str
    type: type  # int | float | str | bool (a switch) | list (a repeatable flag of str)
    default: Any
    help: str
    group: str  # the --help section: "run" | "outputs" | "swap plan" | "rl plan" | "plan"
    scope: frozenset[str]
    resume: str = "inherit"  # "fixed" | "inherit" | "fresh"
    low: float | None = None  # lower bound (inclusive unless ``strict``); NaN and inf are refused
    strict: bool = False
    high: float | None = None  # upper bound, inclusive
    choices: tuple[str, ...] | str | None = None  # values, or "module:NAME" of a dict, tuple or function
    nullable: bool = False  # None is a value (``default_text`` says what it means)
    default_text: str | None = None  # --help's "(default: ...)" when the value alone does not say it
    aliases: tuple[str, ...] = ()  # other flags (``--save-every``); their keys are tasks-file aliases
    metavar: str | None = None
    required: bool = False
    words: tuple[str, ...] = ()  # strings a number setting also takes (--kv-tokens auto)
    backends: frozenset[str] | None = None  # the backends that take it (None: every backend)
    renamed: str | None = None  # "module:NAME" of a dict {old value: its name now}: refused naming it
    why: str | None = None  # why a value out of range is refused, said in place of the bare bound

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def choice_list(self) -> tuple[str, ...] | None:
        if self.choices is None or isinstance(self.choices, tuple):
            return self.choices
        module, name = self.choices.split(":")
        found = getattr(importlib.import_module(module), name)
        return tuple(found() if callable(found) else found)

    def renamed_to(self, value: Any) -> str | None:
        """The name ``value`` goes by now, when it is an old name of a choice (else None)."""
        if self.renamed is None or not isinstance(value, str):
            return None
        module, name = self.renamed.split(":")
        return getattr(importlib.import_module(module), name).get(value)


def _o(
    key: str, type_: type, default: Any, help_: str, group: str, scope: Iterable[str], **kw: Any
) -> Option:
    return Option(key, type_, default, help_, group, frozenset(scope), **kw)


def _sci(x: float) -> str:
    """``3e-3``, as a person writes it (``:g`` says ``0.003``)."""
    return f"{x:.0e}".replace("e-0", "e-")


OPTIONS: tuple[Option, ...] = (
    # -- what runs, on what ------------------------------------------------------------------------
    _o("backend", str, None, "backend name (entry point group mllm_rl.backends): jax, torch", "run",
       {*RUN, "memplan"}, resume="fixed", required=True),
    _o("plan", str, "rl", "what to run (see the list above)", "run", {"rl", "swap"}, resume="fixed",
       choices="mllm_rl.plans.base:plan_names"),
    _o("tasks", str, None, "TOML file of several RL tasks sharing the devices (docs/MULTITASK.md); "
       "per-task settings then come from the file", "run", {"tasks"}, resume="fresh", metavar="FILE"),
    _o("fail_fast", bool, False, "--tasks: stop the whole run when one task fails", "run", {"tasks"},
       resume="fresh"),
    _o("model", str, "tiny", "preset (mllm_rl.presets), checkpoint dir, or hub id", "run",
       {"rl", "swap", "task", "memplan"}, resume="fixed"),
    _o("seed", int, 0, "seed for preset checkpoints, data and sampling", "run", {"rl", "swap", "task"},
       resume="fixed", low=0),
    _o("tp", int, 1, "tensor-parallel size of the rollout engine", "run", {*RUN, "memplan"}, low=1),
    _o("platform", str, "auto", "assert the accelerator platform (auto: accept what the runtime finds)", "run",
       RUN, resume="fresh", choices=("auto", "cpu", "gpu", "tpu", "cuda")),
    _o("engine", str, "auto", "rollout engine; torch: auto (SGLang when importable on CUDA, else embedded), "
       "embedded, sglang; jax: auto only (sglang-jax); memplan: auto plans SGLang on a GPU, embedded on cpu",
       "run", {*RUN, "memplan"}, choices=("auto", "embedded", "sglang")),
    _o("max_new_tokens", int, None, "tokens per completion", "run", {"rl", "swap", "task"}, resume="fixed",
       low=1, nullable=True, default_text="8 for rl, 16 for swap"),
    _o("max_total_tokens", int, None, "engine KV cache size in tokens; auto (rl, a run that plans itself: JAX on CPU, a TPU slice or an H100/H200 node; torch on CPU or CUDA): the largest pool "
       "the run's memory plan leaves room for", "run",
       {"rl", "swap", "task", "memplan"}, low=1, nullable=True, aliases=("--kv-tokens",), words=(KV_AUTO,),
       default_text="swap 4096; rl: the requests of one generate (prompts-per-step x group-size, or eval-prompts; "
       "at most max-running-requests) x context; memplan: the engine's rule"),
    _o("context_length", int, None, "engine context length", "run", {"rl", "swap", "task"}, low=1,
       nullable=True, default_text="swap 512; rl: fits the task's prompts + completions"),
    _o("max_running_requests", int, 128, "engine batch limit (requests)", "run",
       {"rl", "swap", "task", "memplan"}, low=1),
    _o("weights_cpu_backup", bool, False, "engine keeps a host copy of its weights across release/resume "
       "(else: full re-sync; memplan: that copy in the host column)", "run", {"rl", "swap", "task", "memplan"}),
    _o("phase_timeout", list, None, "watchdog: a phase still running after its limit is recorded as stuck, "
       "every thread's stack goes to the run dir, and the run exits 6. SECONDS sets the limit of the phases "
       "that compute or move a model (rollout, train_step, engine start, ...; the others get a multiple of "
       "it), PHASE=SECONDS one phase's; repeatable; 0 = no limit", "run", RUN, resume="fresh",
       metavar="[PHASE=]SECONDS", default_text="mllm_rl.phases.watchdog.DEFAULT_LIMIT_S"),
    # -- outputs -------------------------------------------------------------------------------------
    _o("wandb", str, "offline", "W&B mode", "outputs", RUN, choices=("disabled", "offline", "online")),
    _o("wandb_project", str, "mllm_rl", "W&B project", "outputs", RUN, resume="fresh"),
    _o("wandb_fallback", str, "offline", "--wandb online and the server cannot be reached: log offline "
       "(one warning line) or refuse to start", "outputs", RUN, resume="fresh", choices=("offline", "error")),
    _o("wandb_timeout", float, 10.0, "seconds to wait for the W&B server (the reachability probe and "
       "wandb.init)", "outputs", RUN, resume="fresh", low=0, strict=True),
    _o("run_id", str, None, "the run's name: letters, digits, '.', '_', '-'", "outputs", RUN, resume="fresh",
       nullable=True, default_text="<plan>-<backend>-<time>-<rand>"),
    _o("run_dir", str, None, "the run's directory (one run owns it: a second run on it is refused)", "outputs",
       RUN, resume="fresh", nullable=True, default_text="runs/<run_id>"),
    _o("console", str, "steps", "what the run prints: steps, one line per RL step on stderr (reward, KL, "
       "clip fraction, grad norm, loss, step time, peak memory), a progress bar on a terminal, and a short "
       "ending (the phase tables are in the report); phases, also one short line per phase record on "
       "stdout and the phase tables at the end; full, the records as JSON on stdout instead; off, no step "
       "or phase lines. Every record is in phases.jsonl whatever this says", "outputs", RUN,
       resume="fresh", choices=("steps", "phases", "full", "off"), renamed="mllm_rl.options.schema:CONSOLE_RENAMED"),
    _o("quiet", bool, False, "print only errors (implies --console off)", "outputs", RUN, resume="fresh"),
    # -- the swap plan -------------------------------------------------------------------------------
    _o("swap_mode", str, "streaming", "streaming: one tensor at a time; naive: load all, then replace "
       "(baseline)", "swap plan", {"swap"}, choices=("streaming", "naive")),
    _o("swap_chunk_mb", float, 64.0, "streaming: tensors larger than this are written into the engine "
       "buffer in chunks of this size (peak = one copy + one chunk); 0 = whole tensors", "swap plan",
       {"swap"}, low=0),
    _o("prompt", list, None, "prompt for generate_result (repeatable)", "swap plan", {"swap"},
       default_text="two built-in prompts"),
    # -- the rl plan ---------------------------------------------------------------------------------
    _o("steps", int, 20, "RL steps", "rl plan", RL, low=1),
    _o("task", str, None, "pattern: shipped periodic-string completion (learnable from scratch); "
       "boxed: GSM8K-style \\boxed{} math answers (math-verify) from --data; data: --data scored by "
       "--reward (docs/TASKS.md)", "rl plan", RL, resume="fixed", choices="mllm_rl.tasks:TASKS",
       nullable=True, default_text="data with --data, else pattern"),
    _o("task_data", str, None, "the dataset: JSONL, JSON, parquet, CSV/TSV, or a directory saved with "
       "datasets' save_to_disk (docs/TASKS.md)", "rl plan", RL, resume="fixed", nullable=True,
       aliases=("--data",), metavar="PATH", default_text="boxed: a shipped sample"),
    _o("prompt_key", str, None, "the dataset's prompt column (text, or a list of {role, content} messages)",
       "rl plan", RL, resume="fixed", nullable=True, metavar="KEY", default_text="prompt; boxed: question"),
    _o("answer_key", str, None, "the dataset's answer column ('' for none)", "rl plan", RL, resume="fixed",
       nullable=True, metavar="KEY", default_text="answer"),
    _o("chat_template", str, "auto", "auto: a dataset's prompts go through the checkpoint's chat template "
       "when it has one (pattern prompts never do); off: as they are", "rl plan", RL, resume="fixed",
       choices=("auto", "off")),
    _o("reward", str, None, "reward function (prompt, completion, row) -> float, by import path, run in a "
       "worker process (docs/TASKS.md)", "rl plan", RL, resume="fixed", nullable=True,
       metavar="MODULE:FUNCTION|FILE.py:FUNCTION", default_text="the task's: pattern and boxed ship one"),
    _o("reward_timeout", float, 30.0, "seconds a reward call may take (per sample; per batch for a batched "
       "function) before the run stops with an error naming it", "rl plan", RL, low=0, strict=True,
       metavar="SECONDS"),
    _o("eval_data", str, None, "held-out dataset for evaluation (same format and keys as --data)", "rl plan",
       RL, nullable=True, metavar="PATH", default_text="a test/validation split of a saved dataset, "
       "else --eval-prompts rows split off --data"),
    _o("eval_every", int, 0, "greedy evaluation of the held-out prompts (phase evaluate) after every N "
       "steps and the last; its score in metrics.jsonl (eval_reward_mean); 0 = only the final "
       "generate_result", "rl plan", RL, low=0),
    _o("prompts_per_step", int, 16, "prompts per RL step", "rl plan", {*RL, "memplan"}, resume="fixed", low=1),
    _o("group_size", int, 8, "completions per prompt (GRPO group, >= 2)", "rl plan", {*RL, "memplan"},
       resume="fixed", low=2, why="group-relative advantages need >= 2 completions per prompt (a group of one "
       "has advantage 0 and trains nothing)"),
    _o("eval_prompts", int, 16, "held-out prompts of the greedy evaluations (evaluate, generate_result): "
       "the first N of --eval-data, or N rows held out of --data (never trained on; at most a quarter)",
       "rl plan", RL, low=1),
    _o("temperature", float, 1.0, "sampling temperature of the rollout (> 0); the trainer's log-probs use "
       "the same (logits / T)", "rl plan", RL, resume="fixed", low=0),
    _o("top_p", float, 1.0, "nucleus sampling of the rollout", "rl plan", RL, resume="fixed", low=0,
       strict=True, high=1),
    _o("estimator", str, "grpo", "advantage estimator", "rl plan", RL, resume="fixed",
       choices="mllm_rl.rl.advantages:ESTIMATORS"),
    _o("adv_std", str, "unbiased", "grpo: the group std (unbiased: n - 1, as verl and TRL; biased: n)",
       "rl plan", RL, resume="fixed", choices="mllm_rl.rl.advantages:STDS"),
    _o("lr", float, None, "AdamW learning rate", "rl plan", RL, resume="fixed", low=0, nullable=True,
       default_text=f"{_sci(FROM_SCRATCH_LR)} for the tiny preset (trained from random init), {_sci(FINE_TUNE_LR)} "
       "for every other model (a pretrained checkpoint: fine-tuning, verl's default)"),
    _o("precision", str, "mixed", "mixed: a bf16/fp16 checkpoint trains float32 master weights with float32 "
       "AdamW moments, computes in bf16/fp16, the engine gets casts; pure: params and moments in the "
       "checkpoint dtype (half the state; Adam steps below half a bf16 ulp are lost: little or no learning "
       "at lr ~1e-6)", "rl plan", {*RL, "memplan"}, resume="fixed", choices="mllm_rl.trainer:PRECISIONS"),
    _o("weight_decay", float, 0.0, "AdamW weight decay", "rl plan", RL, resume="fixed", low=0),
    _o("grad_clip", float, 1.0, "global-norm clip; 0 = off", "rl plan", RL, resume="fixed", low=0),
    _o("mini_batches", int, 1, "optimizer updates per step", "rl plan", RL, resume="fixed", low=1),
    _o("micro_batch_size", int, 64, "sequences per forward/backward", "rl plan", {*RL, "memplan"}, low=1,
       aliases=("--micro-batch",)),
    _o("eps_low", float, 0.2, "PPO clip range below 1", "rl plan", RL, resume="fixed", low=0),
    _o("eps_high", float, 0.28, "PPO clip range above 1 (clip-higher)", "rl plan", RL, resume="fixed", low=0),
    _o("clip_ratio_c", float, 3.0, "dual-clip: for negative advantages the loss is capped at -A * c (verl's "
       "clip_ratio_c); 0 = off", "rl plan", RL, resume="fixed", low=0),
    _o("kl_beta", float, 0.0, "KL-to-reference weight in the loss (k3); memplan: > 0 keeps reference params",
       "rl plan", {*RL, "memplan"}, resume="fixed", low=0),
    _o("kl_clamp", float, 10.0, "cap of the per-token k3 KL in the loss and the kl metric (verl's low_var_kl "
       "clamps at 10; a capped token gets no KL gradient); 0 = uncapped (TRL)", "rl plan", RL, resume="fixed",
       low=0),
    _o("old_logp", str, "trainer", "old log-probs of the PPO ratio: recomputed by the trainer before the "
       "update (verl's default; the engine/trainer mismatch is reported) or the engine's rollout log-probs",
       "rl plan", RL, resume="fixed", choices="mllm_rl.rl.old_logp:SOURCES"),
    _o("tis_cap", float, 0.0, "truncated importance sampling: weigh each token by min(exp(logp_trainer - "
       "logp_engine), C) (needs --old-logp trainer); 0 = off", "rl plan", RL, resume="fixed", low=0),
    _o("loss_agg", str, "token_mean", "loss aggregation: token_mean (verl token-mean, TRL dapo), "
       "seq_mean_token_mean (verl seq-mean-token-mean, TRL grpo), seq_mean_token_sum (verl seq-mean-token-sum), "
       "dr_grpo (TRL dr_grpo: token sum / (sequences * --max-new-tokens)), token_sum_norm (verl "
       "seq-mean-token-sum-norm: token sum / --max-new-tokens)", "rl plan", RL, resume="fixed",
       choices="mllm_rl.rl.loss_config:AGGREGATIONS", renamed="mllm_rl.rl.loss_config:RENAMED"),
    _o("loss_empty_seqs", str, "exclude", "seq_mean_* aggregations: a completion without a loss token "
       "(aborted, all masked) is left out of the mean over sequences (exclude: verl's agg_loss) or counts as "
       "a sequence of loss 0 (count: TRL's grpo)", "rl plan", RL, resume="fixed",
       choices="mllm_rl.rl.loss_config:EMPTY_SEQS"),
    _o("lora_rank", int, 0, "> 0: train LoRA adapters, base frozen", "rl plan", {*RL, "memplan"},
       resume="fixed", low=0),
    _o("lora_alpha", float, 16.0, "LoRA scale numerator (alpha / rank)", "rl plan", RL, resume="fixed",
       low=0, strict=True),
    _o("schedule", str, "multi_stage", "multi_stage: resume weights, update, free trainer, then resume KV; "
       "naive: baseline", "rl plan", {"rl", "memplan"}, choices="mllm_rl.lifecycle:SCHEDULES"),
    _o("check_weights", bool, False, "garbage guard: engine greedy probe after each update must match the "
       "trainer's", "rl plan", {*RL, "memplan"}),
    _o("memory_plan", str, "check", "plan the run's memory on its own devices before any engine starts "
       "(docs/PLAN.md): check: a plan that does not fit exits 6; warn: say so and run; off", "rl plan", {"rl"},
       resume="fresh", choices=("check", "warn", "off")),
    _o("profile", str, None, "trace these steps with the framework's profiler (jax.profiler: XProf / "
       "TensorBoard; torch.profiler: Chrome / Perfetto JSON) into RUN_DIR/profile, every phase a named "
       "range; 0-based step numbers: 2, 1,3 or 2-4", "rl plan", {"rl"}, resume="fresh", nullable=True,
       metavar="STEPS", default_text="no trace"),
    _o("checkpoint_every", int, 5, "checkpoint every N steps, and always the last step; 0 = never",
       "rl plan", RL, low=0, aliases=("--save-every",)),
    _o("checkpoint_background", bool, False, "copy the state to host memory in the checkpoint phase and "
       "write it in the background (torch: a host copy; jax: orbax's asynchronous save; it counts once "
       "written; costs host memory the size of the state; memplan: that copy in the host column). Default: "
       "write in the phase", "rl plan", {"rl", "memplan"}),
    _o("checkpoint_compression", bool, False, "jax: zstd-compress the checkpointed arrays (orbax's own "
       "default; smaller files, a save about twice as long on a CPU host: docs/RL.md). Default: written "
       "uncompressed, as the torch trainer always writes", "rl plan", RL),
    _o("resume", bool, False, "continue --run-dir/--run-id from its newest valid checkpoint (appends to its "
       "phase log; settings not given come from its run.json); a run with nothing to resume is refused",
       "rl plan", {"rl", "tasks"}, resume="fresh"),
    _o("resume_or_start", bool, False, "like --resume, but a run directory without checkpoints (or none at "
       "all) starts from step 0 (swap: runs it again)", "rl plan", {"rl", "swap"}, resume="fresh"),
    _o("override", list, None, "--resume: accept a changed value of a setting that defines the run "
       "(e.g. --override lr; with --tasks: of any task); run.json records it; repeatable", "rl plan",
       {"rl", "tasks"}, resume="fresh", metavar="KEY"),
    # -- the memory plan's own -----------------------------------------------------------------------
    _o("seq_len", int, 4096, "tokens per sequence (prompt + completion)", "plan", {"memplan"}, low=1),
    _o("trainer_tp", int, 1, "tensor-parallel size of the trainer's mesh (divides the devices; JAX)", "rl plan",
       {"rl", "memplan"}, low=1),
    _o("fsdp", int, 0, "how the trainer's state is sharded: JAX, the fsdp axis of its mesh (0: devices / "
       "trainer-tp, the only value a run takes); torch, FSDP2 over the processes (0: every process; 1: none, "
       "every process holds the whole trainer)", "rl plan", {"rl", "memplan"}, low=0),
    _o("mem_fraction_static", float, None, "the engine's mem_fraction_static (sglang-jax, SGLang)", "rl plan", {"rl", "memplan"}, low=0,
       strict=True, high=1, nullable=True,
       default_text="what --kv-tokens needs, else the adapter's default"),
    _o("model_option", list, None, "a backend model option (JAX: ModelOptions fields, e.g. remat=block; "
       "torch: remat=true, per-layer activation checkpointing); repeatable", "rl plan", {"rl", "memplan"}, resume="fixed", metavar="KEY=VALUE"),
    _o("margin", float, 0.9, "fraction of device memory a phase may use (the plan's budget; rl: the run's own "
       "memory plan)", "plan", {"rl", "memplan"}, low=0, strict=True, high=1),
    _o("host_ram_gib", float, None, "one host's RAM of the target in GiB, for its host-memory verdict (a "
       "TPU VM's or GPU node's: `free -g` there)", "plan", {"memplan"}, low=0, strict=True, nullable=True,
       default_text="this machine's for cpu/cuda, else not known"),
    _o("engine_forward", str, "compile", "how the plan counts sglang-jax's forward on a TPU or GPU target: "
       "compile its prefill and decode for the target (a long prefill with native attention takes minutes "
       "on a CPU host), or estimate them from the shapes", "plan", {"memplan"}, choices=("compile", "estimate"),
       backends=frozenset({"jax"})),
    _o("fit_max", int, None, "upper bound of the --fit search", "plan", {"memplan"}, low=1, nullable=True,
       default_text="256 (micro_batch_size), 131072 (seq_len)"),
    _o("fit_step", int, None, "granularity of the --fit search", "plan", {"memplan"}, low=1, nullable=True,
       default_text="mllm_rl.memplan.planner.FIT_KNOBS"),
)  # fmt: skip

BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}
ALIASES: dict[str, str] = {a[2:].replace("-", "_"): o.key for o in OPTIONS for a in o.aliases}


def default(key: str) -> Any:
    """The declared default of a setting."""
    return BY_KEY[key].default


def in_scope(scope: str) -> list[Option]:
    """The options of one scope, in declaration order."""
    return [o for o in OPTIONS if scope in o.scope]


def defaults(scope: str) -> dict[str, Any]:
    """``{key: default}`` of a scope (lists as ``None``: a repeatable flag not given)."""
    return {o.key: o.default for o in in_scope(scope)}
