"""Turn rollouts into a ``RolloutBatch`` (host numpy, backend-neutral)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mllm_rl.engine import ABORT, GenerateOutput
from mllm_rl.trainer import RolloutBatch


def build_batch(
    prompt_ids: Sequence[Sequence[int]],
    outputs: Sequence[GenerateOutput],
    advantages: np.ndarray,
    pad_id: int = 0,
) -> RolloutBatch:
    """One row per (prompt, completion): ``[prompt | completion | pad]``, T = longest row.

    ``loss_mask`` covers the completion tokens; ``old_logp`` holds the engine's log-probs
    there. A completion cut short by ``pause_generation`` (``finish_reason == "abort"``) is
    kept in the batch with an empty loss mask and zero advantage: reported, never trained on.
    """
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
