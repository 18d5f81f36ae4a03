"""Torch backend tests: they run in .venv-torch (``make test`` does); skipped where torch is missing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch tests run in .venv-torch (torch not importable here)")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is fastest, and immune to a busy machine's scheduling."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    """Hugging Face ``transformers`` Qwen3ForCausalLM on the tiny checkpoint, fp32: the reference
    that is independent of our model code."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_logits(hf_model):
    """``logits_fn(token_ids) -> [T, V]`` float32 numpy, as ``tests/engine_contract.py`` wants."""

    def fn(ids: list[int]):
        with torch.no_grad():
            return hf_model(input_ids=torch.tensor([ids])).logits[0].float().numpy()

    return fn


def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
