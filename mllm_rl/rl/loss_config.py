"""Configuration of the policy-gradient loss, shared by every backend's loss code.

Per completion token (``A`` the sequence's advantage, ``r = exp(logp - old_logp)`` with the
log-ratio clamped to [-20, 20] as verl does, ``w`` the importance weight, 1 unless truncated
importance sampling is on: ``mllm_rl.rl.old_logp``)::

    pg    = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))      (PPO clip)
    pg    = min(pg, -A * clip_ratio_c)   where A < 0                  (dual-clip, when clip_ratio_c > 0)
    loss_t = w * pg + beta * KL_t

``KL_t``: k3 ``exp(ref - logp) - (ref - logp) - 1``, capped at ``kl_clamp`` (0 = uncapped).
Micro-batches get batch totals, so their losses sum to the full-batch loss. The aggregations,
``empty_seqs`` and the metrics against verl's and TRL's: docs/RL.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from mllm_rl.option_error import OptionError
from mllm_rl.options.check import check_fields, opt

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo", "token_sum_norm")
SEQ_MEANS = ("seq_mean_token_mean", "seq_mean_token_sum")  # the means that ``empty_seqs`` applies to
NEEDS_MAX_LEN = ("dr_grpo", "token_sum_norm")
EMPTY_SEQS = ("exclude", "count")
RENAMED = {"seq_mean_token_sum_norm": "dr_grpo"}  # old name -> the name of the same formula
LOG_RATIO_CLAMP = 20.0  # |logp - old_logp| is clamped before exp (verl's bound)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    eps_low: float = opt("eps_low")
    eps_high: float = opt("eps_high")
    beta: float = opt("kl_beta")  # KL weight; 0 = no reference policy needed
    aggregation: str = opt("loss_agg")
    max_len: int | None = None  # for dr_grpo and token_sum_norm
    clip_ratio_c: float = opt("clip_ratio_c")  # dual-clip bound for A < 0 (verl's default); 0 = off
    kl_clamp: float = opt("kl_clamp")  # cap of the per-token k3 (verl's 10); 0 = uncapped (TRL)
    empty_seqs: str = opt("loss_empty_seqs")  # sequence means: "exclude" (verl) | "count" (TRL)

    def __post_init__(self) -> None:
        if self.aggregation in RENAMED:  # before the schema's check: this one names both successors
            raise OptionError(
                "loss_agg",
                f"{self.aggregation!r} is now called {RENAMED[self.aggregation]!r} (the same formula, "
                f"TRL's name); verl's current seq-mean-token-sum-norm is 'token_sum_norm'",
            )
        check_fields(self)
        if self.aggregation in NEEDS_MAX_LEN and not self.max_len:
            raise OptionError("max_len", f"must be set for {self.aggregation}")
        if 0 < self.clip_ratio_c <= 1:  # the schema has one range per option: >= 0 there
            raise OptionError("clip_ratio_c", f"must be > 1 (or 0 = off), got {self.clip_ratio_c}")

    @property
    def excludes_empty(self) -> bool:
        """Does the aggregation's mean over sequences leave out sequences without a valid token?"""
        return self.aggregation in SEQ_MEANS and self.empty_seqs == "exclude"


def seq_count(mask: np.ndarray, cfg: LossConfig) -> float:
    """The sequence count a mean over sequences divides by (the loss's ``total_seqs``); ``mask``
    [B, T] is the batch's loss mask."""
    mask = np.asarray(mask)
    if cfg.excludes_empty:
        return float((mask.reshape(mask.shape[0], -1).sum(axis=1) > 0).sum())
    return float(mask.shape[0])
