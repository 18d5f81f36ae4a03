"""A run leaves through ``os._exit`` (``mllm_rl.run._exit``: no interpreter teardown), which skips
the finalizers that remove the temporary directories libraries make when imported; ``_exit``
removes them itself (``remove_library_temp_dirs``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = """
import json, os, sys
import wandb
import wandb.sdk.artifacts.artifact
from mllm_rl.run import remove_library_temp_dirs
made = [wandb.sdk.data_types._private.MEDIA_TMP.name, wandb.sdk.artifacts.artifact.Artifact._TMP_DIR.name]
there = [os.path.isdir(d) for d in made]
gone = remove_library_temp_dirs()
print(json.dumps({"made": made, "there": there, "gone": gone, "left": [d for d in made if os.path.exists(d)]}), flush=True)
os._exit(0)
"""


def test_wandbs_temp_dirs_are_removed_before_the_hard_exit(tmp_path):
    pytest.importorskip("wandb")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["there"] == [True, True] and sorted(out["gone"]) == sorted(out["made"]) and out["left"] == []
    assert list(tmp_path.glob("tmp*wandb-*")) == []  # nothing of wandb's left in the temp directory
