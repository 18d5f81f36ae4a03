"""Completeness check of the report: missing trace points are errors, resumed attempts are judged apart."""

from __future__ import annotations

from mllm_rl.report import build_report
from mllm_rl.report.checks import MISSING, OUT_OF_ORDER, check_sequence
from mllm_rl.report.issues import ERROR, WARNING, Issue, group_issues, int_ranges
from mllm_rl.report.load import split_records
from tests.core.report_fixtures import STEP, read_lines, write_lines, write_rl_run


def errors(result):
    return [i for i in result.issues if i.severity == "error"]


def test_clean_multi_process_rl_run_has_no_finding(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=2, steps=3)
    result = build_report([run])
    assert [i.line() for i in result.issues] == []
    assert result.exit_code == 0
    an = result.analyses[0]
    assert an.expected.source == "run.json" and an.expected.steps == [0, 1, 2]
    assert sorted(an.attempts) == [0, 1]
    assert len(an.phases) == 2 * (3 + 3 * len(STEP) + 1)


def test_dropped_phase_is_an_error_naming_process_step_phase(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=2, steps=3, drop={(1, 1, "train_step")})
    result = build_report([run])
    (err,) = errors(result)
    assert (err.kind, err.process, err.step, err.phase) == ("missing_phase", 1, 1, "train_step")
    assert "process 1 step 1: missing phase train_step" in err.line()
    assert result.exit_code == 1


def test_second_empty_cache_of_a_step_counts(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=2, drop={(0, 0, "empty_cache", 1)})
    (err,) = errors(build_report([run]))
    assert (err.process, err.step, err.phase) == (0, 0, "empty_cache")
    assert "1 of 2 missing" in err.message


def test_dropped_setup_phase_and_last_phase_of_a_middle_step(tmp_path):
    run = write_rl_run(
        tmp_path / "run", processes=2, steps=3, drop={(0, None, "jax_ready"), (1, 0, "continue_generation")}
    )
    found = {(i.kind, i.process, i.step, i.phase) for i in errors(build_report([run]))}
    assert found == {("missing_phase", 0, None, "jax_ready"), ("missing_phase", 1, 0, "continue_generation")}


def test_missing_process_file_is_an_error(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=2, steps=1)
    (run / "phases.p1.jsonl").unlink()
    (err,) = errors(build_report([run]))
    assert (err.kind, err.process) == ("missing_process", 1)
    (run / "phases.p1.jsonl").write_text("")
    (err,) = errors(build_report([run]))
    assert "phases.p1.jsonl is empty" in err.message


def test_failed_run_is_reported_not_refused(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=3, fail_in=(1, "train_step"))
    result = build_report([run])
    kinds = {(i.kind, i.step) for i in errors(result)}
    assert ("phase_error", 1) in kinds  # the record carries info.error
    assert ("incomplete_step", 1) in kinds  # stopped after train_step
    assert ("missing_step", 2) in kinds  # never reached
    assert all(p.exists() for p in result.files.values())


def test_resumed_run_interrupted_step_is_a_note(tmp_path):
    # attempt 1 killed after train_step of step 1; attempt 2 re-runs setup, then steps 1 and 2
    run = write_rl_run(tmp_path / "run", processes=2, steps=3, attempts=[(0, (1, "train_step")), (1, None)])
    result = build_report([run])
    assert errors(result) == []
    notes = [i for i in result.issues if i.kind == "interrupted"]
    assert {(i.process, i.attempt, i.step, i.phase) for i in notes} == {
        (0, 1, 1, "checkpoint"),
        (1, 1, 1, "checkpoint"),
    }
    assert all(i.severity == "info" and "re-run in attempt 2" in i.message for i in notes)
    assert [len(a) for a in result.analyses[0].attempts.values()] == [2, 2]


def test_resumed_run_with_continuing_idx(tmp_path):
    run = write_rl_run(
        tmp_path / "run", processes=1, steps=2, attempts=[(0, (0, "update_weights")), (0, None)]
    )
    path = run / "phases.jsonl"
    recs = read_lines(path)
    for i, r in enumerate(recs):  # a recorder that kept counting across the restart
        r["idx"] = i
    write_lines(path, recs)
    result = build_report([run])
    assert errors(result) == []
    assert len(result.analyses[0].attempts[0]) == 2
    assert any(i.kind == "interrupted" and i.step == 0 for i in result.issues)


def test_resume_that_skips_the_interrupted_step_is_an_error(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=3, attempts=[(0, (1, "train_step")), (2, None)])
    (err,) = errors(build_report([run]))
    assert (err.kind, err.attempt, err.step) == ("incomplete_step", 1, 1)
    assert "never re-run" in err.message


def test_resume_from_the_checkpoint_of_the_interrupted_step_is_a_note(tmp_path):
    # killed after step 1 saved its checkpoint: the next attempt restores it and starts at step 2
    run = write_rl_run(tmp_path / "run", processes=1, steps=3, attempts=[(0, (1, "checkpoint")), (2, None)])
    result = build_report([run])
    assert errors(result) == []
    (note,) = [i for i in result.issues if i.kind == "interrupted"]
    assert (note.attempt, note.step, note.severity) == (1, 1, "info")
    assert "after its checkpoint" in note.message and "attempt 2 resumed from it" in note.message


def _background_checkpoint(run, step: int, written_in: str | None = None, restored_in: int | None = None):
    """Rewrite the phase log: ``step``'s checkpoint begun in the background (not yet saved); its
    end recorded in ``written_in``'s info (same step) and/or restored by attempt ``restored_in``."""
    path = run / "phases.jsonl"
    recs, attempt = read_lines(path), 0
    for r in recs:
        if r["phase"] == "wandb_init" and r["step"] is None:
            attempt += 1
        if r["step"] == step and r["phase"] == "checkpoint" and attempt == 1:
            r["info"] = {"saved": False, "background": True, "path": f"ckpt/step_{step:06d}"}
        if r["step"] == step and r["phase"] == written_in and attempt == 1:
            r["info"]["written"] = [{"step": step, "path": f"ckpt/step_{step:06d}", "seconds": 1.0}]
        if r["phase"] == "engine_ready" and attempt == restored_in:
            r["info"]["restored_from"] = f"ckpt/step_{step:06d}"
            r["phase"] = "trainer_init"
    write_lines(path, recs)


def test_a_background_checkpoint_counts_once_recorded_written_or_restored(tmp_path):
    """Killed after step 1's checkpoint phase began a background write: the step is covered only
    if the write was recorded as ended, or the next attempt restored that checkpoint."""
    attempts = [(0, (1, "offload_optimizer")), (2, None)]
    lost = write_rl_run(tmp_path / "lost", processes=1, steps=3, attempts=attempts)
    _background_checkpoint(lost, 1)
    assert [(e.kind, e.step) for e in errors(build_report([lost]))] == [("incomplete_step", 1)]
    for name, kw in (("written", {"written_in": "offload_optimizer"}), ("restored", {"restored_in": 2})):
        run = write_rl_run(tmp_path / name, processes=1, steps=3, attempts=attempts)
        _background_checkpoint(run, 1, **kw)
        result = build_report([run])
        (note,) = [i for i in result.issues if i.kind == "interrupted"]
        assert (note.step, note.severity) == (1, "info") and "after its checkpoint" in note.message, name
        if name == "written":
            assert errors(result) == []


def test_resumed_attempt_is_still_checked(tmp_path):
    run = write_rl_run(
        tmp_path / "run",
        processes=1,
        steps=3,
        attempts=[(0, (1, "train_step")), (1, None)],
        drop={(0, 2, "resume_kv")},
    )
    (err,) = errors(build_report([run]))
    assert (err.kind, err.attempt, err.step, err.phase) == ("missing_phase", 2, 2, "resume_kv")


def test_killed_during_setup_then_resumed(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=2)
    path = run / "phases.jsonl"
    recs = read_lines(path)
    write_lines(path, recs[:2] + recs)  # attempt 1 died after jax_ready
    result = build_report([run])
    assert errors(result) == []
    (note,) = [i for i in result.issues if i.kind == "interrupted"]
    assert note.attempt == 1 and note.phase == "engine_ready"


def test_last_attempt_stopped_is_an_error(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=3, attempts=[(0, (1, "drain"))])
    found = {(i.kind, i.step, i.phase) for i in errors(build_report([run]))}
    assert found == {
        ("incomplete_step", 1, "release_rollout"),
        ("missing_step", 2, None),
        ("incomplete", None, "generate_result"),
    }


def test_inferred_expectations_without_run_json(tmp_path):
    run = write_rl_run(
        tmp_path / "run", processes=3, steps=2, with_run_json=False, drop={(2, 1, "resume_weights")}
    )
    result = build_report([run])
    assert result.analyses[0].expected.source == "inferred"
    (err,) = errors(result)
    assert (err.process, err.step, err.phase) == (2, 1, "resume_weights")


def test_out_of_order_phases(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=2)
    path = run / "phases.jsonl"
    recs = read_lines(path)
    i = next(k for k, r in enumerate(recs) if r["phase"] == "train_step" and r["step"] == 1)
    recs[i - 1], recs[i] = recs[i], recs[i - 1]  # train_step ran before onload_trainer
    for k, r in enumerate(recs):
        r["idx"] = k
    write_lines(path, recs)
    errs = errors(build_report([run]))
    assert errs and all(e.kind == "out_of_order" and e.step == 1 for e in errs)


def test_torn_last_line_is_a_warning(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=1)
    with open(run / "phases.jsonl", "a") as f:
        f.write('{"schema": "mllm_rl.phase/1", "run_')
    result = build_report([run])
    assert errors(result) == []
    assert [i.kind for i in result.issues] == ["torn_line"]


def test_check_sequence_tail_and_order():
    exp = ["a", "b", "c", "b"]
    found = check_sequence(["a", "b"], exp)
    assert [(f.kind, f.phase, f.tail) for f in found] == [(MISSING, "c", True), (MISSING, "b", True)]
    found = check_sequence(["a", "c", "b"], exp)
    assert [(f.kind, f.phase, f.tail) for f in found] == [(MISSING, "b", False)]
    found = check_sequence(["b", "a", "c", "b"], exp)
    assert [f.kind for f in found] == [OUT_OF_ORDER]


def test_split_records_on_first_phase_or_idx_restart():
    def r(phase, idx, step=None):
        return {"phase": phase, "idx": idx, "step": step}

    recs = [r("w", 0), r("x", 1), r("s", 2, 0), r("w", 3), r("x", 4), r("s", 5, 0), r("s", 0, 1)]
    parts = split_records(recs, "w")
    assert [[x["idx"] for x in p] for p in parts] == [[0, 1, 2], [3, 4, 5], [0]]


def test_group_issues_folds_same_finding_over_processes_attempts_and_steps():
    def mk(msg, sev=ERROR, **where):
        return Issue("r", "k", msg, sev, **where)

    issues = [mk("a", process=p, step=s) for p in (0, 1) for s in (0, 1, 2, 5)]
    issues += [mk("b", WARNING, process=0, attempt=1, step=1), mk("b", WARNING, process=0, attempt=2, step=4)]
    issues.append(mk("c", process=3, step=7))
    assert [i.line(where) for i, where in group_issues(issues)] == [
        "error: r 8x: processes 0-1 steps 0-2, 5: a",
        "error: r process 3 step 7: c",
        "warning: r 2x: process 0 attempt 1 step 1; process 0 attempt 2 step 4: b",
    ]
    assert int_ranges([0, 1, 2, 5, 7, 8]) == [(0, 2), (5, 5), (7, 8)]
