"""Fixtures for the tpu/ scripts: a FAKE gcloud first on PATH and fake TPU workers.

``fake_cloud`` installs ``fake_gcloud.py`` (a fake, not Google's gcloud) as ``<tmp>/bin/gcloud``
and the fake worker programs (``remote_stub.sh`` linked as sudo, git, curl, python3.12, ...) under
``<tmp>/remote-bin``, next to links to the few real coreutils the remote scripts use. Nothing
here needs the network, a cloud account or a TPU.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TPU_SH = ROOT / "tpu" / "tpu.sh"
# Real tools a fake worker may use; everything else there is a stub (see remote_stub.sh).
REAL_TOOLS = (
    "bash",
    "sh",
    "cat",
    "mkdir",
    "rm",
    "touch",
    "chmod",
    "tr",
    "sort",
    "xargs",
    "date",
    "tail",
    "head",
    "nohup",
    "timeout",
    "sleep",
    "env",
    "grep",
    "sed",
    "cp",
    "mv",
    "ls",
    "tee",
    "stat",
    "ln",
    "dirname",
)
STUBS = ("sudo", "pgrep", "pkill", "lsof", "ps", "git", "curl")


def _install_script(src: Path, dest: Path, interpreter: str) -> None:
    """Copy a script with a shebang of INTERPRETER and make it executable."""
    dest.write_text(f"#!{interpreter}\n" + src.read_text())
    dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@dataclass
class FakeCloud:
    tmp: Path
    bin: Path
    state: Path
    remote_bin: Path
    runs: Path

    def scenario(self, **kw) -> None:
        p = self.state / "scenario.json"
        cur = json.loads(p.read_text()) if p.exists() else {}
        cur.update(kw)
        p.write_text(json.dumps(cur))

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "CLOUDSDK_"))}
        base.update(
            {
                "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
                "FAKE_GCLOUD_STATE": str(self.state),
                "FAKE_REMOTE_BIN": str(self.remote_bin),
                "TPU_GCLOUD": str(self.bin / "gcloud"),  # never the real gcloud, whatever PATH says
                "TPU_POLL_S": "0",
                "TPU_LOCAL_RUNS": str(self.runs),
                "TMPDIR": str(self.tmp / "tmpdir"),
            }
        )
        base.update(extra or {})
        return base

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(TPU_SH), *args],
            capture_output=True,
            text=True,
            env=self.env(env),
            cwd=self.tmp,
            timeout=timeout,
        )

    def calls(self) -> list[list[str]]:
        p = self.state / "calls.jsonl"
        return [json.loads(line)["argv"] for line in p.read_text().splitlines()] if p.exists() else []

    def verbs(self) -> list[str]:
        """The gcloud calls as 'tpu-vm create', 'tpu-vm ssh', ... in order."""
        return [" ".join(c[2:4]) for c in self.calls()]

    def remote(self, prog: str | None = None) -> list[dict]:
        p = self.state / "remote.jsonl"
        recs = [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
        return [r for r in recs if prog is None or r["prog"].startswith(prog)]

    def home(self, name: str, worker: int) -> Path:
        return self.state / "vms" / name / f"w{worker}"

    def db(self) -> dict:
        return json.loads((self.state / "db.json").read_text())


@pytest.fixture
def fake_cloud(tmp_path: Path) -> FakeCloud:
    fc = FakeCloud(
        tmp=tmp_path,
        bin=tmp_path / "bin",
        state=tmp_path / "state",
        remote_bin=tmp_path / "remote-bin",
        runs=tmp_path / "runs",
    )
    for d in (fc.bin, fc.state, fc.remote_bin / "base", fc.remote_bin / "py312", tmp_path / "tmpdir"):
        d.mkdir(parents=True)
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash not found")
    _install_script(
        HERE / "fake_gcloud.py", fc.bin / "gcloud", f"{sys.executable} -S"
    )  # -S: stdlib only, starts faster
    stub = fc.remote_bin / "stub"
    _install_script(HERE / "remote_stub.sh", stub, bash)
    for name in STUBS:
        (fc.remote_bin / "base" / name).symlink_to(stub)
    (fc.remote_bin / "py312" / "python3.12").symlink_to(stub)
    for tool in REAL_TOOLS:
        real = shutil.which(tool)
        if real is None:
            pytest.skip(f"{tool} not found on this machine")
        (fc.remote_bin / "base" / tool).symlink_to(real)
    return fc
