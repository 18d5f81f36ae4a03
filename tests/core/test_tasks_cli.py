"""Bring your own task through ``python -m mllm_rl.run``: the settings, the phases a run with
``--eval-every`` expects (run.json, ``--phase-timeout``), and bad data refused before anything
starts (exit 2, one line naming the file and the row, no run directory)."""

from __future__ import annotations

import json

import pytest

from mllm_rl.plans.preflight import build_options, known_phases
from mllm_rl.plans.rl import PLAN, RLOptions
from mllm_rl.run import parse_args
from tests.conftest import run_cli


def opts_of(*argv: str) -> RLOptions:
    args, _ = parse_args(["--backend", "jax", *argv])
    return build_options(args)


def test_the_settings_reach_the_task_and_data_alone_means_the_data_task(tmp_path):
    o = opts_of("--data", "d.jsonl", "--reward", "mllm_rl.tasks.boxed:reward", "--prompt-key", "q", "--answer-key", "",
                "--eval-data", "e.jsonl", "--eval-every", "5", "--reward-timeout", "2.5", "--chat-template", "off")  # fmt: skip
    assert o.task == "data" and o.task_data == "d.jsonl" and o.chat_template == "off" and o.eval_every == 5
    cfg = o.task_config
    assert (cfg.prompt_key, cfg.answer_key, cfg.eval_data, cfg.reward, cfg.reward_timeout) == (
        "q", "", "e.jsonl", "mllm_rl.tasks.boxed:reward", 2.5)  # fmt: skip
    assert opts_of().task == "pattern" and opts_of("--task", "boxed").task == "boxed"


def test_evaluate_is_a_phase_of_every_step_that_scores_every_n_steps_and_the_last():
    o = opts_of("--steps", "10", "--eval-every", "4")
    assert [s for s in range(10) if o.evaluates_after(s)] == [3, 7, 9]
    assert not any(opts_of("--steps", "10").evaluates_after(s) for s in range(10))

    class B:
        ready_phase = "jax_ready"

    with_eval = PLAN.run_json(B(), o)
    assert with_eval["expected_step_phases"][-1] == "evaluate" and with_eval["eval_every"] == 4
    assert "evaluate" not in PLAN.run_json(B(), opts_of())["expected_step_phases"]
    assert with_eval["reward"] == "mllm_rl.tasks.pattern:reward"
    assert "evaluate" in known_phases()  # --phase-timeout evaluate=SECONDS


def rows_file(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "rows,extra,message",
    [
        ([{"prompt": "a", "answer": "1"}, {"prompt": ["not", "messages"], "answer": "2"}], [],
         "{data}:2: the prompt ('prompt') is list ['not', 'messages'], not text (a string, or a list of {{role, content}} messages)"),
        ([{"prompt": "a" * 300, "answer": "1"}], ["--context-length", "128"],
         "{data}:1: the prompt is 319 tokens; with --max-new-tokens 8 it needs a context of 328, and the run allows 128 (--context-length)"),
        ([{"prompt": "a" * 300, "answer": "1"}], ["--context-length", "128", "--chat-template", "off"],
         "{data}:1: the prompt is 300 tokens; with --max-new-tokens 8 it needs a context of 309"),
        ([{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}], ["--chat-template", "off"],
         "{data}:1: a list of messages needs a chat template (--chat-template off)"),
    ],
)  # fmt: skip
def test_bad_data_is_refused_before_anything_starts(tmp_path, rows, extra, message):
    data = rows_file(tmp_path, rows)
    run_dir = tmp_path / "run"
    r = run_cli("mllm_rl.run", "--backend", "jax", "--data", str(data), "--reward", "mllm_rl.tasks.pattern:reward",
                "--run-dir", str(run_dir), "--wandb", "offline", *extra)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["error: " + message.format(data=data)] or (
        r.stderr.strip().startswith("error: " + message.format(data=data)) and r.stderr.count("\n") == 1
    ), r.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "table,message",
    [
        ("eval_every = 2", "task 'a': eval_every is not taken in a --tasks file yet"),
        ('task_data = "d.jsonl"', "task 'a': --task-data "),  # a dataset needs a reward
        ('task_data = "d.jsonl"\nreward = "nowhere.py:score"', "task 'a': --reward "),
        ('task_data = "d.jsonl"\nprompt_key = "question"\nreward = "mllm_rl.tasks.pattern:reward"',
         "task 'a': "),  # the data has no column 'question'
    ],
)  # fmt: skip
def test_a_tasks_file_refuses_what_its_tasks_cannot_take_yet(tmp_path, table, message):
    rows_file(tmp_path, [{"prompt": "a", "answer": "1"}])
    path = tmp_path / "tasks.toml"
    path.write_text(f'[[task]]\nname = "a"\n{table}\n')
    r = run_cli("mllm_rl.run", "--backend", "jax", "--tasks", str(path), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "run").exists()
