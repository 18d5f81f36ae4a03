"""The pieces of the sharded torch trainer that run without a process group: ``--fsdp`` resolved
against the process count, and offload/onload of an FSDP2-style shard (a view of
a padded storage) moving its whole storage, bit for bit."""

from __future__ import annotations

import pytest
import torch

from mllm_rl.backends.torch import fsdp
from mllm_rl.backends.torch.offload import OffloadGroup, storage_bytes


@pytest.mark.parametrize("value,world,sharded", [(0, 1, False), (1, 1, False), (0, 2, True), (2, 2, True),
                                                 (1, 2, False), (0, 8, True)])  # fmt: skip
def test_fsdp_resolves_to_every_process_or_none(value, world, sharded):
    assert fsdp.resolve(value, world) is sharded


@pytest.mark.parametrize("value,world", [(2, 1), (3, 2), (4, 8)])
def test_a_partial_fsdp_is_refused_naming_the_flag(value, world):
    with pytest.raises(
        ValueError, match=rf"^--fsdp {value}: the torch trainer shards over every process \({world};"
    ):
        fsdp.resolve(value, world)


def test_offload_moves_the_whole_padded_storage_of_a_shard_and_back_bit_for_bit():
    padded = torch.randn(10, 3)  # FSDP2 keeps a shard as the first rows of a padded flat storage
    shard = padded[:7]
    other = torch.randn(5)
    want = padded.clone(), other.clone()
    group = OffloadGroup("params", torch.device("cpu"))
    freed = group.offload([shard, other, padded])  # the padded storage once, whole
    assert freed == (10 * 3 + 5) * 4
    assert storage_bytes([shard, other], torch.device("cpu")) == 0 and not group.resident
    assert group.offload([shard]) == 0  # offloaded already
    group.onload()
    assert group.resident
    assert torch.equal(padded, want[0]) and torch.equal(shard, want[0][:7]) and torch.equal(other, want[1])


def test_a_dcp_checkpoint_restores_in_one_process_and_refuses_another_precision_or_lora_rank(
    tiny_bf16_ckpt, tmp_path
):
    """``torch.distributed.checkpoint`` state (what a sharded trainer writes) restores into an
    unsharded trainer (the masters, the AdamW moments and the step back bit for bit after they were
    changed) and is refused, naming the directory, by a trainer of another precision or LoRA rank
    before anything is loaded; ``state.pt`` gets the same precision refusal."""
    from mllm_rl.backends.torch.trainer import TorchTrainer
    from mllm_rl.checkpoint.model_dir import ModelDir
    from mllm_rl.trainer import TrainConfig

    model = ModelDir.open(tiny_bf16_ckpt)
    trainer = TorchTrainer(model, TrainConfig())
    trainer.step = 3
    # what a sharded trainer writes, here from one process
    with pytest.warns(UserWarning, match="save in a single process"):
        fsdp.save(trainer._dcp_state(), tmp_path)
    want = {n: p.detach().clone() for n, p in trainer.trainable.items()}
    moments = [st["exp_avg_sq"].clone() for st in trainer.optimizer.state.values()]
    with torch.no_grad():
        for p in trainer.trainable.values():
            p.add_(1.0)
        for st in trainer.optimizer.state.values():
            st["exp_avg_sq"].add_(1.0)
    trainer.step = 0
    trainer.restore(tmp_path)
    assert trainer.step == 3
    assert all(torch.equal(trainer.trainable[n], w) for n, w in want.items())
    assert all(
        torch.equal(st["exp_avg_sq"], m)
        for st, m in zip(trainer.optimizer.state.values(), moments, strict=True)
    )

    pure = TorchTrainer(model, TrainConfig(precision="pure"))
    before = {n: p.detach().clone() for n, p in pure.trainable.items()}
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'dcp'}: trainable params saved in torch.float32"):
        pure.restore(tmp_path)
    assert all(torch.equal(pure.trainable[n], w) for n, w in before.items())  # nothing loaded
    with pytest.raises(
        ValueError, match=r"dcp: its trainable parameters differ from this trainer's \(lora_rank 4\)"
    ):
        TorchTrainer(model, TrainConfig(lora_rank=4)).restore(tmp_path)

    (tmp_path / "plain").mkdir()
    trainer.save(tmp_path / "plain")  # unsharded: state.pt
    with pytest.raises(
        ValueError, match=r"state.pt: trainable params saved in torch.float32 \(precision 'mixed'\)"
    ):
        pure.restore(tmp_path / "plain")
