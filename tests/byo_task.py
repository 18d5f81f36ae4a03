"""Bring your own task, as a user does it, on a whole run (``python -m mllm_rl.run`` in a subprocess
of the test's venv): a JSONL file of their own and a reward function passed by file path. The JAX and
the torch test files call these with their backend; tests/core/test_multitask_fake_run.py calls
``tasks_file_takes_a_dataset_and_a_reward_file`` on the fake backend."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

REWARDS_PY = '''
import math
import os
import time
from pathlib import Path

if os.environ.get("BYO_WORKER_PID"):  # the test checks that the worker is gone after the run
    Path(os.environ["BYO_WORKER_PID"]).write_text(str(os.getpid()))


def score(prompt, completion, row):
    """The fraction of the answer's characters the completion starts with."""
    answer = row["answer"]
    return sum(a == b for a, b in zip(completion, answer)) / len(answer)


def hangs(prompt, completion, row):
    time.sleep(600)
    return 1.0


def nan(prompt, completion, row):
    return math.nan
'''
FAILURES = {  # reward function: what the run's last line says after "on sample 0 of step 0 (...)"
    "hangs": ": no result within 3 s (--reward-timeout) on sample 0 of step 0",
    "nan": "returned nan on sample 0 of step 0",
}  # one whole run per backend; every way a reward fails is tested in-process (tests/core/test_tasks_reward.py)


def write_task(d: Path, rows: int = 200) -> tuple[Path, Path]:
    """``data.jsonl``: periodic strings to continue (``{prompt, answer, period}``), and ``rewards.py``."""
    from mllm_rl.tasks.pattern import PatternTask

    task = PatternTask()
    data = d / "data.jsonl"
    with data.open("w") as f:
        for e in task.sample(np.random.default_rng(2024), rows):
            f.write(json.dumps({"prompt": e.prompt, "answer": e.answer, "period": len(set(e.prompt))}) + "\n")
    (d / "rewards.py").write_text(REWARDS_PY)
    return data, d / "rewards.py"


def run_learns_from_a_jsonl_and_a_reward_file(backend: str, tmp: Path, learns: bool = True) -> dict:
    """8 steps on the user's data, evaluation every 4: the reward rises as on the shipped pattern task
    (the tiny model learns from random init; --chat-template off: a raw continuation), every step has
    its evaluate phase and scores on steps 3 and 7, every sample's reward is in rewards.jsonl, no
    held-out row is trained on, and the report finds the run complete. ``learns=False``: the same
    checks of a 2-step run at a quarter of the batch, evaluated after each step, but for the rise
    (a backend whose learning on this task is checked by its embedded-default run)."""
    data, rewards = write_task(tmp)
    run_dir = tmp / "run"
    steps, every, batch = (8, 4, []) if learns else (2, 1, ["--prompts-per-step", "4", "--group-size", "8"])
    prompts, group = (16, 8) if learns else (4, 8)
    t0 = time.monotonic()
    r = run_cli("mllm_rl.run", "--backend", backend, "--run-dir", str(run_dir), "--data", str(data),
                "--reward", f"{rewards}:score", "--chat-template", "off", "--steps", str(steps), "--eval-every",
                str(every), *batch, "--quiet", "--wandb", "disabled", "--checkpoint-every", "0", timeout=900)  # fmt: skip
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == ""  # --quiet: only errors
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    rewards_by_step = [m["reward_mean"] for m in metrics]
    assert len(rewards_by_step) == steps
    if learns:
        assert sum(rewards_by_step[-2:]) / 2 > sum(rewards_by_step[:2]) / 2 + 0.2, rewards_by_step
    scored = list(range(every - 1, steps, every))
    assert [m["step"] for m in metrics if "eval_reward_mean" in m] == scored

    plan = json.loads((run_dir / "run.json").read_text())
    assert plan["expected_step_phases"][-1] == "evaluate" and plan["reward"] == f"{rewards}:score"
    recs = read_jsonl(run_dir / "phases.jsonl")
    evals = [x for x in recs if x["phase"] == "evaluate"]
    assert [x["step"] for x in evals] == list(range(steps))
    assert [x["step"] for x in evals if x["info"]["evaluated"]] == scored
    assert all(x["info"]["prompts"] == 16 for x in evals if x["info"]["evaluated"])
    by_step = {m["step"]: m for m in metrics}
    for x in evals:
        if x["info"]["evaluated"]:
            assert x["info"]["reward_mean"] == by_step[x["step"]]["eval_reward_mean"]

    lines = read_jsonl(run_dir / "rewards.jsonl")
    rollout = [x for x in lines if x["phase"] == "rollout"]
    held = {x["row"] for x in lines if x["phase"] in ("evaluate", "generate_result")}
    assert len(rollout) == steps * prompts * group and len(held) == 16
    counts = [len([x for x in lines if x["phase"] == p]) for p in ("evaluate", "generate_result")]
    assert counts == [16 * len(scored), 16]
    assert not held & {x["row"] for x in rollout}  # the held-out rows are never trained on
    for s in range(steps):
        got = [x["reward"] for x in rollout if x["step"] == s]
        assert abs(float(np.mean(got)) - rewards_by_step[s]) < 1e-9

    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    bad = [i for i in summary["issues"] if i["severity"] in ("error", "warning")]
    assert bad == [], bad
    return {"seconds": round(took, 1), "reward_mean": rewards_by_step,
            "eval_reward_mean": [by_step[s]["eval_reward_mean"] for s in scored]}  # fmt: skip


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def bad_reward_is_a_clear_exit(backend: str, tmp: Path, name: str) -> None:
    """A reward that hangs (past --reward-timeout) or returns NaN: exit 1 within a bounded
    time, the last line naming the function and the sample (its row), the rollout phase recorded
    with the error, no traceback on the terminal, and no reward worker left running."""
    data, rewards = write_task(tmp, rows=20)
    run_dir, pid_file = tmp / "run", tmp / "worker.pid"
    t0 = time.monotonic()
    r = run_cli("mllm_rl.run", "--backend", backend, "--run-dir", str(run_dir), "--data", str(data),
                "--reward", f"{rewards}:{name}", "--reward-timeout", "3", "--steps", "2", "--prompts-per-step", "2",
                "--group-size", "2", "--max-new-tokens", "4", "--console", "off", "--wandb", "disabled",
                "--checkpoint-every", "0", env={"BYO_WORKER_PID": str(pid_file)}, timeout=600)  # fmt: skip
    assert time.monotonic() - t0 < 300
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: RewardError: reward {rewards}:{name}"), last
    assert FAILURES[name] in last and f"of step 0 ({data}:" in last, last
    rec = read_jsonl(run_dir / "phases.jsonl")[-1]
    assert rec["phase"] == "rollout" and rec["step"] == 0 and "RewardError" in rec["info"]["error"]
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def tasks_file_takes_a_dataset_and_a_reward_file(
    backend: str, tmp: Path, module: str = "mllm_rl.run"
) -> None:
    """A task of a --tasks file with the user's data, prompt column and reward file, all named
    relative to the TOML file (the run starts elsewhere): it runs to the end, every sample's reward
    is in its own ``tasks/<name>/rewards.jsonl`` and the step means are the metrics'. ``module``:
    what runs it (``tests.fake_run`` for the fake backend)."""
    d = tmp / "task"
    d.mkdir()
    data, _ = write_task(d, rows=40)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    (d / "q.jsonl").write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n"
                                       for r in rows))  # fmt: skip
    toml = d / "tasks.toml"
    toml.write_text('[[task]]\nname = "mine"\ntask_data = "q.jsonl"\nprompt_key = "question"\n'
                    'reward = "rewards.py:score"\nchat_template = "off"\nsteps = 2\nprompts_per_step = 4\n'
                    "group_size = 4\nmax_new_tokens = 4\neval_prompts = 4\ncheckpoint_every = 0\n")  # fmt: skip
    run_dir = tmp / "run"
    r = run_cli(module, "--backend", backend, "--tasks", str(toml), "--run-dir", str(run_dir),
                "--console", "off", "--wandb", "disabled", timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = read_jsonl(run_dir / "tasks" / "mine" / "rewards.jsonl")
    rollout = [x for x in lines if x["phase"] == "rollout"]
    assert len(rollout) == 2 * 4 * 4 and len([x for x in lines if x["phase"] == "generate_result"]) == 4
    metrics = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("task") == "mine"}
    for s in (0, 1):
        got = [x["reward"] for x in rollout if x["step"] == s]
        assert abs(float(np.mean(got)) - metrics[s]["reward_mean"]) < 1e-9
    recorded = json.loads((run_dir / "run.json").read_text())["task_options"]["mine"]
    assert recorded["reward"] == f"{d / 'rewards.py'}:score" and recorded["prompt_key"] == "question"
