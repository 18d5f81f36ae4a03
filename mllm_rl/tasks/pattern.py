"""Pattern completion: continue a periodic string (``"cabcabca"`` -> ``"bcab"``); the ``tiny`` preset
learns it from random init in a few CPU minutes. The reward is the fraction of answer positions
matched (partial credit keeps the signal dense). Prompts come from ``default_rng([seed, step, 0])``,
held-out ones from ``EVAL_STREAM``; no chat template."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mllm_rl.tasks.data import Example
from mllm_rl.tasks.reward import DEFAULT_TIMEOUT_S, Scorer

REWARD = "mllm_rl.tasks.pattern:reward"
EVAL_STREAM = 2**31 - 1  # the held-out prompts' RNG stream (never a training step)


def reward(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """Fraction of ``row["answer"]``'s characters the completion's first characters match."""
    answer = row["answer"]
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return hits / len(answer)


@dataclasses.dataclass(frozen=True)
class PatternTask:
    alphabet: str = "abcd"
    periods: tuple[int, ...] = (1, 2, 3)
    prompt_len: tuple[int, int] = (6, 10)  # [min, max)
    answer_len: int = 4
    name: str = "pattern"
    reward_spec: str = REWARD
    reward_timeout: float = DEFAULT_TIMEOUT_S
    templated: bool = False
    scorer: Scorer = dataclasses.field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.scorer is None:
            object.__setattr__(self, "scorer", Scorer(self.reward_spec, self.reward_timeout))

    def example(self, rng: np.random.Generator) -> Example:
        period = int(rng.choice(self.periods))
        unit = "".join(rng.choice(list(self.alphabet), size=period))
        n = int(rng.integers(*self.prompt_len))
        text = unit * (-(-(n + self.answer_len) // period))
        prompt, answer = text[:n], text[n : n + self.answer_len]
        return Example(prompt=prompt, answer=answer, row={"prompt": prompt, "answer": answer})

    def sample(self, rng: np.random.Generator, n: int) -> list[Example]:
        return [self.example(rng) for _ in range(n)]

    def reward(self, completion: str, example: Example) -> float:
        return reward(example.prompt, completion, {"answer": example.answer})

    def batch(self, seed: int, step: int, n: int) -> list[Example]:
        return self.sample(np.random.default_rng([seed, step, 0]), n)

    def heldout(self, seed: int, n: int) -> list[Example]:
        return self.sample(np.random.default_rng([seed, EVAL_STREAM, 2]), n)

    def sizing(self, seed: int) -> list[Example]:
        return self.sample(np.random.default_rng([seed, EVAL_STREAM, 3]), 512)

    def rewards(self, prompts: list[str], completions: list[str], examples: list[Example], what: str) -> Any:
        return self.scorer.rewards(prompts, completions, examples, what)

    def close(self) -> None:
        self.scorer.close()
