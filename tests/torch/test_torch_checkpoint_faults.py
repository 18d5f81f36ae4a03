"""A torch run whose checkpoint write the OS refuses (``RLIMIT_FSIZE``), written in the phase or in
the background (``--checkpoint-background``): exit 1 in one line naming the file and the reason
(torch's writer says only ``unexpected pos ...``), no ``.state.pt.tmp`` left, the older checkpoint
resumes."""

from __future__ import annotations

import errno
import resource
import sys

import pytest

from tests.core.test_checkpoint_faults import check_refused_checkpoint_write


def test_a_refused_state_write_names_the_file_and_leaves_no_temporary_file(tmp_path):
    import torch

    from mllm_rl.backends.torch.trainer import STATE_FILE, _write_state

    state = {"trainable": {"w": torch.randn(1 << 19)}, "step": 3}  # 2 MiB
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OSError) as e:
            _write_state(state, tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert e.value.errno == errno.EFBIG and e.value.filename == str(tmp_path / f".{STATE_FILE}.tmp")
    assert list(tmp_path.iterdir()) == []
    _write_state(state, tmp_path)  # without the limit: written, and loads back
    assert torch.equal(
        torch.load(tmp_path / STATE_FILE, weights_only=True)["trainable"]["w"], state["trainable"]["w"]
    )
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]


@pytest.mark.slow  # four runs of the tiny model
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and EFBIG as on Linux")
def test_a_checkpoint_write_past_the_file_size_limit_exits_1_and_the_older_checkpoint_resumes(
    tiny_ckpt, tmp_path
):
    check_refused_checkpoint_write("torch", tiny_ckpt, tmp_path / "run", [[], ["--checkpoint-background"]])


def test_the_state_is_written_without_torchs_crc32_and_the_option_is_restored(tmp_path):
    """The zip records carry no CRC32 (the manifest's sha256 is the checksum, checked before a
    resume), the file loads back equal, and torch's global option is as it was, after a write that
    failed too."""
    import zipfile

    import torch
    from torch.serialization import get_crc32_options

    from mllm_rl.backends.torch.trainer import STATE_FILE, _write_state

    state = {"trainable": {"w": torch.randn(1 << 16)}, "step": 3}
    entry = _write_state(state, tmp_path)
    with zipfile.ZipFile(tmp_path / STATE_FILE) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    assert torch.equal(
        torch.load(tmp_path / STATE_FILE, weights_only=True)["trainable"]["w"], state["trainable"]["w"]
    )
    assert entry[STATE_FILE]["bytes"] == (tmp_path / STATE_FILE).stat().st_size
    assert get_crc32_options() is True
    with pytest.raises(OSError):
        _write_state(state, tmp_path / "missing")  # no such directory
    assert get_crc32_options() is True
