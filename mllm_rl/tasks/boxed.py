"""GSM8K-style math with a ``\\boxed{}`` answer, from a local JSONL file.

Each line: ``{"question": str, "answer": str}``; the answer may be GSM8K's full solution
ending in ``#### 72`` (the number after ``####`` is the target) or just ``72``. The reward
is 1.0 when the last ``\\boxed{...}`` of the completion equals the target after
normalisation (spaces, ``$``, thousands commas and a trailing ``.0`` removed), else 0.0.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from mllm_rl.tasks.base import Example

INSTRUCTION = "Please put the final answer within \\boxed{}."
SAMPLE_DATA = Path(__file__).resolve().parent / "data" / "boxed_sample.jsonl"


def normalize(ans: str) -> str:
    s = ans.strip().replace(" ", "").replace("$", "").replace(",", "")
    if s.endswith(".0"):
        s = s[:-2]
    return s.rstrip(".")


def target_of(answer: str) -> str:
    """GSM8K ``... #### 72`` -> ``72``; a bare answer is returned normalised."""
    return normalize(answer.rsplit("####", 1)[-1])


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def boxed_reward(completion: str, answer: str) -> float:
    got = last_boxed(completion)
    return float(got is not None and normalize(got) == target_of(answer))


@dataclasses.dataclass(frozen=True)
class BoxedMathTask:
    examples: tuple[Example, ...]
    name: str = "boxed"

    @classmethod
    def from_jsonl(cls, path: str | Path | None) -> BoxedMathTask:
        """Load ``path`` (default: the shipped sample); one-line errors name file and line."""
        path = Path(path) if path else SAMPLE_DATA
        if not path.is_file():
            raise ValueError(f"--task-data {path}: not a file")
        examples = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                q, a = row["question"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{i}: expected a JSON object with question and answer ({e})"
                ) from None
            if not isinstance(q, str) or not isinstance(a, str) or not target_of(a):
                raise ValueError(f"{path}:{i}: question and answer must be non-empty strings")
            examples.append(Example(prompt=f"{q}\n{INSTRUCTION}\n", answer=a))
        if not examples:
            raise ValueError(f"{path}: no examples")
        return cls(tuple(examples))

    def sample(self, rng: np.random.Generator, n: int) -> list[Example]:
        idx = rng.choice(len(self.examples), size=n, replace=n > len(self.examples))
        return [self.examples[int(i)] for i in idx]

    def reward(self, completion: str, example: Example) -> float:
        return boxed_reward(completion, example.answer)
