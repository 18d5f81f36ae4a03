"""Pattern completion: continue a periodic string. Learnable by the ``tiny`` preset from
random init within a few CPU minutes, which makes RL progress visible on the embedded default.

A prompt is a short unit of letters from ``alphabet`` repeated to a random length, e.g.
``"cabcabca"`` (unit ``"cab"``); the answer is the next ``answer_len`` characters
(``"bcab"``). The reward is the fraction of answer positions the completion's first
characters match exactly (partial credit keeps the signal dense: a random policy over the
model's 384-token vocabulary scores ~0.003).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mllm_rl.tasks.base import Example


@dataclasses.dataclass(frozen=True)
class PatternTask:
    alphabet: str = "abcd"
    periods: tuple[int, ...] = (1, 2, 3)
    prompt_len: tuple[int, int] = (6, 10)  # [min, max)
    answer_len: int = 4
    name: str = "pattern"

    def example(self, rng: np.random.Generator) -> Example:
        period = int(rng.choice(self.periods))
        unit = "".join(rng.choice(list(self.alphabet), size=period))
        n = int(rng.integers(*self.prompt_len))
        text = unit * (-(-(n + self.answer_len) // period))
        return Example(prompt=text[:n], answer=text[n : n + self.answer_len])

    def sample(self, rng: np.random.Generator, n: int) -> list[Example]:
        return [self.example(rng) for _ in range(n)]

    def reward(self, completion: str, example: Example) -> float:
        hits = sum(a == b for a, b in zip(completion, example.answer, strict=False))
        return hits / len(example.answer)
