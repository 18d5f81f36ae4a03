"""Offload efficiency (bytes freed by device truth vs expected_freed_bytes) and the swap peak/steady ratio."""

from __future__ import annotations

import pytest

from mllm_rl.report import build_report
from tests.core.report_fixtures import OPT, K, MiB, P, W, write_rl_run, write_swap_run


def rows(result, phase, kind="free"):
    return [r for r in result.analyses[0].efficiency if r["phase"] == phase and r["kind"] == kind]


def test_release_that_frees_nothing_is_flagged(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=2, release_frees=0.0)
    result = build_report([run])
    rel = rows(result, "release_rollout")
    assert len(rel) == 2
    for r in rel:
        assert r["flagged"] and r["note"] == "freed nothing"
        assert r["actual_bytes"] == 0 and r["expected_bytes"] == 2 * (W + K)
    assert not any(r["flagged"] for r in result.analyses[0].efficiency if r["phase"] != "release_rollout")
    warn = [i for i in result.issues if i.kind == "release_efficiency"]
    assert [(i.severity, i.step, i.phase) for i in warn] == [
        ("warning", 0, "release_rollout"),
        ("warning", 1, "release_rollout"),
    ]
    assert result.exit_code == 0  # a warning, listed at the top, does not fail the check
    html = result.files["html"].read_text()
    assert html.count('<tr class="flag">') == 2


def test_partial_release_is_flagged_below_95_percent(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=1, devices=1, release_frees=0.8)
    (r,) = rows(build_report([run]), "release_rollout")
    assert r["ratio"] == pytest.approx(0.8, abs=1e-6) and r["flagged"]
    assert "80.0%" in r["note"]


def test_full_release_by_device_truth_below_the_allocator(tmp_path):
    # CUDA: engine memory lives below the torch allocator (torch_memory_saver). The driver
    # truth sees it freed; the allocator sees nothing: truth wins.
    run = write_rl_run(tmp_path / "run", processes=1, steps=1, kind="cuda", devices=2)
    result = build_report([run])
    (r,) = rows(result, "release_rollout")
    assert r["source"] == "mem_get_info"
    assert r["actual_bytes"] == 2 * (W + K) and r["ratio"] == pytest.approx(1.0)
    assert r["by_source"] == {"mem_get_info": 2 * (W + K), "torch_allocator": 0}
    assert not r["flagged"]
    (opt,) = rows(result, "offload_optimizer")
    assert opt["actual_bytes"] == 2 * OPT and opt["by_source"]["torch_allocator"] == 2 * OPT
    (onload,) = rows(result, "onload_trainer", "alloc")
    assert onload["actual_bytes"] == 2 * (P + OPT) and onload["expected_bytes"] == 2 * (P + OPT)


def test_sums_use_one_entry_per_device(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=1, kind="cuda", devices=2)
    result = build_report([run])
    row = next(r for r in result.analyses[0].phases if r["phase"] == "engine_ready")
    # truth = engine + allocator base + 1 MiB context per device; the allocator entries are not added on top
    assert row["after_bytes"] == 2 * (W + K + 8 * MiB + MiB)
    assert row["secondary"]["torch_allocator"]["after"] == 2 * 8 * MiB


def test_jax_cpu_live_arrays_and_unknown_values(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=1, kind="jax_cpu", devices=1)
    result = build_report([run])
    phases = {r["phase"]: r for r in result.analyses[0].phases if r["step"] is None}
    assert phases["wandb_init"]["after_bytes"] is None  # no probe yet: unknown, not 0
    assert phases["jax_ready"]["before_bytes"] is None and phases["jax_ready"]["after_bytes"] == 8 * MiB
    assert phases["jax_ready"]["source"] == "live_arrays"
    (r,) = rows(result, "release_rollout")
    assert r["actual_bytes"] == W + K and not r["flagged"]


def test_swap_ratio_is_peak_over_steady(tmp_path):
    run = write_swap_run(tmp_path / "run", swap_extra=16 * MiB, kind="tpu", devices=2)
    result = build_report([run])
    (s,) = result.analyses[0].swaps
    steady = W + K + 8 * MiB
    assert s["steady_max"] == steady and s["peak_max"] == steady + 16 * MiB
    assert s["ratio"] == pytest.approx((steady + 16 * MiB) / steady)
    assert s["weights_only_ratio"] == pytest.approx((W + 16 * MiB) / W)
    assert result.summary["swap_ratios"][0]["ratio"] == s["ratio"]
