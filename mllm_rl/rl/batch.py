"""``RolloutBatch``, one RL step's training data, and ``build_batch`` that makes it from rollouts
(host numpy, backend-neutral)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mllm_rl.engine import ABORT, GenerateOutput


@dataclasses.dataclass
class RolloutBatch:
    """One RL step's data on the host: B sequences, T positions (prompt + completion, right-padded)."""

    tokens: np.ndarray  # [B, T] int32: prompt, completion, padding (0)
    attention_mask: np.ndarray  # [B, T] bool: True on real tokens
    loss_mask: np.ndarray  # [B, T] bool: True on completion tokens (predicted from t - 1; never t = 0)
    old_logp: np.ndarray  # [B, T] float32: the engine's log-prob of tokens[b, t] where loss_mask, else 0
    advantages: np.ndarray  # [B] float32: one scalar per completion
    # [B, T] float32: the policy-gradient term's per-token weight (truncated importance sampling,
    # mllm_rl.rl.old_logp); ones when not given
    is_weight: np.ndarray | None = None

    def __post_init__(self) -> None:
        b, t = self.tokens.shape
        if self.is_weight is None:
            self.is_weight = np.ones((b, t), np.float32)
        for name in ("attention_mask", "loss_mask", "old_logp", "is_weight"):
            if getattr(self, name).shape != (b, t):
                raise ValueError(f"RolloutBatch.{name}: shape {getattr(self, name).shape}, expected {(b, t)}")
        if self.advantages.shape != (b,):
            raise ValueError(f"RolloutBatch.advantages: shape {self.advantages.shape}, expected {(b,)}")
        if self.loss_mask[:, 0].any():
            raise ValueError("RolloutBatch.loss_mask[:, 0] must be False (position 0 is never predicted)")
        if (self.loss_mask & ~self.attention_mask).any():
            raise ValueError("RolloutBatch.loss_mask is True on padding")

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, s: slice) -> RolloutBatch:
        return RolloutBatch(*(getattr(self, f.name)[s] for f in dataclasses.fields(self)))


def build_batch(
    prompt_ids: Sequence[Sequence[int]],
    outputs: Sequence[GenerateOutput],
    advantages: np.ndarray,
    pad_id: int = 0,
) -> RolloutBatch:
    """One row per (prompt, completion): ``[prompt | completion | pad]``, T = longest row. An aborted
    completion (``pause_generation``) is kept with an empty loss mask and zero advantage."""
    if not (len(prompt_ids) == len(outputs) == len(advantages)):
        raise ValueError(f"{len(prompt_ids)} prompts, {len(outputs)} outputs, {len(advantages)} advantages")
    b = len(outputs)
    t = max(len(p) + len(o.token_ids) for p, o in zip(prompt_ids, outputs, strict=True))
    tokens = np.full((b, t), pad_id, np.int32)
    attn = np.zeros((b, t), bool)
    loss_mask = np.zeros((b, t), bool)
    old_logp = np.zeros((b, t), np.float32)
    adv = np.asarray(advantages, np.float32).copy()
    for i, (p, o) in enumerate(zip(prompt_ids, outputs, strict=True)):
        if len(o.logprobs) != len(o.token_ids):
            raise ValueError(f"output {i}: {len(o.token_ids)} tokens but {len(o.logprobs)} logprobs")
        n, m = len(p), len(o.token_ids)
        if n == 0:
            raise ValueError(f"prompt {i} is empty")
        tokens[i, :n] = p
        tokens[i, n : n + m] = o.token_ids
        attn[i, : n + m] = True
        if o.finish_reason == ABORT:
            adv[i] = 0.0
            continue
        loss_mask[i, n : n + m] = True
        old_logp[i, n : n + m] = o.logprobs
    return RolloutBatch(tokens, attn, loss_mask, old_logp, adv)
