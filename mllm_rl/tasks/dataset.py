"""A task read from a dataset (``--data``): its rows as prompts, a held-out set, a reward by import path.

Epoch ``e`` visits every training row once in ``default_rng([seed, e, DATA_STREAM]).permutation``
order; step ``s`` takes the next ``prompts_per_step``, so a step's prompts are a pure function of
``(seed, step)``. Held-out set: ``--eval-data``, else a ``DatasetDict``'s ``test``/``validation``
split, else ``eval_prompts`` rows split off (at most a quarter, by a seed-independent RNG so runs
of different seeds are scored on the same rows), never trained on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mllm_rl.tasks.base import Example
from mllm_rl.tasks.data import Table, answer_of, check_columns, prompt_of, read_table
from mllm_rl.tasks.reward import DEFAULT_TIMEOUT_S, Scorer

DATA_STREAM = 7  # the training order's RNG stream
HOLDOUT_SEED = 20250101  # the held-out split's RNG (independent of --seed)
MAX_HELDOUT_FRACTION = 4  # a split-off held-out set is at most 1/4 of the rows


def examples_of(
    table: Table,
    prompt_key: str,
    answer_key: str,
    make_prompt: Callable[[Any], Any] = lambda p: p,
    check_answer: Callable[[str, str], None] | None = None,
    limit: int | None = None,
) -> list[Example]:
    """Every row of ``table`` (the first ``limit``) as an ``Example``, each checked (``ValueError``
    naming the file and the row: no prompt, an empty or non-text one, no answer)."""
    check_columns(table, prompt_key, answer_key)
    n = len(table.rows) if limit is None else min(limit, len(table.rows))
    out = []
    for i in range(n):
        prompt = make_prompt(prompt_of(table, i, prompt_key))
        answer = answer_of(table, i, answer_key)
        if check_answer is not None:
            check_answer(answer, table.where(i))
        out.append(Example(prompt=prompt, answer=answer, row=table.rows[i], where=table.where(i), index=i))
    return out


class DatasetTask:
    """``Task`` over the rows of a dataset (see the module doc)."""

    templated = True

    def __init__(
        self,
        name: str,
        examples: list[Example],
        heldout: list[Example] | None,
        eval_prompts: int,
        reward_spec: str,
        reward_timeout: float = DEFAULT_TIMEOUT_S,
        reward_env: dict[str, str] | None = None,
    ) -> None:
        if not examples:
            raise ValueError("no rows")
        self.name, self.reward_spec = name, reward_spec
        self.examples = tuple(examples)  # every row of the data, in file order
        self.notes: list[str] = []
        if heldout is not None:
            self.train = tuple(range(len(examples)))
            self.held = tuple(heldout)
        else:
            h = min(eval_prompts, len(examples) // MAX_HELDOUT_FRACTION)
            order = np.random.default_rng(HOLDOUT_SEED).permutation(len(examples))
            held = sorted(int(i) for i in order[:h])
            taken = set(held)
            self.train = tuple(i for i in range(len(examples)) if i not in taken)
            self.held = tuple(examples[i] for i in held)
            if h == 0:
                self.held = self.examples[:eval_prompts]
                self.notes.append(
                    f"note: {len(examples)} rows are too few to hold any out: the evaluation scores "
                    f"training rows (pass --eval-data for a held-out set)"
                )
            elif h < eval_prompts:
                self.notes.append(
                    f"note: {h} of {len(examples)} rows held out for evaluation (at most a quarter; "
                    f"--eval-prompts {eval_prompts}); training on the other {len(self.train)}"
                )
        self.scorer = Scorer(reward_spec, reward_timeout, reward_env)
        self._perms: dict[int, np.ndarray] = {}
        self._seed: int | None = None

    def _perm(self, seed: int, epoch: int) -> np.ndarray:
        if self._seed != seed:
            self._perms, self._seed = {}, seed
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([seed, epoch, DATA_STREAM]).permutation(
                len(self.train)
            )
        return self._perms[epoch]

    def batch(self, seed: int, step: int, n: int) -> list[Example]:
        m = len(self.train)
        out = []
        for j in range(n):
            epoch, k = divmod(step * n + j, m)
            out.append(self.examples[self.train[int(self._perm(seed, epoch)[k])]])
        return out

    def heldout(self, seed: int, n: int) -> list[Example]:
        return list(self.held[:n])

    def sizing(self, seed: int) -> list[Example]:
        mine = {id(e) for e in self.examples}
        return [*self.examples, *(e for e in self.held if id(e) not in mine)]

    def rewards(self, prompts: list[str], completions: list[str], examples: list[Example], what: str) -> Any:
        return self.scorer.rewards(prompts, completions, examples, what)

    def close(self) -> None:
        self.scorer.close()


def dataset_task(
    name: str,
    path: str,
    prompt_key: str,
    answer_key: str,
    eval_data: str | None,
    eval_prompts: int,
    reward: str,
    reward_timeout: float = DEFAULT_TIMEOUT_S,
    make_prompt: Callable[[Any], Any] = lambda p: p,
    check_answer: Callable[[str, str], None] | None = None,
) -> DatasetTask:
    """The task over the rows of ``path`` (every row checked) and its held-out set (``eval_data``,
    else a saved ``DatasetDict``'s test split, else rows split off: see the module doc)."""
    table = read_table(path, "--task-data")
    examples = examples_of(table, prompt_key, answer_key, make_prompt, check_answer)
    if not examples:
        raise ValueError(f"{table.path}: no rows")
    held_table = read_table(eval_data, "--eval-data") if eval_data is not None else table.heldout
    heldout = None
    if held_table is not None:
        heldout = examples_of(
            held_table, prompt_key, answer_key, make_prompt, check_answer, limit=eval_prompts
        )
        if not heldout:
            raise ValueError(f"{held_table.path}: no rows")
    env = {"MLLM_RL_PROMPT_KEY": prompt_key, "MLLM_RL_ANSWER_KEY": answer_key}
    return DatasetTask(name, examples, heldout, eval_prompts, reward, reward_timeout, env)
