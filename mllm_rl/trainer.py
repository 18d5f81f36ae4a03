"""The trainer contract (docs/DESIGN.md, "Contracts"), backend-neutral: what ``mllm_rl.lifecycle``
drives of a backend's trainer (the policy and its optimizer state)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mllm_rl.engine import Fingerprint, WeightExport
from mllm_rl.option_error import OptionError
from mllm_rl.options.check import check_fields, opt
from mllm_rl.options.schema import FROM_SCRATCH_LR
from mllm_rl.rl.batch import RolloutBatch  # defined with build_batch; imported from here by the backends
from mllm_rl.rl.loss_config import LossConfig

Manifest = dict[str, dict[str, Any]]  # a checkpoint file's relative path -> {"bytes": int, "sha256": hex}
PARAMS = "params"
OPTIMIZER = "optimizer"
PRECISIONS = ("mixed", "pure")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    lr: float = opt("lr", default=FROM_SCRATCH_LR, given=True)  # --lr unset: the model's (``default_lr``)
    weight_decay: float = opt("weight_decay")
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    grad_clip: float = opt("grad_clip")  # global-norm clipping; 0 = off
    mini_batches: int = opt("mini_batches")  # optimizer updates per RL step (the batch in this many parts)
    micro_batch_size: int = opt("micro_batch_size")  # sequences per forward/backward (gradient accumulation)
    loss: LossConfig = LossConfig()
    lora_rank: int = opt("lora_rank")  # > 0: train LoRA adapters on every linear layer, base frozen
    lora_alpha: float = opt("lora_alpha")
    seed: int = opt("seed")
    # Every trainer log-prob is of softmax(logits / temperature), the distribution the engine sampled.
    temperature: float = opt("temperature", given=True)
    # mixed: float32 master params and AdamW moments, compute in the checkpoint's dtype; pure: all
    # in the checkpoint's dtype (half the state; updates below half an ulp are lost).
    precision: str = opt("precision")
    # The backend's model options by name (JAX ``ModelOptions``, torch ``TorchModelOptions``).
    model_options: tuple[tuple[str, Any], ...] = ()
    trainer_tp: int = opt("trainer_tp")
    # How the trainer's state is sharded (JAX: the fsdp axis; torch: FSDP2); 0: over everything.
    fsdp: int = opt("fsdp")
    # JAX: orbax's zstd on the checkpointed arrays (torch refuses it: its state is written raw).
    checkpoint_compression: bool = opt("checkpoint_compression")

    def __post_init__(self) -> None:
        check_fields(self)
        # The option takes 0 (``RLOptions`` says why a run refuses it); the log-probs divide by it.
        if self.temperature == 0:
            raise OptionError("temperature", f"must be > 0, got {self.temperature}")


def check_state_names(what: Sequence[str]) -> list[str]:
    """``what`` of ``offload``/``onload`` validated (``params`` / ``optimizer``), deduplicated."""
    if isinstance(what, str):
        raise ValueError(f"offload/onload take a list of names, got the string {what!r}")
    bad = [w for w in what if w not in (PARAMS, OPTIMIZER)]
    if bad:
        raise ValueError(f"unknown trainer state {bad}; use {PARAMS!r} and/or {OPTIMIZER!r}")
    return list(dict.fromkeys(what))


class TrainerStateError(RuntimeError):
    """An operation the trainer's residency does not allow (e.g. training with params offloaded)."""


def require_resident(resident: dict[str, bool], *what: str) -> None:
    """``TrainerStateError`` naming the groups of ``what`` that are not resident."""
    missing = [w for w in what if not resident[w]]
    if missing:
        raise TrainerStateError(f"trainer {', '.join(missing)} offloaded; onload first")


def greedy_loop(
    step: Callable[[list[int]], tuple[int, float]], prompt: Sequence[int], n: int, eos: int
) -> tuple[list[int], list[float]]:
    """Up to ``n`` greedy tokens after ``prompt``, stopping after ``eos``: ``step(ids)`` gives the next
    token and a value for it. Returns (tokens, values)."""
    ids, out, values = [int(t) for t in prompt], [], []
    for _ in range(n):
        tok, value = step(ids)
        out.append(tok)
        values.append(value)
        ids.append(tok)
        if tok == eos:
            break
    return out, values


_TOKEN_MEANS = ("clip_frac", "clip_frac_dual", "kl", "ratio_mean")
TRAIN_METRICS = ("loss", "grad_norm", *_TOKEN_MEANS, "neg_logp_mean", "tokens", "updates", "train_s")


def train_metrics(
    loss_sum: float, n_parts: int, grad_norms: list[float], totals: dict[str, float], seconds: float
) -> dict[str, float]:
    """``TRAIN_METRICS`` from a step's sums: ``totals`` are token sums (and ``tokens``), reported
    as per-token means; ``loss_sum`` over ``n_parts`` micro-batches; one grad norm per update."""
    n = max(totals.get("tokens", 0.0), 1.0)
    return {
        "loss": loss_sum / max(n_parts, 1),
        "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
        **{k: totals.get(k, 0.0) / n for k in _TOKEN_MEANS},
        "neg_logp_mean": totals.get("entropy_proxy", 0.0) / n,
        "tokens": int(totals.get("tokens", 0.0)),
        "updates": len(grad_norms),
        "train_s": round(seconds, 4),
    }


class TrainerSnapshot(Protocol):
    """A trainer's saved state, copied into host memory (``Trainer.snapshot``)."""

    nbytes: int  # host bytes the copy holds until it is written and dropped

    def write(self, path: Path) -> Manifest | None:
        """``Trainer.save``'s files into ``path`` (safe on another thread); what ``save`` returns."""


class Trainer(Protocol):
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL step; returns ``TRAIN_METRICS`` (built by ``train_metrics``)."""

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        """Log-prob of ``tokens[b, t]`` given ``tokens[b, :t]``, [B, T] (0 at t = 0 and on padding)."""

    def offload(self, what: Sequence[str]) -> int:
        """Move ``params``/``optimizer`` off the device; returns device bytes they held."""

    def onload(self, what: Sequence[str]) -> int:
        """Bring them back; returns device bytes they hold again."""

    def resident(self) -> dict[str, bool]:
        """``{"params": bool, "optimizer": bool}``: on the device now?"""

    def state_bytes(self) -> dict[str, int]:
        """``{"params": int, "optimizer": int}``: device bytes each holds (call while resident)."""

    def greedy(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy continuation of ``prompt`` (<= n tokens, to EOS) and each token's top-2 logit margin."""

    def export_weights(self, full: bool = True) -> WeightExport:
        """HF-named tensors for the rollout engine (full, or only what training changes)."""

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        """(sum, sumsq) of the exported tensors (all, or ``names``)."""

    def save(self, path: Path) -> Manifest | None:
        """Write params and optimizer state into the directory ``path`` (both resident); the manifest
        entries of files it hashed while writing (``None``: none)."""

    def snapshot(self, path: Path) -> TrainerSnapshot | None:
        """What ``save`` writes into ``path``, copied to host memory now, for another thread to write
        (orbax begins its write here). ``None``: this trainer saves only in place."""

    def restore(self, path: Path) -> None:
        """Load what ``save`` wrote (both resident)."""
