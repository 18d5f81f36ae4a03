"""What a run prints (``--console``, ``mllm_rl.sinks.console``), in process with a scripted probe:
by default one line per step with the watched numbers and no phase lines; ``phases`` brings one
line per phase record back; the old value ``compact`` is refused naming its new name."""

from __future__ import annotations

import io
import re

import pytest

from mllm_rl.phases import PhaseRecorder
from mllm_rl.sinks.console import ConsoleSink, step_line
from tests.core.test_recorder import ScriptedProbe

SETUP = ("wandb_init", "engine_ready_dummy", "trainer_init")
STEP = ("rollout", "train_step", "update_weights")
METRICS = {"reward_mean": 0.25, "reward_max": 1.0, "kl": 1.5e-5, "clip_frac": 0.0, "grad_norm": 0.71,
           "loss": -0.0014, "tokens": 512, "updates": 1}  # fmt: skip


def fake_run(mode: str, steps: int = 3) -> tuple[str, str, PhaseRecorder]:
    """Three setup phases, ``steps`` steps of three phases each (the train step's device peak at
    ``1 GiB + step MiB`` over the two devices), each step's metrics logged after its phases."""
    out, err, probe = io.StringIO(), io.StringIO(), ScriptedProbe()
    rec = PhaseRecorder("r", "fake", sinks=[ConsoleSink(mode, steps=steps, stream=out, err=err)], probe=probe,
                        sample_interval_s=0)  # fmt: skip
    for name in SETUP:
        with rec.phase(name):
            pass
    for step in range(steps):
        for name in STEP:
            with rec.phase(name, step=step):
                if name == "train_step":
                    probe.set(0, 2**30 + step * 2**20 - 200)
                    rec.sample()
                    probe.set(0, 100)
        rec.log_metrics(step, {**METRICS, "sample": {"prompt": "p"}})
    rec.close()
    return out.getvalue(), err.getvalue(), rec


def test_by_default_one_line_per_step_with_the_watched_numbers_and_no_phase_lines():
    out, err, _ = fake_run("steps")
    assert out == ""  # no phase records on stdout
    lines = err.splitlines()
    assert lines[0].startswith("setup: 3 phases in ") and "rss_peak=" in lines[0], lines
    steps = lines[1:]
    assert len(steps) == 3, lines
    for i, line in enumerate(steps):
        assert line.startswith(
            f"step {i} ({i + 1}/3): reward_mean=0.25 kl=1.5e-05 clip_frac=0 grad_norm=0.71 "
        ), line
        assert "loss=-0.0014 " in line  # significant digits: a GRPO loss near 0 does not read 0.0000
        assert re.search(r" step_s=[0-9.e-]+ ", line), line
        assert line.endswith("GiB") and f"dev_peak={(2**30 + i * 2**20) / 2**30:.3f}GiB" in line, line
    assert not [x for x in lines if x.startswith("phase ")]


def test_the_phases_mode_brings_one_line_per_phase_record_back():
    out, err, rec = fake_run("phases")
    phase_lines = out.splitlines()
    assert len(phase_lines) == len(rec.records) == len(SETUP) + 3 * len(STEP)
    for line, r in zip(phase_lines, rec.records, strict=True):
        assert line.startswith(f"phase {r['idx']:>4} {r['phase']}"), line
    assert [x.split(":")[0] for x in err.splitlines()] == ["step 0 (1/3)", "step 1 (2/3)", "step 2 (3/3)"]


def test_a_failed_phase_is_shown_in_the_steps_mode():
    err = io.StringIO()
    rec = PhaseRecorder("r", "fake", sinks=[ConsoleSink("steps", err=err)], probe=ScriptedProbe(),
                        sample_interval_s=0)  # fmt: skip
    with pytest.raises(RuntimeError), rec.phase("train_step", step=0):
        raise RuntimeError("boom")
    (line,) = err.getvalue().splitlines()
    assert line.startswith("phase    0 train_step") and "ERROR RuntimeError: boom" in line


def test_a_task_step_line_names_its_task_and_no_step_count():
    line = step_line(4, {"task": "math", **METRICS}, [])
    assert line == "[math] step 4: reward_mean=0.25 kl=1.5e-05 clip_frac=0 grad_norm=0.71 loss=-0.0014"


def test_console_compact_is_refused_naming_phases(capsys):
    from mllm_rl.run import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--backend", "jax", "--console", "compact"])
    assert e.value.code == 2
    assert "'compact' is called 'phases' now: pass --console phases" in capsys.readouterr().err
    args, _ = parse_args(["--backend", "jax"])
    assert args.console == "steps"
