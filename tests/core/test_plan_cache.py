"""``mllm_rl/memplan/cache.py``: the key of a stored plan measurement is its arguments, this
package's source and the named frameworks' versions; a change to any is another entry (the
planners' use of it: ``tests/torch/test_step_cache.py``, ``tests/jax/test_memplan_jax.py``)."""

from __future__ import annotations

import importlib.metadata

from mllm_rl.memplan import cache


def test_the_key_is_the_arguments_the_source_and_the_versions(monkeypatch, tmp_path):
    k = cache.key({"seq_len": 32}, ("pytest",))
    assert k == cache.key({"seq_len": 32}, ("pytest",)) != cache.key({"seq_len": 48}, ("pytest",))
    with monkeypatch.context() as m:
        m.setattr(cache, "source_digest", lambda: "edited")
        assert cache.key({"seq_len": 32}, ("pytest",)) != k
    with monkeypatch.context() as m:
        real = importlib.metadata.version
        m.setattr(importlib.metadata, "version", lambda d: "0.0.1" if d == "pytest" else real(d))
        assert cache.key({"seq_len": 32}, ("pytest",)) != k
    assert cache.versions(["pytest", "no-such-distribution"]) == {
        "pytest": importlib.metadata.version("pytest"),
        "no-such-distribution": None,
    }
    # the digest reads every Python file's name and bytes, the backends' included
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    f = tmp_path / "pkg" / "sub" / "a.py"
    f.write_text("x = 1\n")
    before = cache.digest((tmp_path / "pkg",))
    f.write_text("x = 2\n")
    assert cache.digest((tmp_path / "pkg",)) != before
    assert {p.name for p in cache.source_roots()} == {"mllm_rl", "backends"}


def test_off_unset_and_moved(tmp_path):
    assert cache.directory({cache.ENV: ""}) is None
    assert cache.directory({cache.ENV: str(tmp_path)}) == tmp_path
    assert cache.directory({"MLLM_RL_CACHE": str(tmp_path)}) == tmp_path / "plans"
    assert cache.load("x", {cache.ENV: ""}) is None
    cache.store("x", {"a": 1}, {cache.ENV: str(tmp_path / "p")})
    assert cache.load("x", {cache.ENV: str(tmp_path / "p")}) == {"a": 1}
