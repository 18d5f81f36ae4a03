"""The torch planner's use of the plan cache (``mllm_rl/memplan/cache.py``): a fake-tensor trace of
the train step kept on disk for the next plan of the same step, under a key of the step's
arguments, the package's source and torch's version; off, unwritable or damaged, it costs a trace
and nothing else (the key itself: ``tests/core/test_plan_cache.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from mllm_rl.backends.torch import memplan
from mllm_rl.memplan import cache as step_cache
from tests.torch.test_memplan_torch import request


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(step_cache.ENV, str(tmp_path / "plans"))
    return tmp_path / "plans"


def traces(monkeypatch) -> list:
    """The calls of the tracer ``measure`` makes from now on."""
    calls: list = []
    real = memplan.trainer_step_memory
    monkeypatch.setattr(memplan, "trainer_step_memory", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_a_second_plan_of_the_same_step_reads_the_first_trace(cache, monkeypatch):
    req = request(kv_tokens=1000)
    calls = traces(monkeypatch)
    first = memplan.measure(req)
    entries = list(cache.iterdir())
    assert len(calls) == 1 and [e.suffix for e in entries] == [".json"]  # written whole, no temporary left
    assert "earlier process" not in first.notes[0]
    second = memplan.measure(req)
    assert len(calls) == 1  # not traced again
    assert second.components == first.components and second.functions["grad_step"].peak_bytes == (
        first.functions["grad_step"].peak_bytes
    )
    assert "by an earlier process running the same code" in second.notes[0]
    assert second.info["compile_seconds"] == {"grad_step (fake-tensor trace, cached)": 0.0}
    doc = json.loads(entries[0].read_text())  # what the plan shows is the entry
    doc["params"] += 4096
    entries[0].write_text(json.dumps(doc))
    got = memplan.measure(req).components["trainer_params"].bytes_per_device
    assert got == first.components["trainer_params"].bytes_per_device + 4096
    memplan.measure(request(kv_tokens=1000, seq_len=48))  # another step: another entry
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2
    before = set(cache.iterdir())
    monkeypatch.setattr(step_cache, "MAX_ENTRIES", 1)  # past it, a store deletes the oldest
    memplan.measure(request(kv_tokens=1000, seq_len=40))
    (newest,) = cache.iterdir()
    assert len(calls) == 3 and newest not in before


def test_the_key_names_torch_and_its_version():
    args = {"seq_len": 32}
    assert step_cache.versions(["torch"]) == {"torch": torch.__version__}
    assert step_cache.key(args, ("torch",)) != step_cache.key(args, ())


def test_off_damaged_or_unwritable_costs_a_trace_and_nothing_else(cache, monkeypatch):
    req = request(kv_tokens=1000)
    calls = traces(monkeypatch)
    monkeypatch.setenv(step_cache.ENV, "")  # off
    assert step_cache.directory() is None
    memplan.measure(req)
    memplan.measure(req)
    assert len(calls) == 2 and not cache.exists()
    monkeypatch.setenv(step_cache.ENV, str(cache))
    memplan.measure(req)
    (entry,) = cache.iterdir()
    entry.write_text("{not json")
    memplan.measure(req)  # traced again, and the entry replaced
    assert len(calls) == 4 and json.loads(entry.read_text())["rows"] == 4
    blocked = cache / "blocked"
    blocked.write_text("a file where the directory would be")
    monkeypatch.setenv(step_cache.ENV, str(blocked))
    memplan.measure(req)
    assert len(calls) == 5 and blocked.is_file()
