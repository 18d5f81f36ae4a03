"""JAX trainer: flax nnx Qwen3, optax AdamW, donated jitted steps, a device mesh, orbax
checkpoints, ``pinned_host`` offload. Implements ``mllm_rl.trainer.Trainer``.

Shapes: B sequences, T positions (right-padded to a multiple of ``T_BUCKET``), V vocab.

State is functional: ``trainable`` (every ``Param``, or the LoRA adapters), ``frozen`` (the LoRA
base) and ``opt_state``, sharded over a ``("fsdp", "tp")`` mesh; the jitted functions are
``step_fns.make_step_fns``'s, the ones a memory plan compiles. Precision ``mixed`` keeps float32
masters and moments for a bf16 checkpoint; the engine gets the checkpoint dtype.
"""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mllm_rl.backends.jax import host_optimizer
from mllm_rl.backends.jax.export_layout import KernelInOut, Owned, array_of
from mllm_rl.backends.jax.fingerprint import read_sums, tensor_sums
from mllm_rl.backends.jax.model import Qwen3, get_weight, linear_layers
from mllm_rl.backends.jax.options import ModelOptions
from mllm_rl.backends.jax.orbax_io import AsyncSave
from mllm_rl.backends.jax.sharding import batch_sharding, data_rows, make_mesh, tree_shardings
from mllm_rl.backends.jax.step_fns import load_state, make_step_fns, model_dir_dtype
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import Fingerprint, WeightExport
from mllm_rl.faults import fault, fault_value
from mllm_rl.rl.loss_config import seq_count
from mllm_rl.trainer import (
    OPTIMIZER,
    PARAMS,
    RolloutBatch,
    TrainConfig,
    TrainerStateError,  # noqa: F401 - raised by _need, imported from here by callers
    check_state_names,
    greedy_loop,
    require_resident,
    train_metrics,
)

T_BUCKET = 32
DEVICE, HOST = host_optimizer.DEVICE, host_optimizer.HOST


def device_bytes(tree: Any) -> int:
    """Bytes ``tree``'s arrays occupy, summed over every addressable shard (replicas count)."""
    # from the sharding: a multi-process array's shards need not be read
    shard = lambda x: int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize  # noqa: E731
    return sum(shard(x) * len(x.sharding.addressable_devices) for x in jax.tree.leaves(tree))


def to_host(x: jax.Array) -> np.ndarray:
    """``x``'s global value on the host (gathered across processes: a collective)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


_copy = host_optimizer.put  # a copy of a tree's arrays in another memory kind (same sharding)


def _move(tree: Any, kind: str) -> Any:
    """The same arrays in memory kind ``kind`` (same sharding); the source arrays are deleted."""

    def one(x: jax.Array) -> jax.Array:
        if (x.sharding.memory_kind or DEVICE) == kind:
            return x
        y = _copy(x, kind)
        x.delete()
        return y

    return jax.tree.map(one, tree)


@functools.partial(jax.jit, static_argnums=1)
def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    return x.astype(dtype)


def _export(value: jax.Array, transpose: bool, dtype: Any) -> jax.Array | KernelInOut | Owned:
    """One weight as exported (cast to ``dtype``: ``Owned``; ``KernelInOut`` when HF's is ``value.T``)."""
    cast = value.dtype != dtype
    if cast:
        value = _cast(value, dtype)
    out = KernelInOut(value) if transpose else value
    return Owned(out) if cast else out


class JaxTrainer:
    def __init__(self, model_dir: ModelDir, cfg: TrainConfig, opts: ModelOptions | None = None) -> None:
        self.cfg = cfg
        self.opts = ModelOptions.for_platform(jax.devices()[0].platform) if opts is None else opts
        self.config = model_dir.config
        self.names = list(model_dir.tensors)  # HF names, checkpoint order
        self.mesh = make_mesh(self.opts.tp)
        self.lora = cfg.lora_rank > 0
        self.export_dtype = model_dir_dtype(model_dir)  # what the engine holds (params may be wider)
        self.fns = make_step_fns(self.config, cfg, self.opts, self.mesh, self.export_dtype)
        self.dtypes = self.fns.dtypes  # stored / computed / optimised / exported (options.Dtypes)
        self.graphdef, self.trainable, self.frozen = load_state(model_dir, cfg, self.opts, self.mesh)
        self.linear_names = [n for n in linear_layers(self._model_view()) if n in set(self.names)]
        self.tx = self.fns.tx
        # every optimizer leaf on the mesh like its param (a jit over several device sets is refused)
        opt_state = jax.jit(self.tx.init)(self.trainable)
        self.opt_state = jax.tree.map(jax.device_put, opt_state, tree_shardings(opt_state, self.mesh))
        self.host_optimizer = self.opts.optimizer_memory == "host"
        if self.host_optimizer:  # in host memory for the whole run (host_optimizer.py)
            self.opt_state = _move(self.opt_state, HOST)
        self.ref_host: Any = None  # full fine-tune + KL: the initial params, on the host
        if cfg.loss.beta > 0 and not self.lora:
            self.ref_host = _copy(self.trainable, HOST)
        self.step = 0
        self._leaked: list[jax.Array] = []  # the ``leak_mb`` fault's buffers
        self._logp, self._grad = self.fns.logprob, self.fns.grad
        self._acc, self._apply = self.fns.accumulate, self.fns.apply

    # -- residency -----------------------------------------------------------------------
    def resident(self) -> dict[str, bool]:
        kind = lambda tree: all((x.sharding.memory_kind or DEVICE) == DEVICE for x in jax.tree.leaves(tree))  # noqa: E731
        return {PARAMS: kind((self.trainable, self.frozen)), OPTIMIZER: kind(self.opt_state)}

    def state_bytes(self) -> dict[str, int]:
        """Device bytes of the params and of the optimizer state (0 for state in host memory)."""
        return {
            PARAMS: self._bytes_on(DEVICE, (self.trainable, self.frozen)),
            OPTIMIZER: self._bytes_on(DEVICE, self.opt_state),
        }

    def offload(self, what: Sequence[str]) -> int:
        """Move ``params``/``optimizer`` to ``pinned_host``; returns the device bytes they held."""
        moved = 0
        for w in check_state_names(what):
            if w == PARAMS:
                moved += self._bytes_on(DEVICE, (self.trainable, self.frozen))
                if fault("offload_noop"):
                    continue
                self.trainable, self.frozen = _move(self.trainable, HOST), _move(self.frozen, HOST)
            elif not self.host_optimizer:
                moved += self._bytes_on(DEVICE, self.opt_state)
                self.opt_state = _move(self.opt_state, HOST)
        return moved

    def onload(self, what: Sequence[str]) -> int:
        """Move them back to the device; returns the device bytes they hold again."""
        moved = 0
        for w in check_state_names(what):
            if w == PARAMS:
                self.trainable, self.frozen = _move(self.trainable, DEVICE), _move(self.frozen, DEVICE)
                moved += device_bytes((self.trainable, self.frozen))
            elif not self.host_optimizer:  # host-resident state is streamed by the update instead
                self.opt_state = _move(self.opt_state, DEVICE)
                moved += device_bytes(self.opt_state)
        return moved

    @staticmethod
    def _bytes_on(kind: str, tree: Any) -> int:
        return device_bytes([x for x in jax.tree.leaves(tree) if (x.sharding.memory_kind or DEVICE) == kind])

    def _need(self, *what: str) -> None:
        if self.host_optimizer:  # its state is used from the host
            what = tuple(w for w in what if w != OPTIMIZER)
        require_resident(self.resident(), *what)

    # -- training ------------------------------------------------------------------------
    def _pad(self, batch: RolloutBatch, rows: int, t: int) -> dict[str, np.ndarray]:
        """Host arrays of exactly ``rows`` x ``t`` (zero rows / zero columns appended)."""
        b, t0 = batch.tokens.shape

        def pad(x: np.ndarray, dtype: Any) -> np.ndarray:
            out = np.zeros((rows, t) + x.shape[2:], dtype)
            out[:b, : min(t0, t)] = x[:, :t]
            return out

        return {
            "tokens": pad(batch.tokens, np.int32),
            "attn": pad(batch.attention_mask, bool),
            "loss_mask": pad(batch.loss_mask, bool),
            "old_logp": pad(batch.old_logp, np.float32),
            "is_weight": pad(batch.is_weight, np.float32),
            "adv": np.concatenate([batch.advantages.astype(np.float32), np.zeros(rows - b, np.float32)]),
        }

    def _micro_batches(self, batch: RolloutBatch) -> Iterator[dict[str, jax.Array]]:
        m = self.cfg.micro_batch_size
        t = -(-batch.tokens.shape[1] // T_BUCKET) * T_BUCKET
        rows = data_rows(self.mesh, m)  # split over the data axis, never repeated on every device
        sh = batch_sharding(self.mesh, rows)
        for s in range(0, batch.size, m):
            yield {
                k: jax.device_put(v, sh) for k, v in self._pad(batch.rows(slice(s, s + m)), rows, t).items()
            }

    def _ref_logp(self, mb: dict[str, jax.Array], ref: Any) -> jax.Array:
        logp = self._logp(ref, self.frozen, mb["tokens"], mb["attn"])
        return jnp.pad(logp, ((0, 0), (1, 0)))

    def _accumulate(self, acc: Any, grads: Any) -> Any:
        """``acc + grads`` in the trainable params' dtype (``grads`` come in the compute dtype)."""
        if acc is not None:
            return self._acc(acc, grads)
        pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(self.trainable), strict=True)
        return (
            grads if all(g.dtype == p.dtype for g, p in pairs) else self.fns.start_acc(grads, self.trainable)
        )

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """``mini_batches`` AdamW updates over ``batch`` with exact gradient accumulation."""
        self._need(PARAMS, OPTIMIZER)
        if fault("train_oom"):
            raise RuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate (injected: train_oom)"
            )
        leak = fault_value("leak_mb")
        if leak:  # a device buffer kept forever: the memory plan's audit must see it
            self._leaked.append(
                jax.device_put(jnp.ones(int(leak) * 2**18, jnp.float32), self.mesh.devices.flat[0])
            )
        t0, ref = time.perf_counter(), None
        if self.cfg.loss.beta > 0:
            ref = jax.tree.map(jnp.zeros_like, self.trainable) if self.lora else _copy(self.ref_host, DEVICE)
        # device scalars, read back once after the loop (no host sync per micro-batch)
        losses: list[jax.Array] = []
        metric_sums: list[dict[str, jax.Array]] = []
        gnorms_dev: list[jax.Array] = []
        parts = np.array_split(np.arange(batch.size), self.cfg.mini_batches)
        for rows in parts:
            if not len(rows):
                continue
            mini = batch.rows(slice(int(rows[0]), int(rows[-1]) + 1))
            total_tokens = jnp.float32(max(int(mini.loss_mask[:, 1:].sum()), 1))
            total_seqs = jnp.float32(seq_count(mini.loss_mask[:, 1:], self.cfg.loss))
            acc = None
            for mb in self._micro_batches(mini):
                if ref is not None:
                    mb["ref_logp"] = self._ref_logp(mb, ref)
                (loss, sums), grads = self._grad(self.trainable, self.frozen, mb, total_tokens, total_seqs)
                acc = self._accumulate(acc, grads)
                del grads  # a micro-batch's own gradient is gone before the next one or the update
                losses.append(loss)
                metric_sums.append(sums)
            if self.host_optimizer:
                self.trainable, self.opt_state, gnorm = host_optimizer.apply(
                    self.fns, self.trainable, self.opt_state, acc
                )
            else:
                self.trainable, self.opt_state, gnorm = self._apply(self.trainable, self.opt_state, acc)
            gnorms_dev.append(gnorm)
        host_losses, host_sums, host_gnorms = jax.device_get((losses, metric_sums, gnorms_dev))
        totals: dict[str, float] = {}
        for mb_sums in host_sums:
            for k, v in mb_sums.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        if ref is not None:
            jax.tree.map(lambda x: x.delete(), ref)
        self.step += 1
        loss_sum = sum(float(x) for x in host_losses)
        return train_metrics(
            loss_sum, len(parts), [float(g) for g in host_gnorms], totals, time.perf_counter() - t0
        )

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        self._need(PARAMS)
        out, m = [], self.cfg.micro_batch_size
        for k, mb in enumerate(self._micro_batches(batch)):  # each padded: its real rows come first
            out.append(to_host(self._ref_logp(mb, self.trainable))[: min(m, batch.size - k * m)])
        logp = np.concatenate(out)[:, : batch.tokens.shape[1]]
        return np.where(batch.attention_mask, logp, 0.0).astype(np.float32)

    def greedy(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy re-forward of ``prompt`` (the garbage guard's): (tokens [n'], top-2 margins [n'])."""
        self._need(PARAMS)
        length = len(prompt) + n
        toks = np.zeros((1, length), np.int32)  # one shape for every step: compiled once

        def step(ids: list[int]) -> tuple[int, float]:
            i = len(ids)
            toks[0, :i] = ids
            attn = jnp.asarray(np.arange(length)[None] < i)
            logits = self.fns.next_logits(
                self.trainable, self.frozen, jnp.asarray(toks), attn, jnp.int32(i - 1)
            )
            row = to_host(logits)[0]
            top2 = np.sort(row)[-2:]
            return int(row.argmax()), float(top2[1] - top2[0])

        return greedy_loop(step, prompt, n, self.config.eos_token_id)

    # -- weights for the engine ----------------------------------------------------------
    def _model_view(self) -> Qwen3:
        return nnx.merge(self.graphdef, self.trainable, self.frozen)

    def _engine_layout(self, model: Qwen3, name: str, lins: dict[str, Any]) -> tuple[jax.Array, bool]:
        """The weight ``name`` as stored in our model (kernels [in, out]; LoRA merged)."""
        return (lins[name].merged_kernel(), True) if self.lora and name in lins else get_weight(model, name)

    def export_names(self, full: bool = True) -> list[str]:
        """Full: every weight. Partial (LoRA only): the linear layers the adapters change."""
        return list(self.names) if full or not self.lora else list(self.linear_names)

    def export_weights(self, full: bool = True) -> WeightExport:
        """HF-named jax arrays in ``export_dtype``, one at a time, kernels as ``KernelInOut``;
        a copy (LoRA merged, a stacked layer's row, a cast) lives only while the engine places it."""
        self._need(PARAMS)
        names = self.export_names(full)
        model = self._model_view()
        lins = linear_layers(model)
        sums: dict[str, tuple[jax.Array, jax.Array]] = {}

        def gen() -> Iterator[tuple[str, jax.Array | KernelInOut]]:
            for name in names:  # no local holds the uncast weight across the yield
                value = _export(*self._engine_layout(model, name, lins), self.export_dtype)
                sums[name] = tensor_sums(array_of(value))  # dispatched, read once at the end
                yield name, value
                del value

        return WeightExport(names, gen(), full=full or not self.lora, fingerprint=lambda: read_sums(sums))

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        self._need(PARAMS)
        model = self._model_view()
        lins = linear_layers(model)
        fp: Fingerprint = {}
        for name in self.names if names is None else names:  # one copy at a time
            value = self._engine_layout(model, name, lins)[0].astype(self.export_dtype)
            fp.update(read_sums({name: tensor_sums(value)}))
        return fp

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Orbax checkpoint of the trainable params and optimizer state (not the LoRA base)."""
        self.snapshot(path).write()

    def snapshot(self, path: Path) -> AsyncSave:
        """``save`` begun asynchronously: returns once the state is in host memory."""
        self._need(PARAMS, OPTIMIZER)
        target = Path(path).resolve() / "state"
        if target.exists():
            shutil.rmtree(target)
        state = {"trainable": self.trainable, "opt_state": self.opt_state}
        return AsyncSave(target, state, compress=self.cfg.checkpoint_compression)

    def restore(self, path: Path) -> None:
        """Load a ``save`` into the layout it was written from (else ValueError saying so)."""
        import orbax.checkpoint as ocp

        self._need(PARAMS, OPTIMIZER)
        target = {"trainable": self.trainable, "opt_state": self.opt_state}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        try:
            state = ocp.StandardCheckpointer().restore(Path(path).resolve() / "state", abstract)
        except ValueError as e:
            if "tree structures do not match" not in str(e):
                raise
            raise ValueError(
                f"{path}: the checkpoint's state is laid out unlike this trainer's (scan_layers="
                f"{self.opts.scan_layers}, lora_rank={self.cfg.lora_rank}); resume with the model "
                "options it was written with (--model-option scan_layers=..., --lora-rank)"
            ) from None
        self.trainable, self.opt_state = state["trainable"], state["opt_state"]
