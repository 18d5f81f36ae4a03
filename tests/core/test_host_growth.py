"""The report's host-growth finding (``mllm_rl.report.checks.host_growth``) on step-end RSS series."""

from __future__ import annotations

from mllm_rl.report.checks import MIB, growth, step_rss


def series(*mib: float) -> dict[int, int]:
    return {step: int(v * MIB) for step, v in enumerate(mib)}


def test_a_steady_rise_is_a_leak_and_settling_or_one_jump_is_not():
    assert growth(series(700, 768, 787, 787, 787, 787)) is None  # a clean run: settles after step 2
    assert growth(series(700, 700, 900, 901, 902)) is None  # one compile: a jump, then flat
    assert growth(series(700, 700, 701, 702, 703)) is None  # rising, but by a MiB per step
    per_step, steps = growth(series(700, 768, 832, 896, 960))
    assert steps == [1, 2, 3, 4] and per_step == 64
    assert growth(series(700, 768, 832, 896)) is None  # too few steps after step 0 to call it


def test_step_rss_takes_each_steps_last_record():
    recs = [
        {"step": None, "memory": {"host": {"rss_bytes": 1}}},
        {"step": 0, "memory": {"host": {"rss_bytes": 5}}},
        {"step": 0, "memory": {"host": {"rss_bytes": 7}}},
        {"step": 1, "memory": {}},
        {"step": 1, "memory": {"host": {"rss_bytes": 9}}},
    ]
    assert step_rss(recs) == {0: 7, 1: 9}
