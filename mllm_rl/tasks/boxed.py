"""GSM8K-style math with a ``\\boxed{}`` answer: a dataset (default: a shipped sample) and a reward.

Rows: ``{"question", "answer"}`` (other columns with ``--prompt-key`` / ``--answer-key``); the
answer is GSM8K's solution ending in ``#### 72`` or just ``72``. The prompt is the question and
``INSTRUCTION``. ``reward``: 1.0 when the last ``\\boxed{...}`` of the completion equals the target
after normalisation (spaces, ``$``, thousands commas, a trailing ``.0``) or as math
(``math-verify``: ``\\frac{144}{2}`` is 72), else 0.0.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from mllm_rl.tasks.data import dataset_task

INSTRUCTION = "Please put the final answer within \\boxed{}."
SAMPLE_DATA = Path(__file__).resolve().parent / "data" / "boxed_sample.jsonl"
REWARD = "mllm_rl.tasks.boxed:reward"
ANSWER_KEY_ENV = "MLLM_RL_ANSWER_KEY"  # set in the reward worker: the column --answer-key names


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


def math_equal(got: str, target: str) -> bool:
    """``got`` equals ``target``: as normalised text, or as math (``math-verify``)."""
    if normalize(got) == normalize(target):
        return True
    if not normalize(got):
        return False
    from math_verify import parse, verify

    # math-verify bounds parse/verify with SIGALRM, which only the main thread may set
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${target}$", parsing_timeout=limit)  # type: ignore[arg-type]
    pred = parse(f"${got}$", parsing_timeout=limit)  # type: ignore[arg-type]
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=limit))


def boxed_reward(completion: str, answer: str) -> float:
    got = last_boxed(completion)
    return float(got is not None and math_equal(got, target_of(answer)))


def reward(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """The boxed task's reward: ``boxed_reward`` against the row's answer column."""
    return boxed_reward(completion, str(row[os.environ.get(ANSWER_KEY_ENV) or "answer"]))


def prompt_text(question: Any) -> Any:
    """The prompt of a question: the question and ``INSTRUCTION`` (chat messages unchanged)."""
    return f"{question}\n{INSTRUCTION}\n" if isinstance(question, str) else question


def boxed_task(cfg: Any) -> Any:
    """The boxed task of ``cfg`` (a ``TaskConfig``) over ``cfg.data`` (default: the shipped sample)."""
    akey = "answer" if cfg.answer_key is None else cfg.answer_key
    if not akey:
        raise ValueError("--answer-key '': the boxed task scores against an answer column")

    def check(answer: str, where: str) -> None:
        if not target_of(answer):
            raise ValueError(f"{where}: the answer ({akey!r}) has no target (GSM8K's '#### 72', or '72')")

    pkey = "question" if cfg.prompt_key is None else cfg.prompt_key
    data = str(SAMPLE_DATA) if cfg.data is None else cfg.data
    return dataset_task(cfg, data, pkey, akey, cfg.reward or REWARD, prompt_text, check)
