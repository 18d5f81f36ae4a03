#!/usr/bin/env bash
# The two pytest suites at the same time (they use different venvs and most of their tests wait
# on engine start-up and subprocesses, so together they fill 2 cores better than one by one):
#   core/jax/tpu in .venv-jax   (its output as it goes)
#   torch        in .venv-torch (its output once it ends)
# Exit status: 0 when both passed. Extra arguments go to both, e.g. scripts/run_tests.sh -m "not slow".
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
log=$(mktemp -t mllm-rl-torch-tests.XXXXXX)
.venv-torch/bin/python -m pytest -q "$@" tests/torch >"$log" 2>&1 &
torch_pid=$!
trap 'kill "$torch_pid" 2>/dev/null; rm -f "$log"' EXIT
trap 'exit 130' INT TERM
echo "[test] tests/torch runs in the background (.venv-torch); its output follows the others'"
.venv-jax/bin/python -m pytest -q "$@" tests/core tests/jax tests/tpu
jax_rc=$?
wait "$torch_pid"
torch_rc=$?
echo "== tests/torch (.venv-torch) =="
cat "$log"
echo "[test] core/jax/tpu exit $jax_rc, torch exit $torch_rc"
[ "$jax_rc" -eq 0 ] && [ "$torch_rc" -eq 0 ]
