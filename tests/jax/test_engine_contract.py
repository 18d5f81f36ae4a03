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

pytestmark = pytest.mark.slow  # every test here starts an engine (or waits on one that did)


@pytest.fixture(scope="module")
def obs(tiny_ckpt):
    r = subprocess.run([sys.executable, str(ROOT / "tests/engine_contract.py"), "--backend", "jax", str(tiny_ckpt)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module")
def ref_logits(tiny_ckpt):
    """``logits_fn(token_ids) -> [T, V]`` float32 from ``backends/jax/model.py``."""
    from flax import nnx

    from mllm_rl.backends.jax.model import load_qwen3
    from mllm_rl.checkpoint import ModelDir

    model = load_qwen3(ModelDir.open(tiny_ckpt))
    fwd = nnx.jit(lambda m, x: m(x))

    def logits(ids: list[int]) -> np.ndarray:
        # right-padded to a multiple of 64 positions: one compile per bucket, not per length (the
        # reference greedy re-forwards every prefix); causal, so the padding changes no real row
        padded = ids + [0] * (-len(ids) % 64)
        return np.asarray(fwd(model, jnp.asarray([padded], jnp.int32))[0, : len(ids)], np.float32)

    return logits


# The shared contract checks, collected here against the fixtures above.
globals().update(contract.CONTRACT_TESTS)


def test_a_groups_prompt_is_prefilled_once_and_its_samples_read_it_from_the_cache(obs):
    """sglang-jax computes each repeated prompt once (``SglangJaxEngine._send``): every
    request of a group finds all of its prompt but the last token in the radix cache (that one is
    computed again for its logits); right after an update (the cache flushed) nothing is cached."""
    want = [len(p) - 1 for p in contract.GROUP_PROMPTS for _ in range(contract.GROUP)]
    assert obs["grouped"]["cached"] == want
    assert obs["swap"]["cached"] == obs["after_full_sync"]["cached"] == [0] * len(contract.PROMPTS)


def test_drain_aborts_requests_still_queued(obs):
    """The drain caught some requests before their prefill (sglang-jax answers those "Abort before
    prefill", with no token): the case whose leftovers made sglang-jax's pause wait forever.
    ``pause_generation`` now returns (the contract above saw every request come back)."""
    d = obs["drain"]
    assert "error" not in d and d["returned"]
    finish_tokens = list(zip(d["outs"]["finish"], d["outs"]["tokens"], strict=True))
    assert any(why == "abort" and not toks for why, toks in finish_tokens), finish_tokens


def test_a_failed_scheduler_thread_fails_the_waiting_generate_at_once(obs):
    """sglang-jax's scheduler thread logs its error, SIGQUITs and ends; a ``generate`` waiting on it
    waited forever (a GPU rollout hung until killed). Now it fails within seconds naming the
    thread and its error (``engine_watch``), and the driver's process lives on to report it."""
    last = obs["last"]
    assert last["error"] and "sglang::scheduler" in last["error"], last
    assert "injected: the forward failed" in last["error"], last
    assert last["seconds"] < 10, last
