"""A run's own memory plan, the checks both backends' tests share (tests/{jax,torch}/test_memory_plan_run.py):
a tiny RL run, its report's plan drifts, a configuration that cannot fit, and ``--kv-tokens auto``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

SMALL = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
         "--max-running-requests", "4", "--checkpoint-every", "0", "--wandb", "disabled", "--console", "off"]  # fmt: skip


def run(backend: str, ckpt: Path, run_dir: Path, *extra: str, env: dict | None = None):
    return run_cli("mllm_rl.run", "--backend", backend, "--model", str(ckpt), "--run-dir", str(run_dir),
                   *SMALL, *extra, env=env, timeout=900)  # fmt: skip


def drift(run_dir: Path) -> list[dict]:
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    return [i for i in summary["issues"] if i["kind"] == "plan_drift"]


def check_a_pool_that_cannot_fit_exits_6_before_anything_exists(
    backend: str, ckpt: Path, tmp_path: Path
) -> None:
    r = run(backend, ckpt, tmp_path / "run", "--kv-tokens", "1000000000")
    assert r.returncode == 6, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: memory plan (cpu, predicted): multi_stage: DOES NOT FIT: kv_pool overflows in"
    )
    assert not (tmp_path / "run").exists()


def check_kv_tokens_auto_starts_the_engine_with_the_plans_pool(
    backend: str, ckpt: Path, tmp_path: Path
) -> None:
    # at the default margin: on CPU the plan's budget is a share of the RAM available now, and the
    # fitted pool is capped at what the run can hold at once (a larger CPU pool is never used and
    # every engine step pays for it: a 2.6M-token pool took 222 s for one rollout)
    r = run(backend, ckpt, tmp_path, "--kv-tokens", "auto", "--steps", "1")
    check_kv_tokens_auto_pool(r, tmp_path)


def check_kv_tokens_auto_pool(r: subprocess.CompletedProcess, run_dir: Path) -> None:
    """A finished ``--kv-tokens auto`` run in ``run_dir``: the plan's fitted pool is the one the
    engine started with, and the run said so."""
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    fit = plan["kv_fit"]
    tokens = fit["tokens"]
    assert 0 < tokens == fit["cap_tokens"] <= fit["room_tokens"]
    target = plan["plans"][plan["schedule"]]["target"]
    assert "available when planned" in target["source"] and target["hbm_bytes"] < target["host_ram_bytes"]
    (ready,) = [x for x in read_jsonl(run_dir / "phases.jsonl") if x["phase"] == "engine_ready_dummy"]
    assert ready["info"]["max_total_tokens"] == tokens
    assert f"--kv-tokens auto: a KV pool of {tokens} tokens (the run's requests x context" in r.stderr
