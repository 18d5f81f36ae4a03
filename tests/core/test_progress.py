"""Progress output: bars and the elapsed-time line of uncounted waits show on a terminal only."""

from __future__ import annotations

import time

import pytest

from mllm_rl import progress


@pytest.fixture
def tty(monkeypatch):
    """As on a terminal (the captured stderr is not one)."""
    monkeypatch.setattr(progress, "progress_enabled", lambda: True)


def test_progress_is_off_under_ci_and_without_a_terminal(monkeypatch):
    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(progress.sys, "stderr", Terminal())
    monkeypatch.delenv("MLLM_RL_NO_PROGRESS", raising=False)
    monkeypatch.delenv("CI", raising=False)
    assert progress.progress_enabled()
    monkeypatch.setenv("CI", "1")
    assert not progress.progress_enabled()
    monkeypatch.delenv("CI")
    monkeypatch.setattr(Terminal, "isatty", lambda self: False)
    assert not progress.progress_enabled()


def test_a_wait_shows_its_elapsed_time_and_stops_refreshing(tty, capsys):
    with progress.waiting("engine start", every_s=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert err.count("engine start: 00:00") >= 3  # refreshed while waiting, not only at start and end
    time.sleep(0.15)
    assert capsys.readouterr().err == ""  # the refresher thread is gone


def test_a_wait_is_silent_when_progress_is_off(monkeypatch, capsys):
    monkeypatch.setenv("MLLM_RL_NO_PROGRESS", "1")
    with progress.waiting("engine start", every_s=0.01):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_a_failing_wait_stops_its_thread(tty, capsys):
    import threading

    with pytest.raises(RuntimeError), progress.waiting("x", every_s=0.01):
        raise RuntimeError("boom")
    assert not [t for t in threading.enumerate() if t.name == "waiting:x"]
