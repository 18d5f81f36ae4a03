"""The torch backend is found by entry point and loading it imports neither torch nor jax."""

from __future__ import annotations

import json
import subprocess
import sys

from mllm_rl.backend_registry import available_backends


def test_torch_backend_found_by_entry_point_without_importing_torch_or_jax():
    assert "torch" in available_backends()
    code = (
        "import sys, json; from mllm_rl.backend_registry import load_backend; b = load_backend('torch');"
        "print(json.dumps([b.name, b.ready_phase, 'torch' in sys.modules, 'jax' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["torch", "torch_ready", False, False]


def test_torch_backend_is_a_complete_backend():
    from mllm_rl.backend import Backend
    from mllm_rl.backend_registry import load_backend

    b = load_backend("torch")
    assert isinstance(b, Backend) and not type(b).__abstractmethods__
    info = b.init_runtime(tp=1, platform="cpu")
    assert info["platform"] == "cpu" and info["device"] == "cpu" and info["torch_version"]
    assert set(info) >= {"torch_version", "devices", "cuda_available"}
