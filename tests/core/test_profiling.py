"""``--profile STEPS``: the steps it names, and ``Profiled`` tracing exactly those (with a fake
profiler standing in for jax.profiler / torch.profiler, whose traces the backend tests open)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from mllm_rl.profiling import Profiled, StepProfiler, parse_steps
from tests.conftest import run_cli


@pytest.mark.parametrize(
    ("spec", "steps"), [("2", {2}), ("1,3", {1, 3}), ("2-4", {2, 3, 4}), (" 0 , 2-3", {0, 2, 3})]
)
def test_steps_it_names(spec, steps):
    assert parse_steps(spec, 10) == steps


@pytest.mark.parametrize(
    ("spec", "message"),
    [("x", "expected step numbers"), ("3-1", "'3-1' is not a step or an increasing range"),
     ("-1", "expected step numbers"), ("10", "step 10 is past the run's last step 9 (--steps 10)"), ("1,", "expected")],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_the_flag(spec, message):
    with pytest.raises(ValueError, match="--profile") as e:
        parse_steps(spec, 10)
    assert message in str(e.value) and "\n" not in str(e.value)


class FakeProfiler(StepProfiler):
    """Stands in for a framework profiler: records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self, out_dir: Path, process_index: int) -> None:
        self.out = out_dir
        out_dir.mkdir(parents=True)
        self.calls.append(f"start {out_dir.name}")

    def stop(self) -> list[Path]:
        self.calls.append("stop")
        (self.out / "trace.json").write_text("{}")
        return [self.out / "trace.json"]

    def annotate(self, name: str):
        self.calls.append(f"phase {name}")
        return contextlib.nullcontext()

    def how_to_open(self, profile_dir: Path) -> str:
        return f"open {profile_dir}"


class Rec:
    annotate = None

    @contextlib.contextmanager
    def phase(self, name):
        with self.annotate(name) if self.annotate else contextlib.nullcontext():
            yield


def test_only_the_named_steps_are_traced_with_their_phases(tmp_path):
    prof, rec = FakeProfiler(), Rec()
    p = Profiled(prof, frozenset({1}), tmp_path, "fake")
    for step in range(3):
        with p.step(rec, step):
            with rec.phase("rollout"):
                pass
    assert prof.calls == ["start step_1", "phase rollout", "stop"]
    assert rec.annotate is None  # off again after the traced step
    index = json.loads((tmp_path / "profile" / "index.json").read_text())
    assert index == {
        "backend": "fake",
        "steps": {"1": ["step_1/trace.json"]},
        "open": f"open {tmp_path / 'profile'}",
    }
    assert p.lines() == [
        f"profile: step(s) 1 traced in {tmp_path / 'profile'}; open: open {tmp_path / 'profile'}"
    ]


def test_a_failing_step_still_writes_its_trace(tmp_path):
    prof, rec = FakeProfiler(), Rec()
    p = Profiled(prof, frozenset({0}), tmp_path, "fake")
    with pytest.raises(RuntimeError), p.step(rec, 0):
        raise RuntimeError("boom")
    assert prof.calls[-1] == "stop" and (tmp_path / "profile" / "step_0" / "trace.json").exists()


def test_cli_refuses_a_step_the_run_does_not_have(tmp_path):
    r = run_cli(
        "mllm_rl.run", "--backend", "jax", "--steps", "3", "--profile", "5", "--run-dir", str(tmp_path / "r")
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --profile '5': step 5 is past the run's last step 2 (--steps 3)"
    ]
    assert not (tmp_path / "r").exists()
