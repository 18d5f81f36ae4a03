import pytest

pytest.importorskip("jax", reason="the jax tests run in .venv-jax")
pytest.importorskip("sgl_jax", reason="needs sglang-jax (the jax extra)")
