"""The engine contract (tests/engine_contract.py) for every torch engine runnable here.

Each engine runs the driver in its own subprocess (as any engine may have to); the checks
compare its observations with Hugging Face transformers' Qwen3 on the same checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests import engine_contract as contract
from tests.conftest import ROOT

# (engine, platform): the embedded engine on CPU (storage release) and on CUDA (torch_memory_saver)
ENGINES = [("embedded", "cpu"), ("embedded", "cuda")]


def run_driver(ckpt, engine: str, platform: str = "auto") -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "tests/engine_contract.py"), "--backend", "torch",
                        "--engine", engine, "--platform", platform, str(ckpt)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module", params=ENGINES, ids=["-".join(e) for e in ENGINES])
def obs(request, tiny_ckpt):
    engine, platform = request.param
    if platform == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return run_driver(tiny_ckpt, engine, platform)


def test_swap_matches_the_reference_model(obs, hf_logits):
    assert obs["names_match"]
    assert obs["update"]["tensors"] == 25 and obs["update"]["bytes"] == obs["update"]["checkpoint_bytes"]
    contract.assert_greedy_matches_reference(obs["swap"], hf_logits, obs["eos"])


def test_release_frees_each_tag_by_the_probe(obs):
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
    assert len(obs["cycles"]) == contract.CYCLES
    assert all(c["tokens"] == obs["swap"]["tokens"] for c in obs["cycles"])


def test_stop_tokens(obs):
    contract.assert_stop_token(obs)


def test_seeded_sampling_is_reproducible(obs):
    contract.assert_seeded_sampling_reproducible(obs)


def test_logprobs_are_the_reference_log_softmax_at_the_sampled_tokens(obs, hf_logits):
    for out in (*obs["sampled"], obs["sampled_other_seed"]):
        contract.assert_sampled_logprobs_match_reference(out, hf_logits, contract.SAMPLED.temperature)


def test_sglang_engine_contract(tiny_ckpt, hf_logits):
    """Every check above on the SGLang adapter (CUDA, sglang installed)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not importable here (needs CUDA); the adapter was written from its source, not run")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    o = run_driver(tiny_ckpt, "sglang", "cuda")
    for name, check in sorted(globals().items()):
        if name.startswith("test_") and name != "test_sglang_engine_contract":
            args = {"obs": o, "hf_logits": hf_logits}
            check(*(args[p] for p in check.__code__.co_varnames[: check.__code__.co_argcount]))
