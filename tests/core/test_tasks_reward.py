"""Bring your own task, the reward side: a function by import path, run in a worker process; a call
that raises, hangs, crashes its worker or returns NaN is one line naming the function and the sample,
within its timeout, and leaves no process behind; a bad import path is refused before anything runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mllm_rl.tasks import get_task
from mllm_rl.tasks.reward import RewardError, RewardRunner, check_reward

REWARDS = """
import math, os, time

def length(prompt, completion, row):
    return len(completion) / 10

def raises(prompt, completion, row):
    if completion == "boom":
        return 1 / 0
    return 0.5

def hangs(prompt, completion, row):
    if completion == "hang":
        time.sleep(600)
    return 1.0

def nan(prompt, completion, row):
    return math.nan if completion == "nan" else 1.0

def inf(prompt, completion, row):
    return -math.inf

def text(prompt, completion, row):
    return "good"

def crash(prompt, completion, row):
    if completion == "crash":
        os._exit(3)
    return 1

def segfault(prompt, completion, row):
    os.kill(os.getpid(), 11)

def killed(prompt, completion, row):
    os.kill(os.getpid(), 9)

def uses_row(prompt, completion, row):
    return float(row["answer"] == completion) + (prompt == "p1")

def noisy(prompt, completion, row):
    print("a line a reward printed")
    return True

def batch(prompts, completions, rows):
    return [len(c) for c in completions]
batch.batched = True

def short_batch(prompts, completions, rows):
    return [1.0]
short_batch.batched = True

def two(prompt, completion):
    return 1

NOT_A_FUNCTION = 3
"""


@pytest.fixture(scope="module")
def rewards_py(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def score(spec: str, completions: list[str], timeout: float = 10.0, rows=None):
    r = RewardRunner(spec, timeout)
    try:
        n = len(completions)
        rows = rows or [{"answer": "b"}] * n
        return r.score([f"p{i}" for i in range(n)], completions, rows, lambda i: f"sample {i} of step 0")
    finally:
        r.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_reward_by_file_path_scores_each_sample_and_gets_prompt_completion_and_row(rewards_py):
    assert score(f"{rewards_py}:length", ["a", "bb", "ccc"]).tolist() == [0.1, 0.2, 0.3]
    assert score(f"{rewards_py}:uses_row", ["a", "b", "b"]).tolist() == [0.0, 2.0, 1.0]
    assert score(f"{rewards_py}:batch", ["a", "bb"]).tolist() == [1.0, 2.0]
    assert score(f"{rewards_py}:noisy", ["x"]).tolist() == [1.0]  # a print goes to stderr, not the pipe


def test_a_reward_by_module_path(rewards_py, monkeypatch):
    monkeypatch.chdir(rewards_py.parent)  # the worker imports from the run's working directory
    assert score("my_rewards:length", ["abcd"]).tolist() == [0.4]
    assert score("mllm_rl.tasks.pattern:reward", ["ab"], rows=[{"answer": "abcd"}]).tolist() == [0.5]


@pytest.mark.parametrize(
    "name,completions,message",
    [
        ("raises", ["ok", "boom"], "raised ZeroDivisionError: division by zero (my_rewards.py:9) on sample 1 of step 0"),
        ("nan", ["ok", "ok", "nan"], "returned nan on sample 2 of step 0: rewards must be finite numbers"),
        ("inf", ["ok"], "returned -inf on sample 0 of step 0: rewards must be finite numbers"),
        ("text", ["ok"], "returned 'good' (str), not a number on sample 0 of step 0"),
        ("crash", ["ok", "crash"], ": the reward worker died (exit status 3) on sample 1 of step 0"),
        ("segfault", ["ok"], ": the reward worker died (killed by signal 11) on sample 0 of step 0"),
        ("short_batch", ["a", "b"], "raised returned 1 values for 2 samples for the batch of 2 samples"),
    ],
)  # fmt: skip
def test_a_failing_reward_is_one_line_naming_the_function_and_the_sample(
    rewards_py, name, completions, message
):
    with pytest.raises(RewardError) as e:
        score(f"{rewards_py}:{name}", completions)
    text = str(e.value)
    assert text.startswith(f"reward {rewards_py}:{name}") and message in text and "\n" not in text, text


@pytest.mark.parametrize("reaper", [False, True], ids=["plain", "sigchld-reaper"])
@pytest.mark.parametrize(
    "name,how",
    [("crash", "exit status 3"), ("killed", "killed by signal 9"), ("segfault", "killed by signal 11")],
)
def test_how_the_worker_died_is_named_even_when_a_sigchld_handler_reaps_children(
    rewards_py, reaper, name, how
):
    """sglang-jax (a JAX run) installs a SIGCHLD handler that reaps the run's children as they
    exit, so the run's own wait on the worker gets no status: the exit status or the signal is
    still the one the reward's process died of."""

    def reap(signum, frame):
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass

    before = signal.signal(signal.SIGCHLD, reap) if reaper else None
    try:
        with pytest.raises(RewardError) as e:
            score(f"{rewards_py}:{name}", ["ok", "crash"])
    finally:
        if reaper:
            signal.signal(signal.SIGCHLD, before)
    assert (
        str(e.value)
        == f"reward {rewards_py}:{name}: the reward worker died ({how}) on sample {int(name == 'crash')} of step 0"
    )


def test_a_hanging_reward_is_stopped_at_its_timeout_and_its_worker_killed(rewards_py):
    r = RewardRunner(f"{rewards_py}:hangs", timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(RewardError) as e:
        r.score(["p"] * 3, ["ok", "hang", "ok"], [{}] * 3, lambda i: f"sample {i} of step 4")
    assert time.monotonic() - t0 < 10
    assert str(e.value) == (f"reward {rewards_py}:hangs: no result within 1 s (--reward-timeout) on sample 1 "
                            f"of step 4; worker stopped")  # fmt: skip
    assert r.proc is None
    # the runner starts a fresh worker on its next call
    assert r.score(["p"], ["ok"], [{}], str).tolist() == [1.0]
    pid = r.proc.pid
    r.close()
    assert not alive(pid)


def test_the_worker_dies_with_the_run(rewards_py, tmp_path):
    """A run killed with SIGKILL (no cleanup at all) while its reward hangs leaves no worker behind."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from mllm_rl.tasks.reward import RewardRunner
        r = RewardRunner({str(rewards_py) + ":hangs"!r}, timeout=600)
        r.start()
        print(r.proc.pid, flush=True)
        r.score(["p"], ["hang"], [{{}}], str)
    """)
    )
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = int(p.stdout.readline())
    assert alive(worker)
    time.sleep(0.5)  # the worker is inside the reward call
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker)


def test_a_worker_that_ends_with_the_run_prints_nothing(rewards_py, tmp_path):
    """The worker's keeper (which reports how it died) has nothing to say when the run closes the
    worker: the run's stderr stays clean, after a normal close and after a timeout's kill."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        from mllm_rl.tasks.reward import RewardError, RewardRunner
        for name, completion in (("length", "ab"), ("hangs", "hang")):
            r = RewardRunner({str(rewards_py)!r} + ":" + name, timeout=1)
            try:
                print(r.score(["p"], [completion], [{{}}], str).tolist())
            except RewardError as e:
                print("timeout" if "no result within" in str(e) else e)
            finally:
                r.close()
    """)
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["[0.2]", "timeout"] and r.stderr == "", r.stderr


@pytest.mark.parametrize(
    "spec,message",
    [
        ("{py}:two", "{spec}: two(prompt, completion) cannot be called as (prompt, completion, row); a batched function sets .batched = True"),
        ("{py}:nope", "{spec}: {py} has no attribute 'nope'"),
        ("{py}:NOT_A_FUNCTION", "{spec}: {spec} is a int, not a function"),
        ("{dir}/missing.py:f", "{spec}: {dir}/missing.py: no such file"),
        ("no_such_module_xyz:f", "{spec}: No module named 'no_such_module_xyz'"),
        ("json:dumps", "{spec}: dumps(obj, *, skipkeys=False, ensure_ascii=True, check_circula...) cannot be called as (prompt, completion, row); a batched function sets .batched = True"),
        ("mllm_rl.tasks.boxed:INSTRUCTION", "{spec}: {spec} is a str, not a function"),
        ("no-colon", "'no-colon': expected module:function or path/to/file.py:function (docs/TASKS.md)"),
    ],
)  # fmt: skip
def test_a_reward_that_cannot_be_loaded_is_refused_before_the_run(rewards_py, spec, message):
    spec = spec.format(py=rewards_py, dir=rewards_py.parent)
    with pytest.raises(ValueError) as e:
        check_reward(spec)
    assert str(e.value) == "--reward " + message.format(spec=spec, py=rewards_py, dir=rewards_py.parent)


def test_an_import_that_raises_is_refused_naming_the_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_dependency_xyz\n\ndef f(prompt, completion, row):\n    return 1\n")
    with pytest.raises(
        ValueError, match=r"bad\.py:f: importing .*bad\.py raised ModuleNotFoundError: No module named"
    ):
        check_reward(f"{bad}:f")
    assert check_reward("mllm_rl.tasks.boxed:reward") is False
    assert not (tmp_path / "__pycache__").exists()  # the worker writes no bytecode next to a reward file


def test_a_task_names_the_sample_by_its_row_and_prompt(rewards_py, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"prompt": "What is 6 x 7?", "answer": "42"}\n{"prompt": "Name a prime.", "answer": "2"}\n'
    )
    t = get_task(None, str(data), reward=f"{rewards_py}:raises")
    ex = [t.examples[1], t.examples[0]]
    try:
        assert isinstance(t.rewards(["a", "b"], ["x", "y"], ex, "step 2"), np.ndarray)
        with pytest.raises(RewardError) as e:
            t.rewards([e.prompt for e in ex], ["x", "boom"], ex, "step 2")
    finally:
        t.close()
    assert str(e.value).endswith(f"on sample 1 of step 2 ({data}:1, prompt 'What is 6 x 7?')")


def test_a_worker_killed_between_calls_is_named_on_the_next(rewards_py):
    r = RewardRunner(f"{rewards_py}:length", timeout=5)
    try:
        assert r.score(["p"], ["ab"], [{}], str).tolist() == [0.2]
        r.proc.kill()
        r.proc.wait()
        with pytest.raises(RewardError, match=r"length: the reward worker died \(killed by signal 9\)"):
            r.score(["p"], ["ab"], [{}], lambda i: f"sample {i} of step 1")
    finally:
        r.close()


def test_what_counts_as_a_reward():
    from mllm_rl.tasks.reward_worker import as_number

    for v, want in [(1, 1.0), (0.25, 0.25), (True, 1.0), (np.float32(0.5), 0.5), (np.int64(2), 2.0),
                    (np.bool_(True), 1.0), (np.array(3.0), 3.0)]:  # fmt: skip
        assert as_number(v) == (want, ""), v
    for v, why in [(float("nan"), "returned nan"), (np.float32("inf"), "returned inf"),
                   (None, "returned None (NoneType), not a number"), ("1", "returned '1' (str), not a number"),
                   (np.array([1.0]), "returned array([1.]) (ndarray), not a number")]:  # fmt: skip
        assert as_number(v) == (None, why), v
