"""Bad input refused before any work, in one line naming the flag or the file: a flag of another
backend, ``--max-new-tokens`` past the model's context, a renamed loss aggregation, names too long
for the file system, an output path under a file, a run directory of other files, and a trainer
mesh that ``memplan`` would plan but the run refuses. Fast: parse and preflight level, no engine.
(``docs/ERRORS.md`` rows of the same refusals run end to end in ``test_cli_errors.py``.)"""

from __future__ import annotations

import importlib.metadata
import re
from types import SimpleNamespace

import pytest

from mllm_rl.options.check import NAME_MAX, check_output_dir, check_value
from mllm_rl.options.schema import BY_KEY
from mllm_rl.plans.preflight import RUN_ID_MAX, build_options, check_run_dir, check_run_id
from mllm_rl.run import check_mode, parse_args
from tests.conftest import run_cli


def _installed(dist: str) -> bool:
    """Not ``find_spec``: under pytest, ``tests/jax`` would pass for jax."""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


HAS_JAX = _installed("jax")


def refusal(argv: list[str]) -> str:
    """The one line ``check_mode`` refuses ``argv`` with (argparse's own errors: exit 2 too)."""
    args, given = parse_args(argv)
    with pytest.raises(ValueError) as e:
        check_mode(args, given)
    return str(e.value)


# -- 1. a flag only some backends take -----------------------------------------------------------
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_checkpoint_background_is_taken_on_both_backends(backend):
    args, given = parse_args(["--backend", backend, "--checkpoint-background"])
    check_mode(args, given)  # no refusal
    assert args.checkpoint_background is True


# -- 2. --max-new-tokens against the model's context ---------------------------------------------
def _opts(*flags: str):
    args, _ = parse_args(["--backend", "jax", *flags])
    return build_options(args)


@pytest.mark.parametrize("n", ["1023", "2000", "100000"])
def test_max_new_tokens_past_the_context_is_refused_naming_it(n, tmp_path):
    from mllm_rl.plans.rl import check_prompts

    model = SimpleNamespace(path=tmp_path, config=SimpleNamespace(max_position_embeddings=1024))
    with pytest.raises(ValueError) as e:
        check_prompts(_opts("--max-new-tokens", n), model)  # before the tokenizer is even loaded
    assert str(e.value) == (
        f"--max-new-tokens {n} does not fit the model's context length, 1024 tokens "
        f"({tmp_path / 'config.json'}: max_position_embeddings), with a prompt before it"
    )
    with pytest.raises(ValueError, match=rf"^--max-new-tokens {n} does not fit --context-length 512,"):
        check_prompts(_opts("--max-new-tokens", n, "--context-length", "512"), model)


def test_generated_prompts_are_checked_against_the_context_too(tiny_ckpt):
    """The pattern task's prompts (a few tokens) with a completion that just does not fit."""
    from mllm_rl.checkpoint.model_dir import ModelDir
    from mllm_rl.plans.rl import check_prompts

    model = ModelDir.open(tiny_ckpt, check_values=False)
    assert model.config.max_position_embeddings == 1024
    assert check_prompts(_opts("--max-new-tokens", "900"), model) == []
    with pytest.raises(
        ValueError, match=r"with --max-new-tokens 1020 it needs a context of \d+, and the run allows 1024"
    ):
        check_prompts(_opts("--max-new-tokens", "1020"), model)


# -- 3. the old aggregation name -------------------------------------------------------------------
def test_the_old_aggregation_name_is_refused_naming_the_new_one(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--backend", "jax", "--loss-agg", "seq_mean_token_sum_norm"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: argument --loss-agg: 'seq_mean_token_sum_norm' is called 'dr_grpo' now: pass --loss-agg dr_grpo"
    )
    # a tasks file's key: the same check of the same declaration
    with pytest.raises(ValueError, match=r"^loss_agg 'seq_mean_token_sum_norm' is called 'dr_grpo' now"):
        check_value(BY_KEY["loss_agg"], "seq_mean_token_sum_norm", "loss_agg")
    assert parse_args(["--backend", "jax", "--loss-agg", "dr_grpo"])[0].loss_agg == "dr_grpo"


# -- 4. names and paths ----------------------------------------------------------------------------
def test_a_run_id_too_long_is_refused_for_its_length():
    check_run_id("r" * RUN_ID_MAX)
    with pytest.raises(ValueError, match=rf"^--run-id 'r+'\.\.\.: 300 characters; at most {RUN_ID_MAX} "):
        check_run_id("r" * 300)
    with pytest.raises(ValueError, match="letters, digits"):  # a bad character is still named as such
        check_run_id("../x")
    # W&B's directory of process 9999: offline-run-<YYYYmmdd_HHMMSS>-<run id>-p9999
    assert len(f"offline-run-20250101_000000-{'r' * RUN_ID_MAX}-p9999") <= NAME_MAX


def test_a_name_too_long_is_one_line_naming_the_flag(tmp_path):
    long = tmp_path / ("n" * 300)
    with pytest.raises(ValueError, match=r"^--run-dir .*nnnn\.\.\.nnnnnnnn: a name of 300 bytes in it; a file name is at most 255 bytes$"):  # fmt: skip
        check_run_dir(long)
    with pytest.raises(ValueError, match=r"^--out .*a name of 300 bytes"):
        check_output_dir(long / "plan", "--out")
    assert list(tmp_path.iterdir()) == []


def test_an_output_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=rf"^--out {re.escape(str(tmp_path))}/f/m: is inside .*/f, a file, not a directory$"):  # fmt: skip
        check_output_dir(tmp_path / "f" / "m", "--out")
    assert check_output_dir(tmp_path / "new" / "deeper", "--out") == tmp_path


def test_checkpoint_make_out_under_a_file_writes_nothing(tmp_path):
    from mllm_rl.checkpoint import make_checkpoint
    from mllm_rl.presets import get_preset

    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"^--out .*/f/m: is inside .*/f, a file, not a directory$"):
        make_checkpoint(get_preset("tiny"), tmp_path / "f" / "m", show_progress=False)
    with pytest.raises(ValueError, match=r"^--out .*a name of 300 bytes"):
        make_checkpoint(get_preset("tiny"), tmp_path / ("n" * 300), show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_memplan_out_under_a_file_is_refused_before_any_planning(tmp_path, monkeypatch, capsys):
    import mllm_rl.memplan.planner
    from mllm_rl.memplan.__main__ import main

    def no_planning(*_: object) -> None:
        raise AssertionError("the planner was loaded before --out was checked")

    monkeypatch.setattr(mllm_rl.memplan.planner, "load_planner", no_planning)
    (tmp_path / "f").write_text("x")
    assert main(["--target", "cpu", "--model", "tiny", "--out", str(tmp_path / "f" / "plan")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out {tmp_path}/f/plan: is inside {tmp_path}/f, a file, not a directory"]


def test_a_directory_of_other_files_is_not_adopted_as_a_run_directory(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(
        ValueError, match=r"^--run-dir .*/other: holds files that are not a run's \(notes\.txt; "
    ):
        check_run_dir(other)
    with pytest.raises(
        ValueError, match=r"^--resume: .*/other is not a run directory \(it holds notes\.txt;"
    ):
        check_run_dir(other, resume=True)
    # new, empty, and a run's own directories are taken
    check_run_dir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_run_dir(tmp_path / "empty")
    for marker in ("run.json", "phases.jsonl", "phases.p1.jsonl", ".lock", ".lock.p1", "checkpoints"):
        run = tmp_path / f"run-{marker}"
        run.mkdir()
        (run / marker).write_text("")
        (run / "stuck-rollout-p0.txt").write_text("")  # and whatever else a run left there
        check_run_dir(run)
        check_run_dir(run, resume=True)


def test_run_dir_dot_is_refused_end_to_end(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = run_cli("mllm_rl.run", "--backend", "jax", "--wandb", "disabled", "--run-dir", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: --run-dir {tmp_path}: holds files that are not a run's (notes.txt; no run.json, "
        f"phases.jsonl or checkpoints/); a new run needs a new or empty directory"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# -- 5. memplan's trainer mesh is the run's -------------------------------------------------------
@pytest.mark.skipif(not HAS_JAX, reason="the JAX backend's check")
def test_the_trainer_mesh_check_is_shared_by_the_run_and_memplan():
    from mllm_rl.backends.jax.topologies import check_trainer_mesh

    with pytest.raises(ValueError, match=r"^--trainer-tp 3 does not divide the 1 devices$"):
        check_trainer_mesh(3, 0, 1, 4, 2)
    with pytest.raises(ValueError, match=r"^--trainer-tp 3 does not divide the 4 devices of v4-8$"):
        check_trainer_mesh(3, 0, 4, 4, 2, "v4-8")
    with pytest.raises(ValueError, match=r"^--trainer-tp 4: 4 heads / 2 kv heads are not divisible by it$"):
        check_trainer_mesh(4, 0, 4, 4, 2)
    check_trainer_mesh(2, 2, 4, 4, 2)


@pytest.mark.skipif(not HAS_JAX, reason="plans with the JAX backend")
def test_memplan_on_cpu_refuses_a_trainer_tp_the_run_refuses():
    """One CPU device (a run with --tp 1 has one): --trainer-tp 3 was planned on 3 forged devices."""
    r = run_cli("mllm_rl.memplan", "--target", "cpu", "--model", "tiny", "--trainer-tp", "3", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "error: --trainer-tp 3 does not divide the 1 devices of cpu"
