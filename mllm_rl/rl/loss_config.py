"""Configuration of the policy-gradient loss, shared by every backend's loss code.

Per completion token (``A`` the sequence's advantage, ``r = exp(logp - old_logp)`` with the
log-ratio clamped to [-20, 20] as verl does, ``w`` the token's importance weight)::

    pg    = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))      (PPO clip)
    pg    = min(pg, -A * clip_ratio_c)   where A < 0                  (dual-clip, when clip_ratio_c > 0)
    loss_t = w * pg + beta * KL_t

``KL_t`` is the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` of the KL to a reference
policy, part of the loss (not only logged) when ``beta > 0``. ``w`` is 1 unless truncated
importance sampling is on (``mllm_rl.rl.old_logp``).

Aggregation (``agg``) over valid completion tokens of the whole batch (micro-batches pass
the batch totals, so summing their losses gives exactly the full-batch loss):

- ``token_mean``: sum over tokens / number of tokens in the batch (verl ``token-mean``,
  TRL ``dapo``);
- ``seq_mean_token_mean``: mean over sequences of each sequence's token mean (verl
  ``seq-mean-token-mean``, TRL ``grpo``);
- ``seq_mean_token_sum``: mean over sequences of each sequence's token sum (verl
  ``seq-mean-token-sum``);
- ``dr_grpo``: each sequence's token sum / ``max_len``, mean over sequences (TRL
  ``dr_grpo``; current verl's ``seq-mean-token-sum-norm`` with ``loss_scale_factor = max_len``,
  older verl releases omit the mean over sequences, hence not that name).

Metrics (token means): ``clip_frac`` = tokens whose clipped term is taken (the clip cuts the
gradient: verl ``pg_clipfrac``, TRL ``clip_ratio``), ``clip_frac_dual`` = tokens the dual
clip caps (verl ``pg_clipfrac_lower``), ``ratio_mean``, ``kl``.
"""

from __future__ import annotations

import dataclasses
import math

from mllm_rl.option_error import OptionError
from mllm_rl.options.schema import default

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo")
RENAMED = {"seq_mean_token_sum_norm": "dr_grpo"}  # old name -> the name of the same formula
LOG_RATIO_CLAMP = 20.0  # |logp - old_logp| is clamped before exp (verl's bound)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    eps_low: float = default("eps_low")
    eps_high: float = default("eps_high")
    beta: float = default("kl_beta")  # KL weight; 0 = no reference policy needed
    aggregation: str = default("loss_agg")
    max_len: int | None = None  # for dr_grpo
    clip_ratio_c: float = default("clip_ratio_c")  # dual-clip bound for A < 0 (verl's default); 0 = off

    def __post_init__(self) -> None:
        if self.aggregation in RENAMED:
            raise OptionError(
                "aggregation",
                f"{self.aggregation!r} is now called {RENAMED[self.aggregation]!r} (the same formula, "
                f"TRL's name; verl's seq-mean-token-sum-norm differs between releases)",
            )
        if self.aggregation not in AGGREGATIONS:
            raise OptionError("aggregation", f"{self.aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
        if self.aggregation == "dr_grpo" and not self.max_len:
            raise OptionError("max_len", "must be set for dr_grpo")
        for field in ("eps_low", "eps_high", "beta", "clip_ratio_c"):
            if not (math.isfinite(getattr(self, field)) and getattr(self, field) >= 0):
                raise OptionError(field, f"must be >= 0, got {getattr(self, field)}")
        if 0 < self.clip_ratio_c <= 1:
            raise OptionError("clip_ratio_c", f"must be > 1 (or 0 = off), got {self.clip_ratio_c}")
