"""The embedded torch rollout engine: ``EnginePrimitives`` on our torch Qwen3 (CPU or one CUDA device).

Seeded dummy weights (uniform in [-1e-3, 1e-3]) at start. One KV pool [L, 2, max_total_tokens, K,
D]: B prompts use B left-padded rows of longest prompt + max new tokens; the rest runs in later
sub-batches. Request i samples from its own generator (``request_seeds``); several processes each
generate a slice and share the outputs. ``update_weights`` copies into the existing storages
(stable addresses for torch_memory_saver).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from mllm_rl.backends.torch import distributed as dist
from mllm_rl.backends.torch.memory import make_memory
from mllm_rl.backends.torch.model import KVCache, build_qwen3, checkpoint_dtype, to_torch
from mllm_rl.backends.torch.probe import track
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import (
    ABORT,
    TAG_KV,
    TAG_WEIGHTS,
    Fingerprint,
    GenerateOutput,
    Placed,
    SamplingParams,
    UpdateStats,
    request_seeds,
)
from mllm_rl.faults import fault

SYNC_EVERY = 8  # decode steps between two "has every row ended?" reads on an accelerator
_FP_CHUNK = 1 << 20  # elements per fingerprint slice (bounds the float32 temporary of bf16 weights)


def tensor_sums(x: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares] of ``x``, float64 on its device: float32 per 2**20-element slice."""
    acc = torch.zeros(2, dtype=torch.float64, device=x.device)
    flat = x.detach().reshape(-1)
    f32 = _f32_piece(flat)
    for part in flat.split(_FP_CHUNK):
        p32 = part if f32 is None else f32[: part.numel()].copy_(part)
        acc[0] += p32.sum()
        acc[1] += torch.dot(p32, p32)
    return acc


def _f32_piece(x: torch.Tensor) -> torch.Tensor | None:
    """One float32 piece for every ``_FP_CHUNK`` slice of ``x`` (None: ``x`` is float32 already): a
    fresh one per slice costs the CPU the page faults of a new 4 MiB allocation each time."""
    return None if x.dtype == torch.float32 else torch.empty(min(x.numel(), _FP_CHUNK), device=x.device)


def copy_with_sums(dst: torch.Tensor, src: torch.Tensor, write: bool = True) -> torch.Tensor:
    """``dst.copy_(src)`` (``src``: ``dst``'s shape, any dtype, ``dst``'s device) in ``_FP_CHUNK``-
    element pieces, each piece's [sum, sum of squares] read from ``dst`` right after its copy,
    while it is still in cache: one pass over ``src`` (a memory-mapped checkpoint, an export, a
    staged slice) and the fingerprint of what the engine now holds. ``write`` False: the sums of
    ``src`` in ``dst``'s dtype, nothing written. Returns ``tensor_sums``' float64 pair."""
    if not dst.is_contiguous():
        if write:
            dst.copy_(src)
        return tensor_sums(dst if write else src.to(dst.dtype))
    acc = torch.zeros(2, dtype=torch.float64, device=dst.device)
    d, s = dst.view(-1), src.detach().reshape(-1)
    f32 = _f32_piece(d)
    for off in range(0, d.numel(), _FP_CHUNK):
        piece = d[off : off + _FP_CHUNK]
        if write:
            piece.copy_(s[off : off + _FP_CHUNK])
        else:
            piece = s[off : off + _FP_CHUNK].to(dst.dtype)
        p32 = piece if f32 is None else f32[: piece.numel()].copy_(piece)
        acc[0] += p32.sum()
        acc[1] += torch.dot(p32, p32)
    return acc


def read_sums(sums: dict[str, torch.Tensor]) -> Fingerprint:
    """``tensor_sums`` of every name, read to the host in one transfer."""
    if not sums:
        return {}
    host = torch.stack(list(sums.values())).cpu().tolist()
    return {n: (float(s), float(q)) for n, (s, q) in zip(sums, host, strict=True)}


class EmbeddedEngine:
    """Implements ``mllm_rl.engine.EnginePrimitives`` (see the module docstring)."""

    tags = (TAG_WEIGHTS, TAG_KV)

    def __init__(
        self,
        model: ModelDir,
        tp: int = 1,
        max_total_tokens: int = 4096,
        context_length: int = 512,
        seed: int = 0,
        chunk_bytes: int = 64 * 2**20,
        weights_cpu_backup: bool = False,
        device: str | torch.device | None = None,
        max_running_requests: int = 128,
        task: str | None = None,
    ) -> None:
        if tp != 1:
            raise ValueError(
                f"--tp {tp}: the embedded torch engine runs on one device (SGLang serves tp > 1)"
            )
        if context_length < 2 or max_total_tokens < context_length:
            raise ValueError(
                f"--context-length {context_length} / --max-total-tokens {max_total_tokens}: "
                "need 2 <= context_length <= max_total_tokens"
            )
        if max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {max_running_requests}")
        self.model_dir = model
        self.config = c = model.config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = checkpoint_dtype(model)
        self.max_total_tokens = max_total_tokens
        self.context_length = context_length
        self.max_running_requests = max_running_requests
        self.chunk_bytes = chunk_bytes
        self.weights_cpu_backup = weights_cpu_backup
        self.memory = make_memory(self.device, task)  # task: its tags are <task>/weights, <task>/kv_cache
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            with self.memory.region(TAG_WEIGHTS, cpu_backup=weights_cpu_backup):
                self.model = build_qwen3(c, self.dtype, "meta").to_empty(device=self.device).eval()
                self.model.requires_grad_(False)  # inference only
                for p in self.model.parameters():  # dummy weights, generated on the host
                    p.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=gen))
            with self.memory.region(TAG_KV):
                shape = (c.num_hidden_layers, 2, max_total_tokens, c.num_key_value_heads, c.head_dim)
                self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        self._abort = threading.Event()
        self._lock = threading.Lock()  # one forward pass user at a time (generate / update / release)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model.path))
        self._placed: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()  # naive swap's second copy
        track(self)  # the CPU memory probe counts held_tensors()

    def held_tensors(self) -> list[torch.Tensor]:
        """Weights, KV cache and tensors ``place``d for a naive swap (empty after shutdown)."""
        if self.kv is None:
            return []
        return [*self.params.values(), self.kv, *list(self._placed)]

    def paused_device_bytes(self) -> tuple[int, int] | None:
        """``(CUDA device index, bytes)`` of its paused torch_memory_saver regions, or None."""
        paused = getattr(self.memory, "paused_bytes", None)
        if paused is None or self.device.type != "cuda":
            return None
        return (self.device.index or 0, paused())

    # -- weights ----------------------------------------------------------------------------
    def weight_names(self) -> list[str]:
        return list(self.params)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def place(self, hf_name: str, value: Any) -> torch.Tensor:
        """A copy of ``value`` (HF layout) on the engine's device and dtype (the naive baseline's)."""
        dst = self._param(hf_name)
        src = value if isinstance(value, torch.Tensor) else to_torch(value)
        check_shape(hf_name, src, dst.shape)
        placed = src.to(device=self.device, dtype=self.dtype, copy=True)
        self._placed.add(placed)  # held for the engine until installed and dropped
        return placed

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None) -> UpdateStats:
        """In-place streaming update. The fingerprint is read from the engine's own tensors as each
        piece is written (``copy_with_sums``): every tensor written is ``installed``, not read back."""
        t0 = time.perf_counter()
        noop = fault("swap_noop")
        sums: dict[str, torch.Tensor] = {}
        nbytes = 0
        with torch.no_grad(), self._lock:
            for name, value in named_tensors:
                dst = self._param(name)
                if isinstance(value, Placed):
                    src = value.value
                    check_shape(name, src, dst.shape)
                    if src.device != dst.device or src.dtype != dst.dtype:
                        raise ValueError(
                            f"{name}: placed {src.dtype} on {src.device}, engine holds {dst.dtype} "
                            f"on {dst.device}"
                        )
                    if on_tensor is not None:
                        on_tensor(name, src.numel() * src.element_size())
                    sums[name] = copy_with_sums(dst, src, write=not noop)
                    del src
                else:
                    src = value if isinstance(value, torch.Tensor) else to_torch(value)
                    check_shape(name, src, dst.shape)
                    sums[name] = self._write(name, dst, src, on_tensor, noop)
                    del src
                del value
                nbytes += dst.numel() * dst.element_size()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        fp = read_sums(sums)
        installed = frozenset() if noop else frozenset(fp)  # noop: sums of what was sent, not held
        return UpdateStats(len(fp), nbytes, time.perf_counter() - t0, fp, installed=installed)

    def _write(
        self, name: str, dst: torch.Tensor, src: torch.Tensor, on_tensor: Any, noop: bool
    ) -> torch.Tensor:
        """Write ``src`` into ``dst`` in dim-0 slices (<= ``chunk_bytes``), each staged on the device
        first (not on the host: there it is read where it lies); [sum, sumsq] (``copy_with_sums``)."""
        rows = dst.shape[0]
        row_bytes = max(1, dst[0].numel() * dst.element_size())
        whole = self.chunk_bytes <= 0 or dst.numel() * dst.element_size() <= self.chunk_bytes
        step = rows if whole else max(1, self.chunk_bytes // row_bytes)
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        host = self.device.type == "cpu"
        for start in range(0, rows, step):
            part = src[start : start + step]
            if not host:  # one transfer of the slice, in the engine's dtype
                part = part.to(device=self.device, dtype=self.dtype)
            if start == 0 and on_tensor is not None:  # the engine's copy + a staged slice or float32 piece
                on_tensor(
                    name, min(part.numel(), _FP_CHUNK) * 4 if host else part.numel() * part.element_size()
                )
            acc += copy_with_sums(dst[start : start + step], part, write=not noop)
            del part
        return acc

    @torch.no_grad()
    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        """(sum, sumsq) of every parameter the forward pass reads (``names``: those)."""
        return read_sums({n: tensor_sums(self.params[n]) for n in (self.params if names is None else names)})

    def _param(self, name: str) -> torch.Tensor:
        try:
            return self.params[name]
        except KeyError:
            raise ValueError(f"unknown parameter {name!r} for this engine") from None

    # -- generation -------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        prompts = [[int(t) for t in p] for p in input_ids]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i}: empty")
            if len(p) >= self.context_length:
                raise ValueError(f"prompt {i}: {len(p)} tokens >= --context-length {self.context_length}")
            if min(p) < 0 or max(p) >= self.config.vocab_size:
                raise ValueError(f"prompt {i}: token id outside [0, {self.config.vocab_size})")
        if sampling.seed is None and sampling.temperature > 0:  # the engine's own stream gives the batch seed
            seed = int(torch.randint(2**31, (1,), generator=self._gen))
            sampling = dataclasses.replace(sampling, seed=seed)
        dp = dist.procs()
        if dp.count > 1:  # data parallel: this process generates its slice, every process gets all
            per = -(-len(prompts) // dp.count)
            lo, hi = min(dp.index * per, len(prompts)), min((dp.index + 1) * per, len(prompts))
            offset = sampling.request_offset + lo
            mine = self._generate_here(prompts[lo:hi], dataclasses.replace(sampling, request_offset=offset))
            return [o for part in dist.gather_objects(mine) for o in part]
        return self._generate_here(prompts, sampling)

    def _generate_here(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        """``prompts`` in sub-batches, request i sampling from its own generator."""
        seeds = request_seeds(sampling.seed or 0, len(prompts), sampling.request_offset)  # greedy: unused
        outs: list[GenerateOutput] = []
        with torch.no_grad(), self._lock:
            for batch in self._sub_batches(prompts, sampling.max_new_tokens):
                gens = [
                    torch.Generator(device="cpu").manual_seed(x)
                    for x in seeds[len(outs) : len(outs) + len(batch)]
                ]
                outs += self._generate_batch(batch, sampling, gens)
        return outs

    def _sub_batches(self, prompts: list[list[int]], max_new: int) -> list[list[list[int]]]:
        """Consecutive groups of at most ``max_running_requests`` prompts fitting the KV pool."""
        groups: list[list[list[int]]] = []
        for p in prompts:
            group = groups[-1] if groups else None
            if group is not None and len(group) < self.max_running_requests:
                cap = self._row_len([*group, p], max_new)
                if cap * (len(group) + 1) <= self.max_total_tokens:
                    group.append(p)
                    continue
            groups.append([p])
        return groups

    def _row_len(self, prompts: list[list[int]], max_new: int) -> int:
        return max(len(p) for p in prompts) + min(max_new, self.context_length - min(len(p) for p in prompts))

    def _generate_batch(
        self, prompts: list[list[int]], sampling: SamplingParams, gens: list[torch.Generator]
    ) -> list[GenerateOutput]:
        c, dev = self.config, self.device
        b = len(prompts)
        lens = [len(p) for p in prompts]
        plen = max(lens)
        budget = [min(sampling.max_new_tokens, self.context_length - n) for n in lens]
        cap = self._row_len(prompts, sampling.max_new_tokens)
        tokens = torch.zeros(b, plen, dtype=torch.long)
        key_mask = torch.zeros(b, cap, dtype=torch.bool)
        for i, p in enumerate(prompts):
            tokens[i, plen - len(p) :] = torch.tensor(p)
            key_mask[i, plen - len(p) : plen] = True
        positions = (key_mask[:, :plen].long().cumsum(1) - 1).clamp(min=0)
        tokens, key_mask, positions = tokens.to(dev), key_mask.to(dev), positions.to(dev)
        pool = self.kv[:, :, : b * cap].unflatten(2, (b, cap))  # [L, 2, B, C, K, D]
        cache = KVCache(list(pool[:, 0]), list(pool[:, 1]))
        stops = set(sampling.stop_token_ids) | {c.eos_token_id}
        if self._abort.is_set():
            return [self._output([], [], ABORT) for _ in prompts]
        logits, shared = self._prefill(prompts, tokens, positions, key_mask, cache)
        next_pos = torch.tensor(lens, device=dev)
        steps = max(budget)
        out_tok = torch.zeros(b, steps, dtype=torch.long, device=dev)
        out_lp = torch.zeros(b, steps, dtype=torch.float32, device=dev)
        stop_ids, budget_t = torch.tensor(sorted(stops), device=dev), torch.tensor(budget, device=dev)
        ended = torch.zeros(b, dtype=torch.bool, device=dev)
        every = 1 if dev.type == "cpu" else SYNC_EVERY
        u = uniforms(gens, steps, dev) if sampling.temperature > 0 else torch.empty(0, steps)
        done = 0
        for step in range(steps):
            if self._abort.is_set():
                break
            tok, lp = sample(logits, sampling, u[:, step])
            out_tok[:, step], out_lp[:, step] = tok, lp
            ended |= torch.isin(tok, stop_ids) | (budget_t <= step + 1)
            done = step + 1
            if done == steps or (done % every == 0 and bool(ended.all())):
                break
            slot = plen + step
            key_mask[:, slot] = True
            logits = self.model.forward_cached(tok[:, None], next_pos[:, None], key_mask, cache, slot)[:, 0]
            next_pos += 1
        return [
            dataclasses.replace(self._ending(t, lp, stops, min(done, n), n), cached_tokens=n_shared)
            for t, lp, n, n_shared in zip(
                out_tok[:, :done].tolist(), out_lp[:, :done].tolist(), budget, shared, strict=True
            )
        ]

    def _prefill(self, prompts: list[list[int]], tokens, positions, key_mask, cache: KVCache) -> tuple:
        """The batch's prefill, each distinct prompt computed once and its K/V and logits copied to
        every row that holds it. ``tokens``, ``positions``: [B, P]; ``key_mask``: [B, S]; ``cache``:
        rows [B, S, K, D]. Returns the last logits [B, V] and per row the prompt tokens it shared."""
        slot: dict[tuple[int, ...], int] = {}  # prompt -> its row among the distinct ones
        of = [slot.setdefault(tuple(p), len(slot)) for p in prompts]
        if len(slot) == len(prompts):
            logits = self.model.forward_cached(tokens, positions, key_mask, cache, 0, last_only=True)
            return logits[:, -1], [0] * len(prompts)
        first = [of.index(j) for j in range(len(slot))]  # the row whose prompt is computed
        firsts = torch.tensor(first, device=tokens.device)
        head = KVCache([k[: len(slot)] for k in cache.k], [v[: len(slot)] for v in cache.v])
        logits = self.model.forward_cached(
            tokens[firsts], positions[firsts], key_mask[firsts], head, 0, last_only=True
        )[:, -1]
        rows, plen = torch.tensor(of, device=tokens.device), tokens.shape[1]
        for buf in (*cache.k, *cache.v):  # one layer's prompt K or V at a time
            buf[:, :plen] = buf[rows, :plen]
        shared = [0 if first[j] == i else len(p) for i, (j, p) in enumerate(zip(of, prompts, strict=True))]
        return logits[rows], shared

    def _ending(
        self, toks: list[int], lps: list[float], stops: set, seen: int, budget: int
    ) -> GenerateOutput:
        """A row's output from its first ``seen`` tokens: to its first stop token, its ``budget``, or abort."""
        for j, t in enumerate(toks[:seen]):
            if t in stops:
                return self._output(toks[: j + 1], lps[: j + 1], "stop")
        return self._output(toks[:seen], lps[:seen], "length" if seen == budget else ABORT)

    def _output(self, toks: list[int], lps: list[float], reason: str) -> GenerateOutput:
        return GenerateOutput(toks, lps, self.tokenizer.decode(toks, skip_special_tokens=True), reason)

    def pause_generation(self) -> None:
        """Requests in flight return before their next decode step with ``finish_reason="abort"``."""
        self._abort.set()

    def continue_generation(self) -> None:
        self._abort.clear()

    def flush_cache(self) -> None:
        """Nothing to flush: the engine keeps no prefix cache between requests."""

    # -- memory tags ------------------------------------------------------------------------
    def _tensors(self, tag: str) -> list[torch.Tensor]:
        if tag == TAG_WEIGHTS:
            return list(self.params.values())
        if tag == TAG_KV:
            return [self.kv]
        raise ValueError(f"unknown memory tag {tag!r}; this engine has {list(self.tags)}")

    def memory_tag(self, tag: str) -> str:
        """The memory layer's name of ``tag`` (``<task>/<tag>`` for a task's engine)."""
        return self.memory.name(tag)

    def tag_bytes(self, tag: str) -> int:
        """Device bytes a resident tag holds (tensor bytes; CUDA allocations round up to 2 MiB pages)."""
        return sum(t.numel() * t.element_size() for t in self._tensors(tag))

    def release_memory(self, tag: str) -> None:
        with torch.no_grad(), self._lock:
            backup = tag == TAG_WEIGHTS and self.weights_cpu_backup and not fault("resume_lies")
            self.memory.release(tag, self._tensors(tag), cpu_backup=backup)

    def resume_memory(self, tag: str) -> bool:
        """True when the contents came back (weights with CPU backup); never for kv_cache."""
        with torch.no_grad(), self._lock:
            restored = self.memory.resume(tag, self._tensors(tag))
        return (restored or fault("resume_lies")) and tag == TAG_WEIGHTS

    def shutdown(self) -> None:
        self.params = {}
        self.model = None  # type: ignore[assignment]
        self.kv = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def uniforms(gens: Sequence[torch.Generator], steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, steps] float64 uniforms, row i from its request's CPU generator ``gens[i]`` (one call per
    row draws what one call per step would), moved to ``device`` in one copy: a copy from pageable
    host memory waits for the device, so one per decode step would stall every step."""
    return torch.stack([torch.rand(steps, generator=g, dtype=torch.float64) for g in gens]).to(device)


def sample(
    logits: torch.Tensor, sampling: SamplingParams, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V] and its ``log_softmax(logits / T)`` before top-p
    (greedy: the argmax), [B] each: inverse-CDF on the device in float64 with the row's uniform
    ``u`` [B] (a column of ``uniforms``: independent of device and other rows; unused greedy)."""
    logits = logits.float()
    if sampling.temperature == 0:
        lp = torch.log_softmax(logits, dim=-1)
        tok = lp.argmax(dim=-1)
        return tok, lp.gather(1, tok[:, None])[:, 0]
    lp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = lp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p  # the top token is always kept
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    cdf = probs.double().cumsum(dim=-1)
    # the first index whose cdf exceeds u * total (never a zero-probability token)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    return tok, lp.gather(1, tok[:, None])[:, 0]


def check_shape(name: str, src: torch.Tensor | np.ndarray, shape: Sequence[int]) -> None:
    """A received tensor must have the engine tensor's ``shape`` (one-line error otherwise)."""
    if tuple(src.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(src.shape)} does not match engine {tuple(shape)}")
