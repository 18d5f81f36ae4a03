#!/usr/bin/env bash
# Which XLA setting does a CUDA fault of sglang-jax follow? On the GPU machine (.whl/ carried, as for
# scripts/device_check.sh): the engine benchmark's sglang-jax worker (qwen3-0.6b, greedy, batches 1 and 8,
# 16 new tokens) once per setting, each in a fresh process with JAX's compilation cache off; prints each
# exit code and the error lines, without the lines XLA repeats per module after a fault. About 3 minutes.
#   scripts/device/jax_fault_probe.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
scripts/device_check.sh --only env --out /tmp/jax-fault-probe >/dev/null 2>&1  # installs the wheels
export PYTHONPATH=/tmp/mllm_rl-site JAX_COMPILATION_CACHE_DIR="" MLLM_RL_NO_PROGRESS=1
probe() {  # label, XLA_FLAGS, then VAR=value ...
  local label=$1 xf=$2 t0 rc
  shift 2
  t0=$(date +%s)
  env XLA_FLAGS="$xf" "$@" timeout 80 python3 -m mllm_rl.bench engine --worker sglang-jax --preset qwen3-0.6b \
    --batch 1,8 --prompt-len 16 --new-tokens 16 --repeats 1 --platform gpu --seed 0 \
    >"/tmp/jax-fault-probe/$label.out" 2>"/tmp/jax-fault-probe/$label.err"
  rc=$?
  echo "== $label: exit $rc in $(($(date +%s) - t0)) s; XLA_FLAGS='$xf' $*"
  grep -vE "Failed to unload module|Source Location Trace|cuda_status.cc" "/tmp/jax-fault-probe/$label.err" |
    grep -E "Error|CUBIN" | cut -c1-400 | head -6
}
probe default ""
probe no-command-buffers "--xla_gpu_enable_command_buffer="
probe blocking-launches "--xla_gpu_enable_command_buffer=" CUDA_LAUNCH_BLOCKING=1
probe no-autotuning "--xla_gpu_autotune_level=0"
probe no-triton-gemm "--xla_gpu_enable_triton_gemm=false"
