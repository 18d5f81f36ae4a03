"""torchrun's variables, read by the torch backend before anything starts: a bad or partial setting
is one line naming the variable (``backends/torch/distributed.py``; no torch import needed)."""

from __future__ import annotations

import pytest

from mllm_rl.backends.torch.distributed import Procs, config_from_env

GOOD = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_one_process_without_the_variables():
    assert config_from_env({}) == Procs() and config_from_env({"WORLD_SIZE": "1"}) == Procs()


def test_the_process_from_torchruns_variables():
    assert config_from_env(GOOD) == Procs(1, 2, 1)
    assert config_from_env({k: v for k, v in GOOD.items() if k != "LOCAL_RANK"}) == Procs(1, 2, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"RANK": None}, "RANK is not set (WORLD_SIZE=2"), ({"RANK": "2"}, "RANK=2: must be < WORLD_SIZE=2"),
     ({"RANK": "x"}, "RANK='x': expected an integer"), ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
     ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': must be >= 1")],
)  # fmt: skip
def test_a_bad_setting_names_the_variable(change, message):
    env = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        config_from_env(env)
    assert message in str(e.value) and "\n" not in str(e.value)
