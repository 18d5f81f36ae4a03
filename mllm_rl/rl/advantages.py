"""Group-relative advantage estimators (one scalar per completion).

``rewards`` has shape ``[num_prompts * group_size]``, completions of the same prompt
contiguous (prompt-major). Returns float32 advantages of the same shape.

- ``grpo``:    (r - mean_group) / (std_group + eps)             (DeepSeekMath GRPO); ``std``
  ``unbiased`` (n - 1, as verl and TRL) or ``biased`` (n); eps 1e-6 (verl's)
- ``drgrpo``:  r - mean_group                                   (Dr. GRPO: no std scaling)
- ``rloo``:    r - mean of the *other* completions of the group (leave-one-out baseline)
"""

from __future__ import annotations

import numpy as np

ESTIMATORS = ("grpo", "drgrpo", "rloo")
STDS = ("unbiased", "biased")


def group_advantages(
    rewards: np.ndarray, group_size: int, estimator: str = "grpo", eps: float = 1e-6, std: str = "unbiased"
) -> np.ndarray:
    if std not in STDS:
        raise ValueError(f"std {std!r}: choose one of {', '.join(STDS)}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {r.shape}")
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator {estimator!r}: choose one of {', '.join(ESTIMATORS)}")
    g = r.reshape(-1, group_size)
    mean = g.mean(axis=1, keepdims=True)
    if estimator == "grpo":
        if std == "unbiased" and group_size < 2:
            raise ValueError("the unbiased std needs group_size >= 2")
        ddof = 1 if std == "unbiased" else 0
        adv = (g - mean) / (g.std(axis=1, ddof=ddof, keepdims=True) + eps)
    elif estimator == "drgrpo":
        adv = g - mean
    else:
        if group_size < 2:
            raise ValueError("rloo needs group_size >= 2")
        adv = (g - mean) * group_size / (group_size - 1)  # r_i - mean_{j != i} r_j
    return adv.reshape(-1).astype(np.float32)
