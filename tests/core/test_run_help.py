"""``python -m mllm_rl.run --help``: every flag explained, each default printed once, the exit codes."""

from __future__ import annotations

import re

from mllm_rl.options.schema import in_scope
from mllm_rl.run import EXIT_CODES, RUN_SCOPES, build_parser
from tests.conftest import ROOT, run_cli


def test_help_prints_each_default_once_and_the_exit_codes():
    r = run_cli("mllm_rl.run", "--help")
    assert r.returncode == 0
    text = r.stdout
    assert "(default: None)" not in text
    options = text.split("options:", 1)[1].split("exit codes:", 1)[0]
    entries = re.split(r"\n  (?=-)", options)  # one entry per flag
    for entry in entries:
        assert entry.count("default:") <= 1, entry
    backend = next(e for e in entries if e.startswith("--backend"))
    assert "default" not in backend  # required: no default to print
    for code, what in EXIT_CODES.items():
        assert re.search(rf"^\s+{code}\s+{re.escape(what[:30])}", text, re.M), code
    caches = text.split("caches (", 1)[1]  # the variables that move or turn off what runs keep
    assert "JAX_COMPILATION_CACHE_DIR" in caches and "MLLM_RL_PLAN_CACHE" in caches


def test_every_flag_has_help_and_its_default():
    actions = {a.dest: a for a in build_parser()._actions}
    for scope in RUN_SCOPES:
        for opt in in_scope(scope):
            text = actions[opt.key].help
            assert text and text.count("(default:") <= 1, opt.key
            if opt.default is not None and opt.default is not False and not opt.required:
                assert f"(default: {opt.default})" in text, opt.key


def test_readme_and_docs_list_the_exit_codes():
    readme = (ROOT / "README.md").read_text()
    for code in EXIT_CODES:
        assert re.search(rf"\b{code}\b", readme), code
    assert "docs/ERRORS.md" in readme
