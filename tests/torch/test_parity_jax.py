"""Parity (b): the JAX backend (sglang-jax, .venv-jax) and the torch backend (.venv-torch) swap
the same checkpoint; their ``generate_result`` phases must agree: identical greedy token ids,
logprobs within 1e-3 (seen: ~3e-6). Each backend runs in its own venv and process."""

from __future__ import annotations

import pytest

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT
from tests.torch.test_swap_run import swap_run

pytestmark = pytest.mark.slow  # every test here starts an engine (or waits on one that did)

JAX_PY = ROOT / ".venv-jax" / "bin" / "python"


def test_jax_and_torch_generate_the_same_tokens(tiny_ckpt, tmp_path):
    import os
    import subprocess

    if not JAX_PY.exists():
        pytest.skip(f"{JAX_PY} does not exist (make venv-jax)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    jax = subprocess.run([str(JAX_PY), "-m", "mllm_rl.run", "--backend", "jax", "--plan", "swap", "--model",
                          str(tiny_ckpt), "--run-dir", str(tmp_path / "jax"), "--max-new-tokens", "12",
                          "--wandb", "disabled", "--quiet"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)  # fmt: skip
    assert jax.returncode == 0, jax.stderr[-3000:]
    r = swap_run(tmp_path / "torch", tiny_ckpt, "--max-new-tokens", "12", "--wandb", "disabled")
    assert r.returncode == 0, r.stderr[-3000:]
    a = read_jsonl(tmp_path / "jax" / "phases.jsonl")[-1]
    b = read_jsonl(tmp_path / "torch" / "phases.jsonl")[-1]
    assert a["phase"] == b["phase"] == "generate_result"
    assert a["info"]["prompt_ids"] == b["info"]["prompt_ids"]
    assert a["info"]["token_ids"] == b["info"]["token_ids"]
    assert all(len(t) == 12 or t[-1] == 256 for t in b["info"]["token_ids"])
    for la, lb in zip(a["info"]["logprobs"], b["info"]["logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-3
    assert [x["phase"] for x in read_jsonl(tmp_path / "torch" / "phases.jsonl")][1] == "torch_ready"
