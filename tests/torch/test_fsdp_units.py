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
