"""Torch trainers under ``python -m mllm_rl.launch --nproc N --module tests.fsdp_trainer_child --
CKPT OUT [JSON]`` (JSON: one TrainConfig, or a list of them, each run in turn in the same process
group): every process joins the run and, per config, builds a ``TorchTrainer`` of CKPT (sharded
with FSDP2 over the processes unless the config says ``fsdp: 1``), takes three ``train_step``s on
one fixed batch (every process the same), offloads and onloads its state between them, and
process 0 writes the batch's log-probs before the first step, each step's metrics and the engine
export's fingerprint after the first to OUT (JSON: one document, or a list, as the configs were
given). The test compares N = 2 with N = 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from mllm_rl.backends.torch import distributed
from mllm_rl.backends.torch.trainer import TorchTrainer
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import OPTIMIZER, PARAMS, RolloutBatch, TrainConfig

ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
given = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
procs = distributed.init_distributed()
model = ModelDir.open(ckpt)

rng = np.random.default_rng(7)
rows, t = 24, 40
tokens = rng.integers(0, model.config.vocab_size, (rows, t)).astype(np.int32)
lengths = rng.integers(t // 2, t + 1, rows)
attn = np.arange(t)[None] < lengths[:, None]
loss_mask = attn & (np.arange(t)[None] >= 12)
tokens = np.where(attn, tokens, 0)
old = np.where(loss_mask, -rng.uniform(1, 6, (rows, t)), 0).astype(np.float32)
batch = RolloutBatch(tokens, attn, loss_mask, old, rng.normal(size=rows).astype(np.float32))


def run(kw: dict) -> dict:
    kw = dict(kw)
    loss = LossConfig(**kw.pop("loss", {}))
    trainer = TorchTrainer(model, TrainConfig(loss=loss, **kw))
    logp = trainer.logprobs(batch)  # each process its share of the micro-batches, all of them gathered
    steps, fingerprint = [], None
    for _ in range(3):
        steps.append(trainer.train_step(batch))
        trainer.offload([PARAMS, OPTIMIZER])
        trainer.onload([PARAMS, OPTIMIZER])
        fingerprint = fingerprint or trainer.weights_fingerprint()  # after the first step
    return {"steps": steps, "fingerprint": fingerprint, "sharded": trainer.sharded, "logprobs": logp.tolist()}


docs = [run(kw) for kw in given] if isinstance(given, list) else run(given)
if procs.index == 0:
    out.write_text(json.dumps(docs))
distributed.shutdown()
