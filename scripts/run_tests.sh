#!/usr/bin/env bash
# The two pytest suites at the same time (they use different venvs and many of their tests wait
# on engine start-up and subprocesses, so together they fill the cores better than one by one):
#   core/jax/tpu in .venv-jax,   in $MLLM_RL_TEST_WORKERS (default 2) pytest-xdist workers, one test
#                file per worker at a time (--dist loadfile: a module's fixtures, e.g. a recorded
#                run several tests read, are made once); its output as it goes
#   torch        in .venv-torch, one process; its output once it ends
# Each ends with its 25 slowest tests (--durations), and the run with the test files that used the
# most CPU (tests/junit_cpu.py): on two cores the CPU is what to share or trim first as the suite grows.
# Every test's time and CPU stay in .pytest_cache/junit-{jax,torch}.xml (JUnit XML) after the run; the
# next run starts the longest files first by those times (tests/conftest.py), so the workers end together.
# Torch runs one OpenMP thread per process unless OMP_NUM_THREADS is set: the suites keep three or
# more processes busy on the cores, and OpenMP threads that spin waiting for a core take it from
# the others (what mllm_rl.launch does for its processes).
# Exit status: 0 when both passed. Extra arguments go to both, e.g. scripts/run_tests.sh -m "not slow".
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
log=$(mktemp -t mllm-rl-torch-tests.XXXXXX)
.venv-torch/bin/python -m pytest -q --durations=25 --junitxml=.pytest_cache/junit-torch.xml "$@" tests/torch >"$log" 2>&1 &
torch_pid=$!
trap 'kill "$torch_pid" 2>/dev/null; rm -f "$log"' EXIT
trap 'exit 130' INT TERM
echo "[test] tests/torch runs in the background (.venv-torch); its output follows the others'"
workers=${MLLM_RL_TEST_WORKERS:-2}
.venv-jax/bin/python -m pytest -q --durations=25 --junitxml=.pytest_cache/junit-jax.xml -n "$workers" --dist loadfile "$@" tests/core tests/jax tests/tpu
jax_rc=$?
wait "$torch_pid"
torch_rc=$?
echo "== tests/torch (.venv-torch) =="
cat "$log"
.venv-jax/bin/python -m tests.junit_cpu --top 15 || true
echo "[test] core/jax/tpu exit $jax_rc, torch exit $torch_rc"
[ "$jax_rc" -eq 0 ] && [ "$torch_rc" -eq 0 ]
