"""A reward that kills its worker, in a JAX run: sglang-jax's engine installs a SIGCHLD handler in
the run's process that reaps its children as they exit (the reward worker's process included),
and the run's last line still names the exit status or the signal the worker died of."""

from __future__ import annotations

import pytest

from tests.byo_task import write_task
from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # each test starts an engine

DIES = """

def exits(prompt, completion, row):
    os._exit(3)


def killed(prompt, completion, row):
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("name,how", [("exits", "exit status 3"), ("killed", "killed by signal 9")])
def test_a_reward_that_kills_its_worker_is_named_with_its_status(tmp_path, name, how):
    data, rewards = write_task(tmp_path, rows=20)
    rewards.write_text(rewards.read_text() + DIES)
    r = run_cli("mllm_rl.run", "--backend", "jax", "--run-dir", str(tmp_path / "run"), "--data", str(data),
                "--reward", f"{rewards}:{name}", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                "--max-new-tokens", "4", "--console", "off", "--wandb", "disabled", "--checkpoint-every", "0",
                env={"JAX_PLATFORMS": "cpu"}, timeout=600)  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: RewardError: reward {rewards}:{name}: the reward worker died ({how}) "
                           f"on sample 0 of step 0 ({data}:"), last  # fmt: skip
