"""Shared checks of whole RL runs that both backends must pass (``python -m mllm_rl.run`` in a
subprocess of the test's venv; the JAX and the torch test files call these with their backend)."""

from __future__ import annotations

import json
from pathlib import Path

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

SMALL = ["--steps", "1", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "6",
         "--max-running-requests", "16", "--checkpoint-every", "0", "--console", "off", "--wandb", "disabled"]  # fmt: skip


def check_temperature_consistent(backend: str, model: Path, temperature: float, run_dir: Path) -> dict:
    """A run sampling at ``temperature`` whose trainer recomputes the old log-probs: at step 0 (no
    update yet) the trainer's log-probs of the sampled tokens equal the engine's to float32 noise,
    so the engine-vs-trainer ratio is 1 within 1e-3. Before the trainer divided its logits by the
    temperature, ``engine_ratio_mean`` was 0.889 (JAX) / 0.981 (torch) at 0.7. The samples of a
    group reused their prompt's computation (``prompt_tokens_cached``): the log-probs checked are
    of the shared prefill. Returns step 0's metrics."""
    r = run_cli("mllm_rl.run", "--backend", backend, "--model", str(model), "--run-dir", str(run_dir),
                "--temperature", str(temperature), "--old-logp", "trainer", *SMALL, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    m0 = read_jsonl(run_dir / "metrics.jsonl")[0]
    assert m0["step"] == 0 and m0["tokens"] > 0
    assert abs(m0["engine_ratio_mean"] - 1.0) < 1e-3, m0
    assert m0["logp_mismatch_mean"] < 1e-4 and m0["logp_mismatch_max"] < 2e-3, m0
    assert abs(m0["ratio_mean"] - 1.0) < 1e-3, m0
    assert m0["prompt_tokens_cached"] > 0, m0
    return m0


def check_bf16_checkpoint_learns_at_fine_tuning_lr(backend: str, json_out: Path, seed: int = 0) -> dict:
    """``python -m mllm_rl.bench precision`` on the ``tiny`` preset written in bf16, lr 1e-6: with mixed
    precision (the default) >= 90% of the master weights change between the last two steps'
    checkpoints; with ``--precision pure`` (bf16 params and moments) under 10% do (measured before
    mixed precision existed: 0 after the first step, 2-3% after the second). ``seed``: one whose
    16 samples per step earn a reward at all (a group of equal rewards has no gradient)."""
    import importlib

    bench = importlib.import_module("mllm_rl.bench.precision")
    code = bench.main(["--backend", backend, "--steps", "3", "--json", str(json_out), "--",
                       "--prompts-per-step", "4", "--group-size", "4", "--seed", str(seed)])  # fmt: skip
    assert code == 0
    out = json.loads(json_out.read_text())
    mixed, pure = out["runs"]["mixed"], out["runs"]["pure"]
    assert any(m["groups_zero_std"] < 1 for m in mixed["per_step"])  # there was a gradient
    assert mixed["changed"][-1] >= 0.9, mixed["changed"]
    assert pure["changed"][-1] < 0.1, pure["changed"]
    return out
