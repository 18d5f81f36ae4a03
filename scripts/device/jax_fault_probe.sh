#!/usr/bin/env bash
# Which change does a CUDA fault of sglang-jax follow? On the GPU machine (.whl/ carried, as for
# scripts/device_check.sh), each in a fresh process with JAX's compilation cache off: the engine
# benchmark's sglang-jax worker (qwen3-0.6b, greedy, batches 1 and 8, 16 new tokens) as it is and
# with checkpoint tensors laid out on the host (MLLM_RL_HOST_LAYOUT=1, the path before transposes
# moved to the devices); then the swap plan (whose greedy generate ran where the worker faulted)
# at its own engine sizing and at the worker's (context 64, 8 requests, 512 KV tokens). Prints
# each exit code and the error lines, without the lines XLA repeats per module after a fault.
# Earlier runs ruled out command buffers, autotuning, Triton GEMMs and launch order (blocking
# launches). About 3 minutes.
#   scripts/device/jax_fault_probe.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=/tmp/jax-fault-probe
scripts/device_check.sh --only env --out "$out" >/dev/null 2>&1 # installs the wheels
export PYTHONPATH=/tmp/mllm_rl-site JAX_COMPILATION_CACHE_DIR="" MLLM_RL_NO_PROGRESS=1
probe() { # label, VAR=value ... --, then the python -m arguments
  local label=$1 t0 rc vars=()
  shift
  while [ "$1" != -- ]; do vars+=("$1"); shift; done
  shift
  t0=$(date +%s)
  env "${vars[@]}" timeout 80 python3 -m "$@" >"$out/$label.out" 2>"$out/$label.err"
  rc=$?
  echo "== $label: exit $rc in $(($(date +%s) - t0)) s; ${vars[*]}"
  grep -vE "Failed to unload module|Source Location Trace|cuda_status.cc" "$out/$label.err" |
    grep -E "Error|error:|CUBIN" | cut -c1-400 | head -6
}
worker=(mllm_rl.bench engine --worker sglang-jax --preset qwen3-0.6b --batch "1,8" --prompt-len 16
  --new-tokens 16 --repeats 1 --platform gpu --seed 0)
swap=(mllm_rl.run --backend jax --platform gpu --plan swap --model qwen3-0.6b --wandb disabled)
probe worker MLLM_RL_HOST_LAYOUT=0 -- "${worker[@]}"
probe worker-host-layout MLLM_RL_HOST_LAYOUT=1 -- "${worker[@]}"
probe swap MLLM_RL_HOST_LAYOUT=0 -- "${swap[@]}" --run-dir "$out/swap"
probe swap-worker-sizing MLLM_RL_HOST_LAYOUT=0 -- "${swap[@]}" --run-dir "$out/swap-sized" \
  --context-length 64 --max-running-requests 8 --kv-tokens 512
