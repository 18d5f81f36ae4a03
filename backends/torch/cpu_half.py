"""``linear``: ``x @ w.T`` whose 16-bit products on CPU run as float32 GEMMs.

A GPU's bf16/fp16 GEMM reads 16-bit inputs, accumulates in float32 and rounds the output to 16
bits. On a CPU without AVX512-BF16 or AMX, torch's 16-bit GEMM is a scalar fallback, many times
slower than its float32 GEMM. On CPU, ``linear`` computes a product of at least ``MIN_ROWS`` rows
from the same 16-bit inputs in float32 and rounds it once (forward and backward), so a CPU run of
a bf16 checkpoint trains and prefills at float32 speed, as the GPU computes; only the 16-bit
tensors are saved for the backward. Fewer rows (a small decode batch) keep torch's kernel: there
the float32 copy of the weight costs more than the product saves. Elsewhere (CUDA, float32), and
inside ``dispatched_as_on_gpu()``, it is ``F.linear``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

HALF = (torch.bfloat16, torch.float16)
MIN_ROWS = 16  # rows of x from which the float32 path was the faster one on an AVX2 host
_float32_on_cpu = True


@contextlib.contextmanager
def dispatched_as_on_gpu() -> Iterator[None]:
    """16-bit CPU products as ``F.linear``, one op each as on a GPU: for counting a step's ops."""
    global _float32_on_cpu
    _float32_on_cpu = False
    try:
        yield
    finally:
        _float32_on_cpu = True


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x``: [..., in], ``w``: [out, in] -> [..., out] in ``x``'s dtype."""
    if (
        _float32_on_cpu
        and x.device.type == "cpu"
        and x.dtype in HALF
        and w.dtype == x.dtype
        and x.numel() >= MIN_ROWS * x.shape[-1]
    ):
        return _CpuHalfLinear.apply(x, w)
    return F.linear(x, w)


class _CpuHalfLinear(torch.autograd.Function):
    """The float32 product of 16-bit ``x`` and ``w``, rounded to 16 bits; gradients likewise."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return F.linear(x.float(), w.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = grad.float()
        gx = (g @ w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g.reshape(-1, g.shape[-1]).T @ x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        return gx, gw
