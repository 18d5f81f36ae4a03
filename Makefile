# Two commands on a fresh machine:  make run   (main job, embedded default)   make test   (the suite)
# Each creates the venvs it needs, idempotently (scripts/venv.sh).
SHELL := /bin/bash
PY_JAX := .venv-jax/bin/python
ARGS ?=

.PHONY: run test setup venv-jax lint clean-venvs

venv-jax:
	@scripts/venv.sh jax

setup: venv-jax

## run: the main job on the embedded default (tiny model, JAX on CPU). Extra flags: make run ARGS="--tp 2"
run: venv-jax
	$(PY_JAX) -m mllm_rl.run --backend jax $(ARGS)

## test: ruff + the whole pytest suite (CPU), in the jax venv
test: venv-jax
	@command -v shellcheck >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && { apt-get update -qq >/dev/null && apt-get install -y -qq shellcheck >/dev/null; } || echo "[test] shellcheck not installed: its test will skip"; }
	$(PY_JAX) -m ruff check .
	$(PY_JAX) -m pytest -q tests

lint: venv-jax
	$(PY_JAX) -m ruff check . && $(PY_JAX) -m ruff format --check .

clean-venvs:
	rm -rf .venv-jax .venv-torch
