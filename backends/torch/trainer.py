"""Torch trainer: ``mllm_rl.trainer.Trainer`` on our torch Qwen3 as ``backends/jax/trainer.py``
behaves: ``torch.optim.AdamW`` (state created at init), exact gradient accumulation, optional LoRA,
``torch.save`` checkpoints, offload to pinned CPU memory. Shapes: B sequences, T positions
(right-padded to a multiple of ``T_BUCKET``), V vocab.

A 16-bit checkpoint under ``mixed`` precision (default) trains float32 masters and moments and
computes on casts in its dtype (an update of ~1e-6 is below half a bf16 ulp of a ~0.02 weight);
``pure``: all in its dtype. Several processes: FSDP2 (``fsdp.py``), or with ``fsdp`` 1 data parallel.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from mllm_rl.backends.torch import distributed as dist
from mllm_rl.backends.torch import fsdp
from mllm_rl.backends.torch.engine import read_sums, tensor_sums
from mllm_rl.backends.torch.lora import LoRALinear, add_lora, disabled, linear_layers, merge
from mllm_rl.backends.torch.model import Qwen3, checkpoint_dtype, load_qwen3
from mllm_rl.backends.torch.offload import OffloadGroup, device_tensor, host_copy, storage_bytes
from mllm_rl.backends.torch.options import TorchModelOptions
from mllm_rl.backends.torch.probe import track
from mllm_rl.backends.torch.rl_loss import policy_loss
from mllm_rl.backends.torch.state_file import STATE_FILE, load_state, tensors_of, write_state
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import Fingerprint, WeightExport
from mllm_rl.faults import fault, fault_value
from mllm_rl.rl.loss_config import seq_count
from mllm_rl.trainer import (
    OPTIMIZER,
    PARAMS,
    Manifest,
    RolloutBatch,
    TrainConfig,
    TrainerStateError,  # noqa: F401 - raised by _need, imported from here by callers
    check_state_names,
    greedy_loop,
    require_resident,
    train_metrics,
)

T_BUCKET = 32
HALF_DTYPES = (torch.bfloat16, torch.float16)  # 16-bit checkpoints: float32 masters under mixed precision
# the optimizer's implementation choice in a param group: this trainer's (``adamw``), never a checkpoint's
IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")
LAYER_PREFIX = "model.layers."  # the decoder layers' parameter names (HF layout)


class TorchTrainer:
    def __init__(
        self,
        model_dir: ModelDir,
        cfg: TrainConfig,
        device: str | torch.device = "cpu",
        model: Qwen3 | None = None,
        shard_over: tuple[Any, dist.Procs] | None = None,
    ) -> None:
        """``model``: a ``Qwen3`` in ``model_dir``'s layout (else loaded). ``shard_over``: (device mesh,
        this process's place) instead of the run's processes (the planner's fake process group)."""
        self.cfg = cfg
        mesh, procs = shard_over if shard_over is not None else (None, dist.procs())
        self.dp = procs
        # FSDP2 over the processes, else each holds the whole trainer (data parallel)
        self.sharded = mesh is not None or fsdp.resolve(cfg.fsdp, self.dp.count)
        self.options = TorchModelOptions.from_pairs(cfg.model_options)
        self.config = model_dir.config
        self.device = torch.device(device)
        self.names = list(model_dir.tensors)  # HF names, checkpoint order
        self.lora = cfg.lora_rank > 0
        # the checkpoint's dtype: what the engine holds, what forwards compute in
        self.param_dtype = self.compute_dtype = checkpoint_dtype(model_dir)
        self.mixed = cfg.precision == "mixed" and self.param_dtype in HALF_DTYPES
        self.master_dtype = torch.float32 if self.mixed else self.param_dtype  # the trainable params'
        base_dtype = self.param_dtype if self.lora else self.master_dtype  # a LoRA base never trains
        if model is None:
            model = load_qwen3(model_dir, dtype=base_dtype, device=str(self.device))
        self.model = _to_dtype(model, base_dtype)
        self.model.remat = self.options.remat
        # mixed full fine-tune with remat: each layer casts its masters inside its checkpoint
        self.layer_casts = self.mixed and not self.lora and self.options.remat and not self.sharded
        self.model.layer_dtype = self.compute_dtype if self.layer_casts else None
        if self.lora:
            self.adapters: dict[str, LoRALinear] = add_lora(
                self.model, cfg.lora_rank, cfg.lora_alpha, cfg.seed, dtype=self.master_dtype
            )
        else:
            self.adapters = {}
            self.model.requires_grad_(True)
        self.linear_names = [n for n in linear_layers(self.model) if n in set(self.names)]
        if self.sharded:
            # every param becomes a DTensor shard (the names stay); mixed: gathered in the compute dtype
            mesh = fsdp.make_mesh(self.dp.count, self.device) if mesh is None else mesh
            fsdp.shard(self.model, mesh, self.compute_dtype if self.mixed else None)
        self.params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self.trainable = {n: p for n, p in self.params.items() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(
            list(self.trainable.values()),
            lr=cfg.lr,
            betas=(cfg.adam_b1, cfg.adam_b2),
            eps=1e-8,
            weight_decay=cfg.weight_decay,
            **self.options.adamw_kwargs(self.device.type),
        )
        _init_optimizer_state(self.optimizer)
        # full fine-tune + KL: the initial params in the compute dtype (exact: the checkpoint's), on the host
        self.ref_host: dict[str, Any] | None = None
        if cfg.loss.beta > 0 and not self.lora:  # sharded: this process's shards
            self.ref_host = {
                n: host_copy(fsdp.local(p).detach().to(self.compute_dtype), self.device)
                for n, p in self.trainable.items()
            }
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._groups = {w: OffloadGroup(w, self.device) for w in (PARAMS, OPTIMIZER)}
        self.step = 0
        self._leaked: list[torch.Tensor] = []  # the ``leak_mb`` fault's buffers
        track(self)  # the CPU memory probe counts held_tensors()

    def held_tensors(self) -> list[torch.Tensor]:
        """Params and optimizer state (offloaded: empty storages), and what ``leak_mb`` keeps."""
        return self._tensors(PARAMS) + self._tensors(OPTIMIZER) + self._leaked

    # -- residency -----------------------------------------------------------------------
    def _tensors(self, what: str) -> list[torch.Tensor]:
        """The tensors of ``what`` this process holds (sharded: its shards)."""
        if what == PARAMS:
            return [fsdp.local(p) for p in self.params.values()]
        return [
            fsdp.local(t)
            for st in self.optimizer.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        ]

    def resident(self) -> dict[str, bool]:
        return {w: g.resident for w, g in self._groups.items()}

    def state_bytes(self) -> dict[str, int]:
        """Device bytes the params / the optimizer state hold now (0 while offloaded)."""
        return {w: storage_bytes(self._tensors(w), self.device) for w in (PARAMS, OPTIMIZER)}

    def offload(self, what: Sequence[str]) -> int:
        """Move ``params``/``optimizer`` to host memory; returns the device bytes they held."""
        moved = 0
        for w in check_state_names(what):
            if w == PARAMS and fault("offload_noop"):  # says it moved them, moves nothing
                moved += storage_bytes(self._tensors(w), self.device)
                continue
            moved += self._groups[w].offload(self._tensors(w))
        return moved

    def onload(self, what: Sequence[str]) -> int:
        """Bring them back to the device; returns the device bytes they hold again."""
        moved = 0
        for w in check_state_names(what):
            self._groups[w].onload()
            moved += storage_bytes(self._tensors(w), self.device)
        return moved

    def _need(self, *what: str) -> None:
        require_resident(self.resident(), *what)

    # -- training ------------------------------------------------------------------------
    def _micro_batches(self, batch: RolloutBatch) -> Iterator[dict[str, torch.Tensor]]:
        """Device tensors of at most ``micro_batch_size`` rows, T padded to a multiple of ``T_BUCKET``;
        ``attn`` only where a row has padding before a real token (right padding needs no mask)."""
        m = self.cfg.micro_batch_size
        t0 = batch.tokens.shape[1]
        t = -(-t0 // T_BUCKET) * T_BUCKET

        def pad(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            out = torch.zeros((x.shape[0], t), dtype=dtype)
            out[:, :t0] = torch.from_numpy(np.ascontiguousarray(x))
            return out.to(self.device, non_blocking=True)

        for s in range(0, batch.size, m):
            mb = batch.rows(slice(s, s + m))
            out = {
                "tokens": pad(mb.tokens.astype(np.int64), torch.long),
                "loss_mask": pad(mb.loss_mask, torch.bool),
                "old_logp": pad(mb.old_logp.astype(np.float32), torch.float32),
                "is_weight": pad(mb.is_weight.astype(np.float32), torch.float32),
                "adv": torch.from_numpy(mb.advantages.astype(np.float32)).to(self.device),
            }
            if not right_padded(mb.attention_mask):  # decided on the host: the model needs no mask
                out["attn"] = pad(mb.attention_mask, torch.bool)
            yield out

    def _compute_params(self, layers: bool = True) -> dict[str, torch.Tensor]:
        """What a forward swaps into the model: for a mixed full fine-tune, differentiable casts of
        the masters; otherwise nothing. ``layers=False``: not the layers' (``Qwen3.layer_dtype``)."""
        if not self.mixed or self.lora or self.sharded:
            return {}
        return {
            n: p.to(self.compute_dtype)
            for n, p in self.trainable.items()
            if layers or not n.startswith(LAYER_PREFIX)
        }

    def _forward(self, args: tuple, params: dict | None = None, **kwargs: Any) -> torch.Tensor:
        """The model on ``args`` under ``params`` (default ``_compute_params()``): float32 logits, or
        log-probs with ``targets``."""
        params = self._compute_params() if params is None else params
        return functional_call(self.model, params, args, kwargs) if params else self.model(*args, **kwargs)

    def _token_logp(self, tokens: torch.Tensor, attn, params: dict | None = None) -> torch.Tensor:
        """[B, T] -> log p(tokens[:, t] | tokens[:, :t]) / temperature-softmax, [B, T - 1] float32."""
        args = (tokens[:, :-1], None if attn is None else attn[:, :-1])
        return self._forward(args, params, targets=tokens[:, 1:], temperature=self.cfg.temperature)

    @torch.no_grad()
    def _ref_logp(self, mb: dict[str, torch.Tensor], ref: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The reference policy's [B, T - 1] log-probs: initial params, or LoRA adapters off."""
        if self.lora or self.sharded:
            with disabled(self.model) if self.lora else self._shards_replaced(ref):
                return self._token_logp(mb["tokens"], mb.get("attn"))
        return self._token_logp(mb["tokens"], mb.get("attn"), ref)

    @contextlib.contextmanager
    def _shards_replaced(self, values: dict[str, torch.Tensor]) -> Iterator[None]:
        """Inside the block the trainable params' local shards hold ``values`` (the KL reference)."""
        with torch.no_grad():
            shards = {n: fsdp.local(self.trainable[n]) for n in values}
            saved = {n: t.clone() for n, t in shards.items()}
            try:
                for n, t in shards.items():
                    t.copy_(values[n])
                yield
            finally:
                for n, t in shards.items():
                    t.copy_(saved[n])

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """``mini_batches`` AdamW updates over ``batch`` with exact gradient accumulation."""
        t0 = time.perf_counter()
        leak = fault_value("leak_mb")
        if leak:  # a device buffer kept forever: the memory plan's audit must see it
            self._leaked.append(torch.ones(int(leak) * 2**18, dtype=torch.float32, device=self.device))
        loss_sum, parts, gnorms, totals = self.device_step(batch)
        host = {k: float(v) for k, v in totals.items()}
        grad_norms = [float(g) for g in gnorms]
        return train_metrics(float(loss_sum), parts, grad_norms, host, time.perf_counter() - t0)

    def device_step(
        self, batch: RolloutBatch
    ) -> tuple[torch.Tensor, int, list[torch.Tensor], dict[str, torch.Tensor]]:
        """``train_step`` without reading back (the planner runs it on fake tensors): (loss sum,
        mini-batches, pre-clip grad norms, token-weighted metric sums) as device scalars."""
        self._need(PARAMS, OPTIMIZER)
        if fault("train_oom"):
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 1.00 GiB (injected: train_oom)"
            )
        cfg = self.cfg
        ref = None
        if cfg.loss.beta > 0 and not self.lora:
            assert self.ref_host is not None
            ref = {
                n: device_tensor(h, fsdp.local(self.trainable[n]), self.compute_dtype)
                for n, h in self.ref_host.items()
            }
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        totals: dict[str, torch.Tensor] = {}
        loss_sum, gnorms = zero.clone(), []
        parts = np.array_split(np.arange(batch.size), cfg.mini_batches)
        for rows in parts:
            if not len(rows):
                continue
            mini = batch.rows(slice(int(rows[0]), int(rows[-1]) + 1))
            total_tokens = float(max(int(mini.loss_mask[:, 1:].sum()), 1))
            total_seqs = seq_count(mini.loss_mask[:, 1:], cfg.loss)
            self.optimizer.zero_grad(set_to_none=True)
            for _, mb, weight in self._my_micro_batches(mini):
                ref_logp = self._ref_logp(mb, ref) if cfg.loss.beta > 0 else None
                logp = self._token_logp(
                    mb["tokens"], mb.get("attn"), self._compute_params(not self.layer_casts)
                )
                mask = mb["loss_mask"][:, 1:]
                args = (logp, mb["old_logp"][:, 1:], mb["adv"], mask, cfg.loss, ref_logp)
                loss, m = policy_loss(*args, total_tokens, total_seqs, mb["is_weight"][:, 1:])
                if not weight:  # a sharded process without a micro-batch of its own: zero gradients
                    (loss * 0.0).backward()
                    continue
                loss.backward()
                n = mask.sum().double()
                sums = {k: v.double() * n for k, v in m.items()}  # token-weighted, summed over micro-batches
                sums["tokens"] = n
                sums["entropy_proxy"] = -(logp.detach().double() * mask).sum()  # sum of -log p
                loss_sum += loss.detach().double()
                for k, v in sums.items():
                    totals[k] = totals.get(k, zero) + v
            gnorms.append(self._apply())
        del ref
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.dp.count > 1:  # every process's share of the loss and the metric sums
            names = sorted({k for keys in dist.gather_objects(sorted(totals)) for k in keys})
            for k in names:  # a process without a micro-batch has none of the metrics
                totals.setdefault(k, zero.clone())
            dist.all_reduce_sum([loss_sum, *(totals[k] for k in names)])
        return loss_sum, len(parts), gnorms, totals

    def _my_micro_batches(self, mini: RolloutBatch) -> Iterator[tuple[int, dict[str, torch.Tensor], float]]:
        """This process's micro-batches of ``mini`` as (index, tensors, weight), dealt round-robin.
        Sharded, every process runs as many as the busiest (padding with weight-0 repeats)."""
        count, index = self.dp.count, self.dp.index
        n = -(-mini.size // self.cfg.micro_batch_size)
        first: dict[str, torch.Tensor] | None = None
        mine = 0
        for k, mb in enumerate(self._micro_batches(mini)):
            first = mb if first is None else first
            if k % count == index:
                mine += 1
                yield k, mb, 1.0
        if self.sharded and first is not None:
            for _ in range(-(-n // count) - mine):
                yield 0, first, 0.0

    def _apply(self) -> torch.Tensor:
        """Global-norm clipping (as optax) and one AdamW step; returns the pre-clip norm."""
        params = list(self.trainable.values())
        for p in params:  # an unused parameter gets a zero gradient (optax updates every leaf)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.sharded:  # FSDP2 reduce-scattered (summed) every backward into these shards
            grads = [fsdp.local(p.grad) for p in params]
            norm = fsdp.grad_norm(grads)
        else:
            grads = [p.grad for p in params]
            dist.all_reduce_sum(grads)  # data parallel
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if self.cfg.grad_clip > 0:
            coef = torch.where(norm < self.cfg.grad_clip, torch.ones_like(norm), self.cfg.grad_clip / norm)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        self.optimizer.step()
        return norm

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        """Log-prob of ``tokens[b, t]`` given ``tokens[b, :t]``, [B, T] float32 (0 at t = 0, padding)."""
        self._need(PARAMS)
        params = self._compute_params()  # cast once for every micro-batch
        mine: dict[int, np.ndarray] = {}
        for k, mb, weight in self._my_micro_batches(batch):
            lp = torch.nn.functional.pad(self._token_logp(mb["tokens"], mb.get("attn"), params), (1, 0))
            if weight:
                mine[k] = lp.cpu().numpy()
        parts = {k: v for got in dist.gather_objects(mine) for k, v in got.items()}
        logp = np.concatenate([parts[k] for k in sorted(parts)])[:, : batch.tokens.shape[1]]
        return np.where(batch.attention_mask, logp, 0.0).astype(np.float32)

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy continuation of ``prompt`` by full re-forward (the garbage guard's reference),
        untempered. Returns (tokens [n'], top-2 logit margins [n']); stops after EOS."""
        self._need(PARAMS)
        params = self._compute_params()

        def step(ids: list[int]) -> tuple[int, float]:
            row = self._forward((torch.tensor([ids], device=self.device),), params)[0, -1]  # [V] float32
            top2 = torch.topk(row, 2).values
            return int(row.argmax()), float(top2[0] - top2[1])

        return greedy_loop(step, prompt, n, self.config.eos_token_id)

    # -- weights for the engine ----------------------------------------------------------
    def _engine_tensor(self, name: str) -> torch.Tensor:
        """The weight ``name`` as the engine holds it (sharded: gathered, a collective)."""
        if name in self.adapters:  # the merged weight, computed in float32
            a = self.adapters[name]
            return merge(*(fsdp.full(t.detach()) for t in (a.weight, a.lora_a, a.lora_b)), a.scale)
        with torch.no_grad():
            return fsdp.full(self.params[name].detach().to(self.param_dtype))

    def export_names(self, full: bool = True) -> list[str]:
        """Full: every weight. Partial (LoRA only): the linear layers the adapters change."""
        return list(self.names) if full or not self.lora else list(self.linear_names)

    def export_weights(self, full: bool = True) -> WeightExport:
        """HF-named tensors in the checkpoint dtype, one at a time (a merged or cast copy briefly)."""
        self._need(PARAMS)
        names = self.export_names(full)
        sums: dict[str, torch.Tensor] = {}

        def gen() -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                value = self._engine_tensor(name)
                with torch.no_grad():
                    sums[name] = tensor_sums(value)  # the fingerprint in the same pass
                yield name, value
                del value

        return WeightExport(names, gen(), full=full or not self.lora, fingerprint=lambda: read_sums(sums))

    @torch.no_grad()
    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        """(sum, sumsq) of what ``export_weights`` sends (the engine's ``tensor_sums``)."""
        self._need(PARAMS)
        sums = {
            name: tensor_sums(self._engine_tensor(name))
            for name in (names if names is not None else self.names)
        }
        return read_sums(sums)

    # -- checkpoints ---------------------------------------------------------------------
    def _state(self, copy: Any) -> dict[str, Any]:
        """What ``save`` writes, each tensor through ``copy``."""
        opt = self.optimizer.state_dict()
        opt["state"] = {
            i: {k: copy(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for i, st in opt["state"].items()
        }
        return {
            "lora_rank": self.cfg.lora_rank,
            "precision": self.cfg.precision,
            "trainable": {n: copy(p.detach()) for n, p in self.trainable.items()},
            "optimizer": opt,
            "step": self.step,
        }

    def save(self, path: Path) -> Manifest | None:
        """``<path>/state.pt`` written by process 0 (not the LoRA base); sharded: ``<path>/dcp``."""
        self._need(PARAMS, OPTIMIZER)
        if self.sharded:
            fsdp.save(self._dcp_state(), Path(path))
        elif self.dp.index == 0:
            return write_state(self._state(lambda t: t), Path(path))
        return None

    def _dcp_state(self) -> dict[str, Any]:
        """The state DCP writes and loads in place: trainable params, AdamW state by name, meta."""
        by_param = {p: n for n, p in self.trainable.items()}
        return {
            "trainable": dict(self.trainable),
            "optimizer": {by_param[p]: st for p, st in self.optimizer.state.items()},
            "meta": {"lora_rank": self.cfg.lora_rank, "precision": self.cfg.precision, "step": self.step},
        }

    @torch.no_grad()
    def snapshot(self, path: Path | None = None) -> StateSnapshot:
        """``save``'s state copied to host memory, for a background write (``checkpoint.writer``)."""
        self._need(PARAMS, OPTIMIZER)
        if self.sharded:
            raise ValueError(
                "--checkpoint-background: not with a sharded trainer (every process writes its shards)"
            )
        return StateSnapshot(self._state(lambda t: t.detach().to("cpu", copy=True)))

    def restore(self, path: Path) -> None:
        """Load what ``save`` wrote, keeping this trainer's AdamW implementation and counter placement."""
        self._need(PARAMS, OPTIMIZER)
        target = Path(path) / STATE_FILE
        if fsdp.has_checkpoint(path):
            self._restore_dcp(Path(path))
            return
        if not target.exists():
            raise ValueError(f"{target}: no trainer state here")
        if self.sharded:
            raise ValueError(
                f"{target}: written by an unsharded trainer; resume it with --fsdp 1 (this run shards over "
                f"{self.dp.count} processes)"
            )
        state = load_state(Path(path), map_location=self.device)
        saved = state["trainable"]
        if set(saved) != set(self.trainable):
            raise ValueError(
                f"{target}: written with lora_rank {state.get('lora_rank')}, this trainer has "
                f"lora_rank {self.cfg.lora_rank} (trainable parameters differ)"
            )
        for n, p in self.trainable.items():
            if saved[n].dtype != p.dtype:
                self._precision_refused(target, saved[n].dtype, state.get("precision", "unknown"))
            if saved[n].shape != p.shape:
                raise ValueError(
                    f"{target}: {n} is {saved[n].dtype}{tuple(saved[n].shape)}, "
                    f"the model's is {p.dtype}{tuple(p.shape)}"
                )
        with torch.no_grad():
            for n, p in self.trainable.items():
                p.copy_(saved[n])
        impl = [{k: g[k] for k in IMPL_KEYS} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for g, own in zip(self.optimizer.param_groups, impl, strict=True):
            g.update(own)
            for p in g["params"]:
                st = self.optimizer.state.get(p, {})
                # own, resizable storages (offload resizes them), not the file's
                for k, v in st.items():
                    if k == "step" and isinstance(v, torch.Tensor):
                        st[k] = v.to(device=_step_device(g, p), dtype=torch.float32, copy=True)
                    elif isinstance(v, torch.Tensor):
                        st[k] = v.clone()
        self.step = int(state.get("step", 0))

    def _precision_refused(self, where: Path, saved: torch.dtype, precision: str) -> None:
        """``ValueError``: ``where`` holds trainable params in ``saved``, not this trainer's dtype."""
        own = next(iter(self.trainable.values())).dtype
        raise ValueError(
            f"{where}: trainable params saved in {saved} (precision {precision!r}), this trainer's are {own} "
            f"(precision {self.cfg.precision!r} on a {self.param_dtype} checkpoint); resume with the precision "
            "it was written with"
        )

    def _restore_dcp(self, path: Path) -> None:
        """Load ``<path>/dcp`` into this trainer's tensors, resharded (LoRA rank and precision checked)."""
        import torch.distributed.checkpoint as dcp

        where = path / fsdp.DCP_DIR
        saved = dcp.FileSystemReader(str(where)).read_metadata().state_dict_metadata
        mine = {f"trainable.{n}" for n in self.trainable}
        theirs = {k for k in saved if k.startswith("trainable.")}
        if mine != theirs:
            raise ValueError(
                f"{where}: its trainable parameters differ from this trainer's (lora_rank {self.cfg.lora_rank}): "
                f"e.g. {sorted(mine ^ theirs)[0]}"
            )
        for n, p in self.trainable.items():
            dtype = getattr(getattr(saved[f"trainable.{n}"], "properties", None), "dtype", None)
            if dtype is not None and dtype != p.dtype:
                self._precision_refused(where, dtype, "unknown")
        state = self._dcp_state()
        fsdp.load(state, path)
        for g in self.optimizer.param_groups:  # the counters where this trainer's AdamW keeps them
            for p in g["params"]:
                st = self.optimizer.state[p]
                st["step"] = st["step"].to(device=_step_device(g, p), dtype=torch.float32)
        self.step = int(state["meta"]["step"])


class StateSnapshot:
    """A ``TorchTrainer.snapshot``: host tensors only, written as ``save`` writes them."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))

    def write(self, path: Path) -> Manifest:
        return write_state(self.state, Path(path))


def right_padded(mask: np.ndarray) -> bool:
    """Whether every row of ``mask`` [B, T] is real tokens then padding (causal needs no mask)."""
    m = np.asarray(mask, bool)
    return bool((m[:, 1:] <= m[:, :-1]).all())


def _to_dtype(model: Qwen3, dtype: torch.dtype) -> Qwen3:
    """``model`` with every parameter in ``dtype``, in place (``Module.to`` cannot swap fake tensors)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


def _step_device(group: dict[str, Any], p: torch.Tensor) -> torch.device:
    """Where AdamW keeps ``p``'s ``step`` counter: ``p``'s device if fused or capturable, else host."""
    return p.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's state now: a step with zero grads and ``lr = 0``, counters back to 0."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    for st in opt.state.values():
        st["step"].zero_()
    opt.zero_grad(set_to_none=True)
