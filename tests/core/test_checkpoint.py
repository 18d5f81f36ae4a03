"""Checkpoints we write ourselves: format interop, streaming, and every bad input."""

from __future__ import annotations

import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from mllm_rl.checkpoint import CheckpointError, ModelDir, make_checkpoint
from mllm_rl.checkpoint.safetensors_io import read_header, write_file
from mllm_rl.presets import get_preset
from tests.conftest import run_cli


def test_written_checkpoint_opens_and_streams(tiny_ckpt):
    md = ModelDir.open(tiny_ckpt)
    cfg = get_preset("tiny")
    assert list(md.tensors) == list(cfg.param_shapes())
    assert len({f for f, _ in md.tensors.values()}) > 1  # really sharded
    for name, arr in md.iter_tensors():
        assert arr.shape == cfg.param_shapes()[name]
        assert arr.dtype == np.float32
    assert md.nbytes == cfg.num_params() * 4


def test_official_safetensors_reads_our_bf16(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    write_file(tmp_path / "a.safetensors", [("x", (3, 4), "BF16", lambda: x.astype(ml_dtypes.bfloat16))])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a.safetensors"), "flax") as f:
        got = np.asarray(f.get_tensor("x"), np.float32)
    np.testing.assert_allclose(got, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert safetensors_numpy is not None


def test_make_is_deterministic(tmp_path):
    cfg = get_preset("tiny")
    a = make_checkpoint(cfg, tmp_path / "a", show_progress=False)
    b = make_checkpoint(cfg, tmp_path / "b", show_progress=False)
    c = make_checkpoint(cfg, tmp_path / "c", seed=1, show_progress=False)
    ta, tb, tc = (dict(ModelDir.open(p).iter_tensors()) for p in (a, b, c))
    name = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_array_equal(ta[name], tb[name])
    assert not np.array_equal(ta[name], tc[name])


@pytest.fixture
def broken(tiny_ckpt, tmp_path):
    """A private copy of the tiny checkpoint to damage."""
    dst = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def _shard_of(path, tensor):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def _rewrite_tensor(path, name, shape=None, dtype="F32"):
    """Rewrite the shard holding ``name`` with that tensor's shape/dtype changed."""
    shard = _shard_of(path, name)
    header = read_header(shard)
    md_entries = []
    for n, info in header.items():
        arr = np.memmap(shard, dtype=np.uint8, mode="r", offset=info.begin, shape=(info.nbytes,))
        if n == name:
            shp = shape or info.shape
            dt = {"F32": np.float32, "I32": np.int32}[dtype]
            md_entries.append((n, shp, dtype, lambda shp=shp, dt=dt: np.zeros(shp, dt)))
        else:
            data = np.array(arr).view(np.float32).reshape(info.shape)
            md_entries.append((n, info.shape, info.dtype, lambda d=data: d))
    write_file(shard, md_entries)


LAYER0_Q = "model.layers.0.self_attn.q_proj.weight"


def _truncate(p):
    shard = _shard_of(p, LAYER0_Q)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])


def _missing_tensor(p):
    shard = _shard_of(p, "model.norm.weight")
    header = read_header(shard)
    keep = [
        (n, i.shape, i.dtype, lambda i=i: np.array(np.memmap(shard, np.float32, "r", i.begin, i.shape)))
        for n, i in header.items()
        if n != "model.norm.weight"
    ]
    write_file(shard, keep)
    index = json.loads((p / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (p / "model.safetensors.index.json").write_text(json.dumps(index))


def _config(p, **changes):
    cfg = json.loads((p / "config.json").read_text())
    cfg.update(changes)
    (p / "config.json").write_text(json.dumps(cfg))


CASES = {
    "truncated": (_truncate, r"model-\d+-of-\d+\.safetensors: tensor .*truncated"),
    "missing_tensor": (_missing_tensor, r"tensor model\.norm\.weight: missing"),
    "wrong_shape": (
        lambda p: _rewrite_tensor(p, LAYER0_Q, shape=(7, 128)),
        rf"tensor {LAYER0_Q}: shape \[7, 128\]",
    ),
    "wrong_dtype": (lambda p: _rewrite_tensor(p, LAYER0_Q, dtype="I32"), rf"tensor {LAYER0_Q}: dtype I32"),
    "config_mismatch": (
        lambda p: _config(p, intermediate_size=512),
        r"tensor model\.layers\.0\.mlp\..*shape",
    ),
    "config_missing_field": (
        lambda p: _config(p, hidden_size=None) or _drop_key(p),
        r"config\.json: missing field",
    ),
    "bad_config_json": (lambda p: (p / "config.json").write_text("{oops"), r"config\.json: invalid JSON"),
    "tokenizer_missing": (
        lambda p: (p / "tokenizer.json").unlink(),
        r"tokenizer\.json: tokenizer file missing",
    ),
    "tokenizer_corrupt": (lambda p: (p / "tokenizer.json").write_text("{"), r"tokenizer\.json: invalid JSON"),
    "header_garbage": (
        lambda p: _shard_of(p, LAYER0_Q).write_bytes(struct.pack("<Q", 10**12)),
        r"header length",
    ),
}


def _drop_key(p):
    cfg = json.loads((p / "config.json").read_text())
    del cfg["hidden_size"]
    (p / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_is_rejected_with_one_line_naming_file(broken, case):
    damage, pattern = CASES[case]
    damage(broken)
    with pytest.raises(CheckpointError, match=pattern) as e:
        ModelDir.open(broken)
    assert "\n" not in str(e.value)
    assert str(broken) in str(e.value)


def test_check_cli_bad_input_exit_2_one_line(broken):
    _truncate(broken)
    r = run_cli("mllm_rl.checkpoint", "check", str(broken))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    assert "Traceback" not in r.stderr


def test_make_cli_refuses_foreign_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = run_cli("mllm_rl.checkpoint", "make", "--preset", "tiny", "--out", str(tmp_path))
    assert r.returncode == 2 and "refusing to overwrite" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_resolve_preset_writes_once_and_hub_id_respects_offline(monkeypatch, tmp_path):
    from mllm_rl.checkpoint import resolve_model

    monkeypatch.setenv("MLLM_RL_CACHE", str(tmp_path))
    md = resolve_model("tiny")
    assert md.path == (tmp_path / "checkpoints" / "tiny-float32-s0").resolve()
    mtime = (md.path / "config.json").stat().st_mtime_ns
    assert resolve_model("tiny").path == md.path
    assert (md.path / "config.json").stat().st_mtime_ns == mtime  # reused, not rewritten
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="Qwen/Qwen3-4B: hub download needed but HF_HUB_OFFLINE is set"):
        resolve_model("Qwen/Qwen3-4B")
    with pytest.raises(CheckpointError, match="not a preset"):
        resolve_model("qwen3-99b")


# -- non-finite weights ---------------------------------------------------------------------
def _poison(path, name, flat_index, value=np.nan):
    """Overwrite one float32 element of tensor ``name`` in place."""
    shard = _shard_of(path, name)
    info = read_header(shard)[name]
    mm = np.memmap(shard, np.float32, "r+", info.begin, (info.nbytes // 4,))
    mm[flat_index] = value
    mm.flush()
    del mm
    return shard


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
def test_nonfinite_count_and_first_index_across_chunks(dtype):
    from mllm_rl.checkpoint.safetensors_io import DTYPES, count_nonfinite

    np_dtype = DTYPES[dtype]
    big = float(np.finfo(np.float16).max) if dtype == "F16" else 3e38
    x = np.linspace(-big, big, 1000).astype(np_dtype)  # the largest finite values, and -0/subnormals
    x[[0, 1]] = [np.float32(-0.0), np.float32(1e-40) if dtype != "F16" else 1e-7]
    assert count_nonfinite(x.reshape(20, 50), dtype, chunk_elems=64) == (0, -1)
    x[[130, 131, 999]] = [np.inf, -np.inf, np.nan]
    assert count_nonfinite(x.reshape(20, 50), dtype, chunk_elems=64) == (3, 130)


def test_nan_weight_is_refused_naming_file_tensor_and_index(broken):
    shard = _poison(broken, LAYER0_Q, 128 * 3 + 5)
    with pytest.raises(CheckpointError) as e:
        ModelDir.open(broken)
    assert str(e.value) == (
        f"{shard}: tensor {LAYER0_Q}: 1 non-finite value(s) (NaN/inf), first at index [3, 5]"
    )
    ModelDir.open(broken, check_values=False)  # the structure itself is sound


def test_check_cli_refuses_inf_weight_exit_2_and_skip_values_flag(broken):
    _poison(broken, "model.norm.weight", 7, np.inf)
    r = run_cli("mllm_rl.checkpoint", "check", str(broken))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "tensor model.norm.weight: 1 non-finite value(s)" in r.stderr
    ok = run_cli("mllm_rl.checkpoint", "check", "--skip-values", str(broken))
    assert ok.returncode == 0 and "values not scanned" in ok.stdout


def test_check_cli_reports_the_scan(tiny_ckpt):
    r = run_cli("mllm_rl.checkpoint", "check", str(tiny_ckpt))
    assert r.returncode == 0 and "values all finite (" in r.stdout, r.stderr


def test_run_refuses_nan_checkpoint_before_any_engine(broken, tmp_path):
    _poison(broken, "model.embed_tokens.weight", 0)
    run_dir = tmp_path / "run"
    r = run_cli("mllm_rl.run", "--backend", "jax", "--plan", "swap", "--model", str(broken),
                "--run-dir", str(run_dir), "--wandb", "disabled", "--quiet")  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "tensor model.embed_tokens.weight: 1 non-finite value(s)" in r.stderr
    assert not (run_dir / "phases.jsonl").exists()


def test_a_run_scans_the_values_once(monkeypatch, tmp_path):
    """``resolve_model`` (what ``mllm_rl.run`` validates ``--model`` with) scans each tensor once;
    a preset it has just written is not scanned again."""
    from mllm_rl.checkpoint import model_dir, resolve_model

    scanned: list[str] = []
    real = model_dir.check_finite

    def counting(tensors, on_bytes=None):
        tensors = list(tensors)
        scanned.extend(name for name, _, _ in tensors)
        return real(tensors, on_bytes)

    monkeypatch.setattr(model_dir, "check_finite", counting)
    monkeypatch.setenv("MLLM_RL_CACHE", str(tmp_path))
    md = resolve_model("tiny")  # written now: values drawn by us
    assert scanned == []
    resolve_model(str(md.path))  # an existing directory, as `--model DIR` gives it
    assert sorted(scanned) == sorted(md.tensors)


def test_a_pass_over_the_tensors_maps_each_file_once_and_leaves_none_mapped(tiny_ckpt):
    """``iter_tensors`` reads every tensor as a view of one map per file (no copy, not a map per
    tensor); once the pass and its arrays are gone, no file of the checkpoint stays mapped (a map
    kept would count the file's pages in the process's RSS for the rest of the run)."""
    import gc
    from pathlib import Path

    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    md = ModelDir.open(tiny_ckpt)
    files = {str(f.resolve()) for f, _ in md.tensors.values()}

    def mapped() -> list[str]:
        lines = Path("/proc/self/maps").read_text().splitlines()
        return [x.split()[-1] for x in lines if x.split()[-1] in files]

    assert mapped() == []
    arrays = dict(md.iter_tensors())
    assert sorted(mapped()) == sorted(files)  # one map per file, however many tensors it holds
    for name, arr in arrays.items():
        file, info = md.tensors[name]
        assert not arr.flags.writeable and arr.shape == tuple(info.shape)
        raw = file.read_bytes()[info.begin : info.end]
        assert arr.tobytes() == raw, name
    del arrays, arr
    gc.collect()
    assert mapped() == []
