# Two commands on a fresh machine:  make run   (main job, embedded default)   make test   (the suite;
# make test-fast: everything but the tests marked slow)
# Each creates the venvs it needs, idempotently (scripts/venv.sh).
SHELL := /bin/bash
BACKEND ?= jax
PY_JAX := .venv-jax/bin/python
PY_TORCH := .venv-torch/bin/python
ARGS ?=

.PHONY: run test test-fast setup venv-jax venv-torch venv-jax-next lint clean-venvs

venv-jax:
	@scripts/venv.sh jax

venv-torch:
	@scripts/venv.sh torch

venv-jax-next:
	@scripts/venv.sh jax-next

setup: venv-jax venv-torch

## run: the main job on the embedded default (tiny model, CPU). BACKEND=jax|torch; extra flags: ARGS="--tp 2"
run: venv-$(BACKEND)
	.venv-$(BACKEND)/bin/python -m mllm_rl.run --backend $(BACKEND) $(ARGS)

## test: ruff (lint + format) + the whole pytest suite (CPU): core/jax/tpu tests in .venv-jax (two pytest-xdist
## workers) and torch tests in .venv-torch, both at once (scripts/run_tests.sh); .venv-jax-next (JAX 0.11.2,
## the accelerator images' packages) for the device check's CPU mode (tests/jax/test_device_check.py)
test: venv-jax venv-torch venv-jax-next
	@command -v shellcheck >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && { apt-get update -qq >/dev/null && apt-get install -y -qq shellcheck >/dev/null; } || echo "[test] shellcheck not installed: its test will skip"; }
	$(PY_JAX) -m ruff check . && $(PY_JAX) -m ruff format --check .
	scripts/run_tests.sh

## test-fast: ruff + every test not marked slow (no engine, no whole run starts), in both venvs
test-fast: venv-jax venv-torch
	$(PY_JAX) -m ruff check . && $(PY_JAX) -m ruff format --check .
	scripts/run_tests.sh -m "not slow"

lint: venv-jax
	$(PY_JAX) -m ruff check . && $(PY_JAX) -m ruff format --check .

clean-venvs:
	rm -rf .venv-jax .venv-torch .venv-jax-next
