"""Layout rules: the core imports neither jax nor torch; backends come from entry points."""

from __future__ import annotations

import json
import subprocess
import sys

from mllm_rl.backend_registry import available_backends, load_backend


def test_core_imports_no_framework():
    code = (
        "import sys, json;"
        "import mllm_rl.run, mllm_rl.plans.swap, mllm_rl.checkpoint, mllm_rl.phases, mllm_rl.sinks, mllm_rl.engine;"
        "print(json.dumps([m for m in ('jax', 'torch', 'flax') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_jax_backend_found_by_entry_point_without_importing_jax():
    assert "jax" in available_backends()
    code = (
        "import sys; from mllm_rl.backend_registry import load_backend; b = load_backend('jax');"
        "print(b.ready_phase, 'jax' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["jax_ready", "False", "False"]


def test_unknown_backend_is_a_clear_error():
    import pytest

    with pytest.raises(ValueError, match="'mxnet': not installed; available: .*jax"):
        load_backend("mxnet")


def test_shipped_tokenizer_matches_its_generator(tmp_path):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("make_tokenizer", root / "scripts" / "make_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.build().save_pretrained(tmp_path)
    shipped = root / "mllm_rl" / "assets" / "tokenizer"
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads(
        (shipped / "tokenizer.json").read_text()
    )
    tok = mod.build()
    text = "Hello, 世界 <|im_end|>"
    assert tok.decode(tok(text).input_ids) == text
