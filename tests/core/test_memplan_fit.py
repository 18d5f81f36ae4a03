"""The memory plan's core beyond composition: setup rows, --fit search and KV room, the KV pool
refit and the mem_fraction_static it needs, planner lookup, the CLI's bad-input exits, the
validation against phase records, and the HTML page. Pure: no jax, no compiler."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from mllm_rl.lifecycle import SETUP_PHASES, STEP_PHASES
from mllm_rl.memplan.audit import compare
from mllm_rl.memplan.compose import GIB, Component, FunctionMemory, Target, compose, unit_for
from mllm_rl.memplan.kv import max_pool_tokens, mem_fraction_for, pool_bytes
from mllm_rl.memplan.output import to_html
from mllm_rl.memplan.planner import (
    Probe,
    fits_without_kv,
    kv_room,
    load_planner,
    plans,
    search,
    with_kv_tokens,
)
from mllm_rl.memplan.request import Measured, PlanRequest
from mllm_rl.presets import get_preset
from tests.conftest import run_cli

TARGET = Target("t", "tpu", 4, 1, 10 * GIB, "fake device", "test")
MIB = 2**20


def measured(kv_tokens: int = 1000, cell: int = MIB, **extra_gib: float) -> Measured:
    gib = {"engine_weights": 1, "trainer_params": 1, "optimizer": 2, "grads": 1, "staging": 0.25}
    gib.update(extra_gib)
    comps = {k: Component(k, int(v * GIB), "layout") for k, v in gib.items()}
    comps["kv_pool"] = Component("kv_pool", pool_bytes(kv_tokens, cell, 1), "layout")
    fns = {"grad_step": FunctionMemory("grad_step", peak_bytes=3 * GIB, argument_bytes=1 * GIB)}
    info = {"kv_cell_bytes": cell, "kv_pad_tokens": 1, "kv_tokens": kv_tokens, "engine_free_bytes": 10 * GIB}
    return Measured(TARGET, comps, fns, [], info)


def request(**kw) -> PlanRequest:
    return PlanRequest(backend="jax", target="t", model=get_preset("tiny"), **kw)


def test_setup_rows_come_first_and_hold_no_engine_logits():
    m = measured(engine_logits=0.5)
    plan = compose(TARGET, "multi_stage", STEP_PHASES["multi_stage"], m.components, m.functions,
                   setup=SETUP_PHASES)  # fmt: skip
    names = [p.phase for p in plan.phases]
    assert names[: len(SETUP_PHASES)] == ["setup:" + p for p in SETUP_PHASES]
    assert names[len(SETUP_PHASES) :] == STEP_PHASES["multi_stage"]
    for p in plan.phases:
        assert ("engine_logits" in p.resident) == (not p.phase.startswith("setup:")), p.phase
    by = {p.phase: p for p in plan.phases}
    # the setup trains nothing: trainer_init holds params + optimizer only
    assert set(by["setup:trainer_init"].resident) == {"trainer_params", "optimizer"}
    assert by["setup:weights_swapped"].resident.keys() >= {"engine_weights", "trainer_params", "staging"}


def test_search_doubles_then_bisects_and_reports_each_probe():
    seen = []
    best, probes = search(lambda v: Probe(v, v <= 37, ""), start=4, step=1, cap=256, on_probe=seen.append)
    assert best == 37
    values = [p.value for p in probes]
    assert values[:5] == [4, 8, 16, 32, 64]  # doubling until the first miss
    assert len(values) <= 5 + 6 and seen == probes  # then bisection between 32 and 64
    best, _ = search(lambda v: Probe(v, v <= 3, ""), start=16, step=1, cap=256, on_probe=lambda p: None)
    assert best == 3  # a start that misses goes down
    best, _ = search(lambda v: Probe(v, False, ""), start=4, step=1, cap=256, on_probe=lambda p: None)
    assert best is None
    best, _ = search(
        lambda v: Probe(v, v <= 5000, ""), start=1024, step=1024, cap=131072, on_probe=lambda p: None
    )
    assert best == 4096  # the granularity holds
    best, _ = search(lambda v: Probe(v, True, ""), start=4, step=1, cap=20, on_probe=lambda p: None)
    assert best == 20


def test_kv_room_is_set_by_the_tightest_phase_of_the_schedule():
    m = measured()
    req = request()
    ms, naive = plans(m, req)["multi_stage"], plans(m, req)["naive"]
    budget = ms.budget
    # multi_stage: the pool sits next to engine weights (+ logits) only
    tokens, phase = kv_room(ms, m)
    assert tokens == max_pool_tokens(budget - GIB, MIB, 1)
    # naive: also next to trainer params and the staging buffer during the update
    tokens_n, phase_n = kv_room(naive, m)
    assert phase_n == "update_weights"
    assert tokens_n == max_pool_tokens(budget - int(1 * GIB) - int(1 * GIB) - int(0.25 * GIB), MIB, 1)
    assert tokens_n < tokens
    ok, why = fits_without_kv(ms)
    assert ok and "train_step" in why


def test_with_kv_tokens_resizes_the_pool_and_says_which_fraction_sglang_jax_needs():
    m = with_kv_tokens(measured(), 3000)
    assert m.components["kv_pool"].bytes_per_device == (3000 + 1) * MIB
    assert m.info["kv_tokens"] == 3000
    # sglang-jax gives the pool fraction * free - weights: (1 GiB + 3000 MiB) / 10 GiB, rounded up
    assert m.info["mem_fraction_static"] == mem_fraction_for(GIB, 3000 * MIB, 10 * GIB) == 0.393
    assert mem_fraction_for(1000, 1000, 4000) == 0.5


def test_a_fitted_pool_larger_than_the_one_the_engine_forward_read_gets_a_note():
    m = measured()
    m.info["engine_forward_pool_slots"] = 1000  # the compiled prefill read every slot of its pool
    assert with_kv_tokens(m, 1000).notes == []
    (note,) = with_kv_tokens(m, 3000).notes
    assert "reading 1000 KV slots" in note and "plan --kv-tokens 3000" in note
    assert m.notes == []  # the measurement it came from is unchanged


def test_the_audit_takes_allocated_minus_paused_where_torch_memory_saver_paused():
    from mllm_rl.memplan.audit import _device_bytes

    def rec(paused: int | None) -> dict:
        raw = {} if paused is None else {"paused_bytes": paused}
        devs = [
            {"id": 0, "source": "mem_get_info", "bytes_in_use": 10 * GIB, "raw": {}},
            {"id": 0, "source": "torch_allocator", "bytes_in_use": 8 * GIB, "raw": raw},
        ]
        return {"memory": {"devices": devs}}

    assert _device_bytes(rec(None)) == 10 * GIB  # no paused regions here: the driver's figure
    assert _device_bytes(rec(3 * GIB)) == 5 * GIB  # the allocator's count, less what is unmapped
    assert _device_bytes(rec(0)) == 8 * GIB


def test_fits_without_kv_names_the_phase_that_overflows():
    m = measured(optimizer=8)
    ok, why = fits_without_kv(plans(m, request())["multi_stage"])
    assert not ok and "train_step" in why


def test_unit_for():
    assert unit_for(GIB) == ("GiB", GIB) and unit_for(GIB - 1) == ("MiB", MIB)


def test_load_planner_errors_are_one_line():
    with pytest.raises(ValueError, match="not installed"):
        load_planner("tensorflow")


def test_html_page_has_a_bar_per_phase_and_the_verdict():
    m = measured(optimizer=8)
    ps = plans(m, request())
    doc = {"plans": {s: p.to_json() for s, p in ps.items()}, "summary": ["x"]}
    page = to_html(doc)
    assert page.count("<tr") >= 2 * len(ps["multi_stage"].phases)
    assert "DOES NOT FIT" in page and "train_step" in page


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--target", "v9-8"], "--target 'v9-8': unknown"),
        (["--model", "/nonexistent/model"], "neither a preset"),
        (["--backend", "mxnet"], "not installed"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
        (["--kl-beta", "nan"], "--kl-beta must be a finite number, got nan"),
        (["--fit-max", "0"], "--fit-max must be >= 1, got 0"),
        (["--trainer-tp", "3"], "--trainer-tp 3 does not divide the 4 devices of v4-8"),
        (["--model-option", "remat"], "expected KEY=VALUE"),
        (["--margin", "1.5"], "margin"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, msg):
    r = run_cli("mllm_rl.memplan", *args, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and msg in last, r.stderr


def test_compare_with_phase_records():
    """audit.compare on hand-written records: components and end-of-phase bytes."""
    m = measured(kv_tokens=100, engine_logits=0.0)
    doc = {"schedule": "multi_stage", "plans": {s: p.to_json() for s, p in plans(m, request()).items()}}
    comps = {k: v.bytes_per_device for k, v in m.components.items()}

    def rec(phase, step, used, **info):
        dev = {"id": 0, "bytes_in_use": used}
        return {"phase": phase, "step": step, "memory": {"devices": [dev], "host": {}}, "info": info}

    held = {"weights": comps["engine_weights"], "kv_cache": comps["kv_pool"]}
    state = {"params": comps["trainer_params"], "optimizer": comps["optimizer"]}
    records = [rec("release_rollout", None, 0, held=held), rec("trainer_init", None, 3 * GIB, state_bytes=state),
               rec("rollout", 0, comps["engine_weights"] + comps["kv_pool"]),
               rec("train_step", 0, int(3.3 * GIB))]  # fmt: skip
    out = compare(records, doc, tolerance=0.05)
    assert all(r["within"] for r in out["components"])
    rows = {r["phase"]: r for r in out["phases"]}
    assert rows["setup:trainer_init"]["within"] and rows["rollout"]["within"]
    assert not rows["train_step"]["within"]  # 3.3 GiB measured vs 3 GiB predicted at its end
    assert not out["within"]
    json.dumps(out)


def _late_release_case() -> tuple[dict, int, Callable[..., dict], list[dict]]:
    """A plan doc, the bytes at the end of train_step, a record maker and the setup's records."""
    m = measured(kv_tokens=100, engine_logits=0.0)
    doc = {"schedule": "multi_stage", "plans": {s: p.to_json() for s, p in plans(m, request()).items()}}
    comps = {k: v.bytes_per_device for k, v in m.components.items()}
    at_end = comps["trainer_params"] + comps["optimizer"]

    def rec(phase, step, used, **info):
        return {"phase": phase, "step": step, "memory": {"devices": [{"id": 0, "bytes_in_use": used}], "host": {}},
                "info": info}  # fmt: skip

    setup = [rec("release_rollout", None, 0, held={"weights": comps["engine_weights"], "kv_cache": comps["kv_pool"]}),
             rec("trainer_init", None, at_end, state_bytes={"params": comps["trainer_params"],
                                                            "optimizer": comps["optimizer"]})]  # fmt: skip
    return doc, at_end, rec, setup


def test_a_late_release_in_one_step_holds_and_in_two_steps_drifts():
    """A step's phase above the plan in one of the last two steps (an array released late) holds;
    above in both it is off (``audit.compare``) and a drift (``audit.drifts``)."""
    from mllm_rl.memplan.audit import drifts

    doc, at_end, rec, setup = _late_release_case()
    late = at_end + 512 * MIB
    one = compare([*setup, rec("train_step", 0, at_end), rec("train_step", 1, late)], doc, 0.05)
    row = next(r for r in one["phases"] if r["phase"] == "train_step")
    assert row["within"] and not row["within_last"] and row["measured_before"] == at_end
    assert drifts(one) == []
    two = compare([*setup, rec("train_step", 0, late), rec("train_step", 1, late)], doc, 0.05)
    assert not two["within"] and [r["phase"] for r in drifts(two)] == ["train_step"]


def test_a_run_dir_held_against_its_plan_json(tmp_path):
    """``check_run_dir``: no plan.json, nothing; a torn one, why not (a note of the report); a phase
    above the plan in both last steps: the report's warning, the console's line and a DRIFT row."""
    from types import SimpleNamespace

    from mllm_rl.memplan.audit import check_run_dir, summary, table
    from mllm_rl.report.analysis import plan_findings

    doc, at_end, rec, setup = _late_release_case()
    records = [*setup, rec("train_step", 0, at_end + 512 * MIB), rec("train_step", 1, at_end + 512 * MIB)]
    run = SimpleNamespace(dir=tmp_path, label="r", records={0: records})
    assert check_run_dir(tmp_path, records) == (None, None) and plan_findings(run) == ([], None)
    (tmp_path / "plan.json").write_text("{")
    (note,), check = plan_findings(run)
    assert check is None and (note.kind, note.severity) == ("plan_audit", "info")
    assert note.message.startswith(f"{tmp_path / 'plan.json'} not compared with the records: ")
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    (warning,), check = plan_findings(run)
    assert check["target"] == "t" and (warning.kind, warning.severity, warning.process) == (
        "plan_drift",
        "warning",
        0,
    )
    row = next(r for r in check["phases"] if r["phase"] == "train_step")
    assert warning.message == (
        f"train_step: {row['measured'] / MIB:.1f} MiB in use at its end, the plan predicted "
        f"{row['predicted'] / MIB:.1f} MiB ({', '.join(row['resident_at_end']) or 'nothing'} resident): memory "
        "the plan does not know of (a leak if it grows step by step)"
    )
    assert summary(check).startswith(
        f"memory plan: 1 of {len(check['phases'])} phases ended above the prediction by more than 5%; "
        f"worst train_step: {row['measured'] / MIB:.1f} MiB in use"
    )
    lines = table(check).splitlines()
    assert lines[0].startswith("Memory plan vs run") and len(lines) == 3 + len(check["phases"])
    assert [ln.split()[0] for ln in lines[3:] if ln.rstrip().endswith("DRIFT")] == ["train_step"]
