"""Task specs: the ``--tasks`` TOML file of a multi-task run (``docs/MULTITASK.md``).

```toml
[defaults]            # optional: applies to every task that does not set the key itself
steps = 4
prompts_per_step = 4

[[task]]
name = "small"        # required, unique; letters, digits, '_' and '-'
model = "tiny"        # preset name, or a checkpoint directory (relative to the TOML file)
seed = 0
lr = 3e-3
group_size = 4
lora_rank = 0

[[task]]
name = "other"
model = "qwen3-0.6b"
task = "boxed"
task_data = "gsm8k.jsonl"  # relative to the TOML file
```

Every key of a task is one of ``FIELDS`` (same meaning and default as the single-task flag of
the same name, ``python -m mllm_rl.run --help``). Everything is validated before anything
starts: a bad file raises ``ValueError`` naming the file, the task and the field.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from mllm_rl.engine import EngineOptions
from mllm_rl.lifecycle import LifecycleOptions
from mllm_rl.option_error import OptionError, cli_key
from mllm_rl.plans.rl import RLOptions
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import TrainConfig

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task of a multi-task run: its own model, engine, trainer, data and seed."""

    name: str
    model: str = "tiny"
    task: str = "pattern"
    task_data: str | None = None
    seed: int = 0
    steps: int = 20
    lr: float | None = None  # None: the model's default (``mllm_rl.plans.rl.default_lr``)
    precision: str = "mixed"
    group_size: int = 8
    prompts_per_step: int = 16
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    estimator: str = "grpo"
    adv_std: str = "unbiased"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mini_batches: int = 1
    micro_batch_size: int = 64
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_beta: float = 0.0
    clip_ratio_c: float = 3.0
    old_logp: str = "trainer"
    tis_cap: float = 0.0
    loss_agg: str = "token_mean"
    checkpoint_every: int = 5  # the TOML file may spell it save_every, like --save-every
    eval_prompts: int = 16
    check_weights: bool = False
    weights_cpu_backup: bool = False
    max_running_requests: int = 128
    context_length: int | None = None
    max_total_tokens: int | None = None

    def rl_options(
        self, tp: int = 1, platform: str = "auto", engine: str = "auto", model_name: str | None = None
    ) -> RLOptions:
        """The single-task plan's options for this task (``ValueError`` naming the bad value); the
        engine options carry the task's name (its memory tags are ``<task>/...``). A resumed task's
        checkpoint is the runtime's (``runtime.RLTask``), not the options'. ``model_name``: the
        resolved model's preset name (an unset ``lr`` is that model's default)."""
        from mllm_rl.plans.rl import default_lr

        loss = LossConfig(eps_low=self.eps_low, eps_high=self.eps_high, beta=self.kl_beta,
                          aggregation=self.loss_agg, max_len=self.max_new_tokens,
                          clip_ratio_c=self.clip_ratio_c)  # fmt: skip
        lr = default_lr(model_name or self.model) if self.lr is None else self.lr
        train = TrainConfig(lr=lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                            mini_batches=self.mini_batches, micro_batch_size=self.micro_batch_size, loss=loss,
                            lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, seed=self.seed,
                            temperature=self.temperature or 1.0,  # 0: RLOptions refuses it, saying why
                            precision=self.precision)  # fmt: skip
        eng = EngineOptions(tp=tp, engine=engine, max_total_tokens=self.max_total_tokens, context_length=self.context_length,
                               max_running_requests=self.max_running_requests, seed=self.seed,
                               weights_cpu_backup=self.weights_cpu_backup, task=self.name)  # fmt: skip
        return RLOptions(
            steps=self.steps, prompts_per_step=self.prompts_per_step, group_size=self.group_size,
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            estimator=self.estimator, adv_std=self.adv_std, task=self.task, task_data=self.task_data,
            eval_prompts=self.eval_prompts, checkpoint_every=self.checkpoint_every, seed=self.seed,
            platform=platform, engine=eng, train=train,
            lifecycle=LifecycleOptions(check_weights=self.check_weights, old_logp=self.old_logp,
                                       tis_cap=self.tis_cap),
        )  # fmt: skip


FIELDS = {f.name: f for f in dataclasses.fields(TaskSpec)}
ALIASES = {"save_every": "checkpoint_every"}  # as the single-task flag --save-every


def _typed(value: Any, field: dataclasses.Field, where: str) -> Any:
    """``value`` checked against the field's type (ints are accepted for floats)."""
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    optional = "None" in kind
    if value is None and optional:
        return None
    if kind.startswith("bool"):
        ok = isinstance(value, bool)
    elif kind.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind.startswith("float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"{where}: expected {kind.replace(' | None', '')}, got {value!r}")
    return value


def _unalias(table: dict[str, Any]) -> dict[str, Any]:
    return {ALIASES.get(k, k): v for k, v in table.items()}


def _task(raw: Any, defaults: dict[str, Any], where: str, base: Path) -> TaskSpec:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a table")
    merged = {**_unalias(defaults), **_unalias(raw)}
    if "name" not in raw:
        raise ValueError(f"{where}: field 'name' is required")
    values: dict[str, Any] = {}
    for key, value in merged.items():
        if key not in FIELDS:
            raise ValueError(f"{where}: unknown field {key!r} (known: {', '.join(FIELDS)})")
        values[key] = _typed(value, FIELDS[key], f"{where}.{key}")
    if not NAME.match(values["name"]):
        raise ValueError(f"{where}.name: {values['name']!r} must match {NAME.pattern}")
    data = values.get("task_data")  # relative paths are relative to the TOML file
    if isinstance(data, str) and not Path(data).expanduser().is_absolute():
        values["task_data"] = str((base / data).resolve())
    model = values.get("model", "tiny")
    if not Path(model).expanduser().is_absolute() and (base / model).is_dir():
        values["model"] = str((base / model).resolve())
    return TaskSpec(**values)


def load_tasks(path: str | Path) -> list[TaskSpec]:
    """Parse and validate a tasks file (see the module doc); ``ValueError`` names file, task, field."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--tasks {path}: cannot read ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--tasks {path}: not valid TOML ({e})") from None
    unknown = sorted(set(doc) - {"task", "defaults"})
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {unknown}; expected [defaults] and [[task]]")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ValueError(f"{path}: [defaults] must be a table")
    if "name" in defaults:
        raise ValueError(f"{path}: [defaults] cannot set 'name'")
    raw = doc.get("task")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: no [[task]] table")
    specs = [_task(t, defaults, f"{path}: task {i} ({_name(t)})", path.parent) for i, t in enumerate(raw)]
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"{path}: task name {s.name!r} is used twice")
        seen.add(s.name)
    for s in specs:  # the single-task checks (steps >= 1, estimator, loss, ...) before anything runs
        try:
            s.rl_options()
        except OptionError as e:  # the options name their fields; the file names its keys
            raise ValueError(f"{path}: task {s.name!r}: {e.named(cli_key(e.field))}") from None
        except ValueError as e:
            raise ValueError(f"{path}: task {s.name!r}: {e}") from None
    return specs


def _name(raw: Any) -> str:
    return repr(raw.get("name")) if isinstance(raw, dict) and "name" in raw else "unnamed"
