"""``backends/torch/cpu_half.linear``: a 16-bit product of 16 rows or more on CPU is the float32
product of the 16-bit inputs rounded once (as a GPU's 16-bit GEMM), forward and backward, saving
only 16-bit tensors; fewer rows, float32, or ``dispatched_as_on_gpu`` keep ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mllm_rl.backends.torch.cpu_half import dispatched_as_on_gpu, linear

OURS = "_CpuHalfLinearBackward"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_cpu_product_and_its_gradients_are_the_exact_ones_rounded_once(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 64, generator=g).to(dtype).requires_grad_()
    w = torch.randn(48, 64, generator=g).to(dtype).requires_grad_()
    up = torch.randn(4, 5, 48, generator=g).to(dtype)
    saved: list[torch.dtype] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        y = linear(x, w)
    assert y.dtype == dtype and saved and set(saved) == {dtype}  # no float32 copy kept for the backward
    assert type(y.grad_fn).__name__ == OURS
    y.backward(up)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.linear(x64, w64).backward(up.double())
    for got, exact in ((y, F.linear(x64, w64)), (x.grad, x64.grad), (w.grad, w64.grad)):
        # one rounding of a float32 sum: within half an ulp of the 16-bit result, plus float32 noise
        assert torch.allclose(got.double(), exact.detach(), rtol=torch.finfo(dtype).eps, atol=1e-6)
    with dispatched_as_on_gpu():  # torch's own 16-bit op, one dispatch
        y = linear(x, w)
    assert type(y.grad_fn).__name__ != OURS and torch.equal(y, F.linear(x, w))
    assert type(linear(x.float(), w.float()).grad_fn).__name__ != OURS  # float32
    assert type(linear(x[:3, :5], w).grad_fn).__name__ != OURS  # 15 rows: cheaper than a float32 weight


def test_a_plan_for_a_gpu_traces_its_16_bit_products_as_the_gpu_runs_them(monkeypatch):
    """The planner's fake step is a CPU one: a plan for CUDA must not count the CPU path's float32
    copies (nor pay for tracing them); a plan for CPU runs what a CPU run runs."""
    from mllm_rl.backends.torch import cpu_half, memplan
    from mllm_rl.presets import get_preset

    calls = []
    real = cpu_half._CpuHalfLinear.apply
    monkeypatch.setattr(cpu_half._CpuHalfLinear, "apply", lambda *a: calls.append(1) or real(*a))
    for device in ("cuda", "cpu"):
        calls.clear()
        trace = memplan.trainer_step_memory.__wrapped__  # traced now, not an earlier test's result
        trace(get_preset("tiny"), 2, 32, rows=2, dtype="bfloat16", steps=1, device=device)
        assert bool(calls) == (device == "cpu"), (device, len(calls))
