"""Configuration of the policy-gradient loss, shared by every backend's loss code.

``loss = agg( -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * KL )``
with ``ratio = exp(logp - old_logp)`` against the *rollout* log-probs and the k3 estimator
``exp(ref - logp) - (ref - logp) - 1`` of the KL to a reference policy, which is part of the
loss (not only logged) when ``beta > 0``.

Aggregation (``agg``) over valid completion tokens of the whole batch (micro-batches pass
the batch totals, so summing their losses gives exactly the full-batch loss):

- ``token_mean``: sum over tokens / number of tokens in the batch;
- ``seq_mean_token_mean``: mean over sequences of each sequence's token mean;
- ``seq_mean_token_sum_norm``: Dr. GRPO: each sequence's token sum / ``max_len``, mean over
  sequences.
"""

from __future__ import annotations

import dataclasses

from mllm_rl.option_error import OptionError

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0  # KL weight; 0 = no reference policy needed
    aggregation: str = "token_mean"
    max_len: int | None = None  # for seq_mean_token_sum_norm

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise OptionError("aggregation", f"{self.aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
        if self.aggregation == "seq_mean_token_sum_norm" and not self.max_len:
            raise OptionError("max_len", "must be set for seq_mean_token_sum_norm")
        for field in ("eps_low", "eps_high", "beta"):
            if getattr(self, field) < 0:
                raise OptionError(field, f"must be >= 0, got {getattr(self, field)}")
