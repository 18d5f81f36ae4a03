"""Every refusal of ``python -m mllm_rl.run`` listed in ``docs/ERRORS.md``, run as written there.

Each row of the table: the command exits with the code the row says, prints exactly one line on
stderr containing the row's message (``...`` in it: anything), no traceback, and leaves nothing
behind: no run directory, no W&B run, no report; a run directory that existed before is unchanged,
file by file. Each row runs in an empty working directory (where the default ``runs/<id>`` would
appear) with ``--wandb offline`` appended (unless it names its own ``--wandb``) (a W&B run *would* be created if the command got that far).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mllm_rl.checkpoint.resolve import write_meta
from mllm_rl.options.resume import record
from mllm_rl.run import parse_args
from mllm_rl.run_files import lock_name
from tests.conftest import ROOT, run_cli

DOC = ROOT / "docs" / "ERRORS.md"
ROW = re.compile(
    r"^\|\s*`(?P<cmd>[^`]+)`\s*\|\s*(?P<exit>\d+)\s*\|\s*`(?P<msg>[^`]+)`\s*\|\s*(?P<when>[a-z]+)\s*\|"
)
WHEN = ("flags", "runtime")  # checked before any backend import / once the backend's runtime is up


def doc_rows() -> list[tuple[str, int, str, str]]:
    """``(command, exit code, message, when)`` of every table row of docs/ERRORS.md."""
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            assert m["when"] in WHEN, line
            rows.append((m["cmd"], int(m["exit"]), m["msg"], m["when"]))
    return rows


def installed(dist: str) -> bool:
    """Is the distribution installed? (Not ``find_spec``: under pytest, ``tests/torch`` would pass for torch.)"""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def fake_checkpoint(run_dir: Path, step: int, **meta: object) -> Path:
    """``checkpoints/step_<k>`` with a state file and a valid manifest (what the verification reads;
    the real trainers' checkpoints are resumed in tests/jax and tests/torch)."""
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    (ckpt / "state").mkdir(parents=True)
    (ckpt / "state" / "a.bin").write_bytes(os.urandom(4096))
    write_meta(ckpt, {"step": step, "seed": 0, "backend": "jax", "lora_rank": 0, **meta})
    return ckpt


def make_fixtures(tmp: Path) -> dict[str, Path]:
    paths = {name: tmp / name for name in ("file", "garbage", "badrow", "missing", "empty", "corrupt",
                                           "finished", "used", "recorded", "model", "busy", "notrun")}  # fmt: skip
    paths["file"].write_text("not a directory\n")
    paths["garbage"].write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary garbage\n")
    paths["badrow"].write_text('{"question": "1 + 1?"}\n')
    paths["empty"].mkdir()
    # every checkpoint invalid: the newest truncated, the older one's meta.json torn
    fake_checkpoint(paths["corrupt"], 1)
    newest = fake_checkpoint(paths["corrupt"], 2)
    with open(newest / "state" / "a.bin", "r+b") as f:
        f.truncate(100)
    (paths["corrupt"] / "checkpoints" / "step_000001" / "meta.json").write_text('{"step": 1, "fi')
    fake_checkpoint(paths["finished"], 1)
    fake_checkpoint(paths["recorded"], 1)
    options = record(parse_args(["--backend", "jax"])[0], "rl")
    (paths["recorded"] / "run.json").write_text(json.dumps({"run_id": "recorded", "options": options}))
    paths["model"].mkdir()
    (paths["model"] / "config.json").write_text("{}")
    (paths["model"] / "model.safetensors").write_bytes(b"\0" * 16)
    paths["busy"].mkdir()
    paths["used"].mkdir()
    paths["notrun"].mkdir()  # a directory of other files, nothing of a run
    (paths["notrun"] / "notes.txt").write_text("mine\n")
    (paths["used"] / "phases.jsonl").write_text('{"phase": "wandb_init"}\n')
    if os.geteuid() == 0:  # root writes into a chmod 555 directory; sysfs refuses new files to anyone
        paths["readonly"] = Path("/sys")
    else:
        paths["readonly"] = tmp / "readonly"
        paths["readonly"].mkdir(mode=0o555)
    return paths


def tree(d: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``d`` (directories as "dir")."""
    if not d.exists():
        return {}
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(d.rglob("*"))
    }


def _hold_lock(run_dir: Path) -> Any:
    """The run directory's lock, held by this (test) process as a live run would hold it."""
    f = open(run_dir / lock_name(0), "a+")  # noqa: SIM115 -- closed by the caller
    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(json.dumps({"pid": os.getpid(), "host": "here", "run_id": "other", "since": "now"}))
    f.flush()
    return f


ROWS = doc_rows()


def test_the_table_is_there_and_covers_every_exit_2_check():
    assert len(ROWS) >= 30
    text = " ".join(cmd for cmd, *_ in ROWS)
    for flag in ("--tp", "--engine", "--run-dir", "--resume", "--task-data", "--group-size", "--phase-timeout",
                 "--resume-or-start", "--checkpoint-every", "--model"):  # fmt: skip
        assert flag in text, flag


def refuse_here(tokens: list[str], env: dict[str, str], cwd: Path, monkeypatch, capfd) -> tuple[int, str]:
    """``(exit code, stderr)`` of ``mllm_rl.run.main(tokens)`` in this process, ``env`` added and
    ``cwd`` the working directory; the environment is restored after, whatever the command set in
    it. No SIGTERM handler is installed: this process is the test's. Imports see the ``sys.path`` of
    a process of its own: without pytest's ``tests/...`` entries (there, ``import torch`` would find
    ``tests/torch`` as a namespace package where torch is not installed)."""
    import mllm_rl.run as run

    saved = dict(os.environ)
    monkeypatch.setattr(run, "install_sigterm", lambda: None)
    monkeypatch.setattr(
        sys, "path", [p for p in sys.path if not Path(p or ".").resolve().is_relative_to(ROOT / "tests")]
    )
    monkeypatch.chdir(cwd)
    capfd.readouterr()
    os.environ.update(env)
    imported = set(sys.modules)
    try:
        code = run.main(tokens)
    except SystemExit as e:  # argparse's one-line errors
        code = e.code
    finally:
        os.environ.clear()
        os.environ.update(saved)
    sys.stdout.flush()
    sys.stderr.flush()
    frameworks = {m.split(".")[0] for m in set(sys.modules) - imported} & {"jax", "torch", "flax", "sgl_jax"}
    assert not frameworks, f"a flags row imported {sorted(frameworks)}"  # refused before any backend import
    return int(code or 0), capfd.readouterr().err


def runs_here(row: tuple[str, int, str, str]) -> bool:
    """A ``flags`` row, unless it goes online to W&B: wandb keeps its settings (``WANDB_BASE_URL``,
    the key it found) in a process-wide singleton made once, so those rows need a process each."""
    return row[3] == "flags" and "--wandb online" not in row[0]


def refuse(row: tuple[str, int, str, str], paths: dict[str, Path], cwd: Path, monkeypatch, capfd,
           here: bool = True) -> tuple[int, str, dict[str, str]]:  # fmt: skip
    """``(exit code, stderr, the names filled in)`` of the row's command (``{name}`` from
    ``paths``): in this process where ``runs_here`` (unless not ``here``), else as a process of
    its own."""
    cmd, _, _, when = row
    fmt = {k: str(v) for k, v in paths.items()} | {"long": "n" * 300}  # a name, too long for a file
    tokens = [t.format(**fmt) for t in shlex.split(cmd)]
    env = {}
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    backend = tokens[tokens.index("--backend") + 1] if "--backend" in tokens else None
    if when == "runtime" and not installed(str(backend)):
        pytest.skip(f"checked once the {backend} runtime is up: needs the {backend} environment")
    if "--wandb" not in tokens:
        tokens += ["--wandb", "offline"]
    if here and runs_here(row):
        return (*refuse_here(tokens, env, cwd, monkeypatch, capfd), fmt)
    r = run_cli("mllm_rl.run", *tokens, env=env, cwd=cwd, timeout=300)
    return r.returncode, r.stderr, fmt


def check_refusal(
    row: tuple[str, int, str, str], tmp_path: Path, monkeypatch, capfd, here: bool = True
) -> str:
    """Run the row (``refuse``) and check all the module docstring says; returns its line."""
    cmd, code, message, _ = row
    tmp_path.mkdir(exist_ok=True)
    paths = make_fixtures(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    held = _hold_lock(paths["busy"]) if "{busy}" in cmd else None
    before = {name: tree(p) for name, p in paths.items() if p.is_dir() and name != "readonly"}
    try:
        returncode, stderr, fmt = refuse(row, paths, cwd, monkeypatch, capfd, here)
    finally:
        if held is not None:
            held.close()
    lines = stderr.strip().splitlines()
    assert returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr
    assert len(lines) == 1, stderr[-3000:]
    fragments = [f.format(**fmt) for f in message.split("...")]
    pos = 0
    for frag in fragments:
        found = lines[0].find(frag, pos)
        assert found >= 0, (frag, lines[0])
        pos = found + len(frag)
    assert os.listdir(cwd) == []  # no runs/<id>, no wandb/
    assert not paths["missing"].exists()
    assert {name: tree(p) for name, p in paths.items() if p.is_dir() and name != "readonly"} == before
    return lines[0]


@pytest.mark.parametrize("row", ROWS, ids=[r[0][:60] for r in ROWS])
def test_refusal(row, tmp_path, monkeypatch, capfd):
    check_refusal(row, tmp_path, monkeypatch, capfd)


# one row of each way a flags row is refused: argparse, a value check, the preflight (run dir, data)
SAME_IN_A_PROCESS = ("--backend jax --tp x", "--backend jax --group-size 1", "--backend jax --run-dir {used}",
                     "--backend jax --task boxed --task-data {badrow}")  # fmt: skip


@pytest.mark.parametrize("cmd", SAME_IN_A_PROCESS)
def test_a_flags_refusal_is_the_same_in_a_process_of_its_own(cmd, tmp_path, monkeypatch, capfd):
    (row,) = [r for r in ROWS if r[0] == cmd]
    assert runs_here(row)
    here = check_refusal(row, tmp_path / "here", monkeypatch, capfd)
    alone = check_refusal(row, tmp_path / "alone", monkeypatch, capfd, here=False)
    assert here.replace(str(tmp_path / "here"), "") == alone.replace(str(tmp_path / "alone"), "")


def test_a_resume_without_backend_takes_the_recorded_one(tmp_path):
    from mllm_rl.run import recorded_backend

    (tmp_path / "run.json").write_text(json.dumps({"options": {"backend": "torch"}}))
    assert recorded_backend(["--resume", "--run-dir", str(tmp_path)]) == {"backend": "torch"}
    assert recorded_backend(["--resume-or-start", f"--run-dir={tmp_path}"]) == {"backend": "torch"}
    assert recorded_backend(["--resume", "--run-dir", str(tmp_path), "--backend", "jax"]) == {}
    assert recorded_backend(["--run-dir", str(tmp_path)]) == {}  # not a resume
    assert recorded_backend(["--resume", "--run-dir", str(tmp_path / "none")]) == {}


def test_a_resume_of_nothing_without_backend_still_asks_for_it(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mllm_rl.run", "--resume", "--run-dir", str(tmp_path / "none")],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--backend" in r.stderr, r.stderr
