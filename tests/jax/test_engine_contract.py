"""The engine contract (tests/engine_contract.py) on the sglang-jax adapter, JAX CPU.

The driver runs in its own process (an sglang-jax engine must not live in pytest's); the
checks compare its observations with our flax nnx Qwen3 on the same checkpoint, an
implementation independent of sglang-jax's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tests import engine_contract as contract
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def obs(tiny_ckpt):
    r = subprocess.run([sys.executable, str(ROOT / "tests/engine_contract.py"), "--backend", "jax", str(tiny_ckpt)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module")
def flax_logits(tiny_ckpt):
    """``logits_fn(token_ids) -> [T, V]`` float32 from ``backends/jax/model.py``."""
    from flax import nnx

    from mllm_rl.backends.jax.model import load_qwen3
    from mllm_rl.checkpoint import ModelDir

    model = load_qwen3(ModelDir.open(tiny_ckpt))
    fwd = nnx.jit(lambda m, x: m(x))
    return lambda ids: np.asarray(fwd(model, jnp.asarray([ids], jnp.int32))[0], np.float32)


def test_swap_matches_the_reference_model(obs, flax_logits):
    assert obs["names_match"] and obs["update"]["tensors"] == 25
    contract.assert_greedy_matches_reference(obs["swap"], flax_logits, obs["eos"])


def test_release_frees_each_tag(obs):
    contract.assert_release_frees(obs)


def test_state_machine_refusals(obs):
    contract.assert_state_machine(obs)


def test_resume_without_backup_needs_a_full_update(obs):
    assert obs["after_full_sync"]["tokens"] == obs["swap"]["tokens"]


def test_resume_with_backup_is_identical(obs):
    assert obs["backup_weights_valid"] is True
    assert obs["after_backup_resume"] == obs["backup_reference"]
    assert obs["backup_reference"]["tokens"] == obs["swap"]["tokens"]


def test_drain_with_requests_in_flight_loses_none(obs):
    contract.assert_drain_lost_nothing(obs)


def test_three_release_resume_update_cycles_keep_greedy_output(obs):
    """Step 2+ is where offload bugs show: an unchecked flush left stale prefixes (fixed)."""
    assert len(obs["cycles"]) == contract.CYCLES
    assert all(c["tokens"] == obs["swap"]["tokens"] for c in obs["cycles"])


def test_stop_tokens(obs):
    contract.assert_stop_token(obs)


def test_seeded_sampling_is_reproducible(obs):
    contract.assert_seeded_sampling_reproducible(obs)


def test_logprobs_are_the_reference_log_softmax_at_the_sampled_tokens(obs, flax_logits):
    for out in (*obs["sampled"], obs["sampled_other_seed"]):
        contract.assert_sampled_logprobs_match_reference(out, flax_logits, contract.SAMPLED.temperature)

