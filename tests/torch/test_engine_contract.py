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

pytestmark = pytest.mark.slow  # every test here starts an engine (or waits on one that did)

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


@pytest.fixture(scope="module")
def ref_logits(hf_logits):
    return hf_logits


# The shared contract checks, collected here against the fixtures above.
globals().update(contract.CONTRACT_TESTS)


def test_sglang_engine_contract(tiny_ckpt, hf_logits):
    """Every check above on the SGLang adapter (CUDA, sglang installed)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(
            "sglang is not importable here (needs CUDA); the adapter was written from its source, not run"
        )
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    o = run_driver(tiny_ckpt, "sglang", "cuda")
    for check in contract.CONTRACT_TESTS.values():
        args = {"obs": o, "ref_logits": hf_logits}
        check(*(args[p] for p in check.__code__.co_varnames[: check.__code__.co_argcount]))


def test_the_embedded_engine_computes_a_groups_prompt_once(obs):
    """The first sample of a group computes its prompt; the others copy its K/V and last logits
    (``EmbeddedEngine._prefill``) and say so in ``cached_tokens``; a batch of distinct prompts
    copies nothing."""
    n = contract.GROUP
    want = [0 if k == 0 else len(p) for p in contract.GROUP_PROMPTS for k in range(n)]
    assert obs["grouped"]["cached"] == want
    assert obs["swap"]["cached"] == [0] * len(contract.PROMPTS)
