"""Configuration of the policy-gradient loss, shared by every backend's loss code.

Per completion token (``A`` the sequence's advantage, ``r = exp(logp - old_logp)`` with the
log-ratio clamped to [-20, 20] as verl does, ``w`` the token's importance weight)::

    pg    = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))      (PPO clip)
    pg    = min(pg, -A * clip_ratio_c)   where A < 0                  (dual-clip, when clip_ratio_c > 0)
    loss_t = w * pg + beta * KL_t

``KL_t`` is the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` of the KL to a reference
policy, capped at ``kl_clamp`` (verl's ``low_var_kl`` clamps to [-10, 10]; k3 >= 0, so only the
cap acts, and a capped token gets no KL gradient; ``kl_clamp = 0``: uncapped, as TRL), part of
the loss (not only logged) when ``beta > 0``. ``w`` is 1 unless truncated importance sampling is
on (``mllm_rl.rl.old_logp``).

Aggregation (``aggregation``) over valid completion tokens of the whole batch (micro-batches
pass the batch totals, so summing their losses gives exactly the full-batch loss):

- ``token_mean``: sum over tokens / number of tokens in the batch (verl ``token-mean``,
  TRL ``dapo`` / ``bnpo``);
- ``seq_mean_token_mean``: mean over sequences of each sequence's token mean (verl
  ``seq-mean-token-mean``; TRL ``grpo`` with ``empty_seqs="count"``);
- ``seq_mean_token_sum``: mean over sequences of each sequence's token sum (verl
  ``seq-mean-token-sum``);
- ``dr_grpo``: each sequence's token sum / ``max_len``, mean over all sequences of the batch
  (TRL ``dr_grpo``: ``sum / (B * max_completion_length)``);
- ``token_sum_norm``: the batch's token sum / ``max_len``, no mean over sequences (verl
  ``seq-mean-token-sum-norm`` with ``loss_scale_factor = max_len``: ``dr_grpo`` times the
  number of sequences).

``empty_seqs`` says what the two sequence means do with a sequence that has no valid token (an
aborted completion, an all-zero mask): ``exclude`` leaves it out of the count (verl's
``agg_loss``), ``count`` counts it as a sequence of loss 0 (TRL's ``grpo``). ``dr_grpo`` always
divides by every sequence (TRL's constant normaliser); a batch with no valid token has loss 0.

Metrics (token means): ``clip_frac`` = tokens whose clipped term is taken (the clip cuts the
gradient: verl ``pg_clipfrac``, TRL ``clip_ratio/region_mean``), ``clip_frac_dual`` = tokens the
dual clip caps (verl ``pg_clipfrac_lower``), ``ratio_mean``, ``kl`` (capped as in the loss).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mllm_rl.option_error import OptionError
from mllm_rl.options.fields import check_fields, opt

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
    """The number of sequences a batch's mean over sequences divides by (``total_seqs`` of the
    loss when its micro-batches are accumulated): ``mask`` [B, T] the loss mask of the batch."""
    mask = np.asarray(mask)
    if cfg.excludes_empty:
        return float((mask.reshape(mask.shape[0], -1).sum(axis=1) > 0).sum())
    return float(mask.shape[0])
