#!/usr/bin/env bash
# The whole benchmark table of docs/BENCHMARKS.md in one command (issue 7: "Measured on the GPU").
#
#   scripts/gpu_bench_all.sh [--out DIR] [--only STEP[,STEP...]] [--install none|venv|image] [--cpu] [--dry-run] [--list]
#
# NOT RUN ON A GPU YET. It was written on a CPU-only machine, where only its CPU mode (--cpu: the
# same steps with the tiny preset on JAX CPU and torch CPU) and --dry-run have run. The GPU mode
# needs one NVIDIA H100 (or any CUDA GPU with >= 40 GiB; qwen3-4b is 8 GB in bf16).
#
# Steps (--list prints them; --only takes names or prefixes, e.g. --only swap,rl-torch), each a
# benchmark of python -m mllm_rl.bench (python -m mllm_rl.bench lists them):
#   swap-*     swap          qwen3-4b: streaming vs naive peak/steady, GB/s vs measured H2D
#   release-*  release       qwen3-4b: freed/held per tag, time vs raw memcpy (with/without CPU backup)
#   rl-*       rl-memory     qwen3-0.6b, qwen3-1.7b: multi_stage vs naive step peaks; largest KV
#                            cache by OOM bisection (--bisect)
#   soak-*     soak          100 release/resume/update cycles (qwen3-0.6b; torch also with trainer)
#   engine-*   engine        decode tokens/s: embedded torch engine / sglang-jax vs HF generate
#   plan-*     plan vs-cuda  the torch planner's train step vs the same step on the GPU
#                            (qwen3-4b 4 x 4096 with remat, qwen3-0.6b 4 x 4096); GPU mode only
# Each step writes DIR/<step>.json and DIR/<step>.log and one line "step<TAB>exit<TAB>seconds" to DIR/status.tsv;
# a failing step is recorded and the next one runs. At the end python -m mllm_rl.bench summary prints the table
# (also DIR/summary.md). Exit status: 0 when every step exited 0, else 1.
#
# Interpreters: PY_TORCH (torch steps, HF baseline) and PY_JAX (jax steps); default .venv-torch/.venv-jax of
# this repo when they exist, else python3. --install makes them:
#   venv   a GPU host with PyPI access: .venv-torch (Python 3.11/3.12; torch from PyPI is the CUDA build) with
#          pip install -e ".[torch,cuda,wandb,dev]", and .venv-jax (Python 3.12) with
#          pip install -e ".[jax,wandb,dev]" "sglang-jax[gpu]==0.1.0rc0" (jax[cuda12]==0.10.2)
#   image  an offline CUDA image (one python3 with torch 2.11+cu130, jax 0.11.2, transformers 5.x; no
#          network, no sglang-jax, no torch_memory_saver): pip install --no-index --no-deps -e . into that
#          python3, plus any wheels carried in .whl/ (e.g. torch_memory_saver-0.0.10); PY_TORCH=PY_JAX=python3.
#          Without sglang-jax the jax steps fail (recorded as such).
# Where one command may only run for a few minutes, run the steps in parts
# (--only), with the same --out, and tar the directory into $OUT (docs/BENCHMARKS.md has the commands).
set -euo pipefail
cd "$(dirname "$0")/.."

out=""
only=""
install=none
cpu=0
dry=0
list=0
usage() { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --only) only=${2:?--only needs step names}; shift 2 ;;
    --install) install=${2:?--install needs none, venv or image}; shift 2 ;;
    --cpu) cpu=1; shift ;;
    --dry-run) dry=1; shift ;;
    --list) list=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$install" in none|venv|image) ;; *) echo "error: --install $install: choose none, venv or image" >&2; exit 2 ;; esac
out=${out:-runs/bench-$(date +%y%m%d-%H%M%S)}

# -- install --------------------------------------------------------------------------------------
pick_python() {  # $1: minor versions to try, in order
  local v
  for v in $1; do
    if command -v "python$v" >/dev/null 2>&1; then command -v "python$v"; return 0; fi
  done
  return 1
}
do_install() {
  case "$install" in
    venv)
      local pt pj
      pt=$(pick_python "3.11 3.12") || { echo "error: --install venv needs python3.11 or python3.12" >&2; exit 2; }
      pj=$(pick_python "3.12") || { echo "error: --install venv needs python3.12 (sglang-jax)" >&2; exit 2; }
      [ -x .venv-torch/bin/python ] || "$pt" -m venv .venv-torch
      .venv-torch/bin/python -m pip install -q --upgrade pip
      .venv-torch/bin/python -m pip install -q torch
      .venv-torch/bin/python -m pip install -q -e ".[torch,cuda,wandb,dev]"
      [ -x .venv-jax/bin/python ] || "$pj" -m venv .venv-jax
      .venv-jax/bin/python -m pip install -q --upgrade pip
      .venv-jax/bin/python -m pip install -q -e ".[jax,wandb,dev]" "sglang-jax[gpu]==0.1.0rc0"
      ;;
    image)
      python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
      if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps .whl/*.whl
      fi
      PY_TORCH=python3
      PY_JAX=python3
      ;;
  esac
}

# -- steps ----------------------------------------------------------------------------------------
STEPS=()   # "name|python-var|interpreter args..." (the JSON path is appended)
if [ "$cpu" = 1 ]; then
  PY_TORCH=${PY_TORCH:-.venv-torch/bin/python}
  PY_JAX=${PY_JAX:-.venv-jax/bin/python}
  STEPS+=(
    "swap-jax-tiny|PY_JAX|-m mllm_rl.bench swap --backend jax --preset tiny --platform cpu"
    "swap-torch-tiny|PY_TORCH|-m mllm_rl.bench swap --backend torch --preset tiny --platform cpu"
    "release-jax-tiny|PY_JAX|-m mllm_rl.bench release --backend jax --preset tiny --platform cpu"
    "release-jax-tiny-backup|PY_JAX|-m mllm_rl.bench release --backend jax --preset tiny --platform cpu --cpu-backup"
    "release-torch-tiny|PY_TORCH|-m mllm_rl.bench release --backend torch --preset tiny --platform cpu"
    "release-torch-tiny-backup|PY_TORCH|-m mllm_rl.bench release --backend torch --preset tiny --platform cpu --cpu-backup"
    "rl-jax-tiny|PY_JAX|-m mllm_rl.bench rl-memory --backend jax --preset tiny --platform cpu --budget-gb 0.125"
    "rl-torch-tiny|PY_TORCH|-m mllm_rl.bench rl-memory --backend torch --preset tiny --platform cpu --budget-gb 0.125"
    "soak-jax-tiny|PY_JAX|-m mllm_rl.bench soak --backend jax --preset tiny --platform cpu --cycles 100"
    "soak-torch-tiny|PY_TORCH|-m mllm_rl.bench soak --backend torch --preset tiny --platform cpu --cycles 100"
    "soak-torch-tiny-trainer|PY_TORCH|-m mllm_rl.bench soak --backend torch --preset tiny --platform cpu --cycles 100 --trainer --cpu-backup"
    "engine-torch-tiny|PY_TORCH|-m mllm_rl.bench engine --backend torch --preset tiny --platform cpu --batch 1,32"
    "engine-jax-tiny|PY_JAX|-m mllm_rl.bench engine --backend jax --preset tiny --platform cpu --batch 1,32 --keep-going"
  )
else
  PY_TORCH=${PY_TORCH:-$( [ -x .venv-torch/bin/python ] && echo .venv-torch/bin/python || echo python3 )}
  PY_JAX=${PY_JAX:-$( [ -x .venv-jax/bin/python ] && echo .venv-jax/bin/python || echo python3 )}
  STEPS+=(
    "swap-torch-qwen3-4b|PY_TORCH|-m mllm_rl.bench swap --backend torch --preset qwen3-4b --platform cuda"
    "swap-jax-qwen3-4b|PY_JAX|-m mllm_rl.bench swap --backend jax --preset qwen3-4b --platform gpu"
    "release-torch-qwen3-4b|PY_TORCH|-m mllm_rl.bench release --backend torch --preset qwen3-4b --platform cuda"
    "release-torch-qwen3-4b-backup|PY_TORCH|-m mllm_rl.bench release --backend torch --preset qwen3-4b --platform cuda --cpu-backup"
    "release-jax-qwen3-4b|PY_JAX|-m mllm_rl.bench release --backend jax --preset qwen3-4b --platform gpu"
    "release-jax-qwen3-4b-backup|PY_JAX|-m mllm_rl.bench release --backend jax --preset qwen3-4b --platform gpu --cpu-backup"
    "rl-torch-qwen3-0.6b|PY_TORCH|-m mllm_rl.bench rl-memory --backend torch --preset qwen3-0.6b --platform cuda"
    "rl-torch-qwen3-1.7b|PY_TORCH|-m mllm_rl.bench rl-memory --backend torch --preset qwen3-1.7b --platform cuda --bisect"
    "rl-jax-qwen3-0.6b|PY_JAX|-m mllm_rl.bench rl-memory --backend jax --preset qwen3-0.6b --platform gpu"
    "rl-jax-qwen3-1.7b|PY_JAX|-m mllm_rl.bench rl-memory --backend jax --preset qwen3-1.7b --platform gpu --bisect"
    "soak-torch-qwen3-0.6b|PY_TORCH|-m mllm_rl.bench soak --backend torch --preset qwen3-0.6b --platform cuda --cycles 100"
    "soak-torch-qwen3-0.6b-trainer|PY_TORCH|-m mllm_rl.bench soak --backend torch --preset qwen3-0.6b --platform cuda --cycles 100 --trainer --cpu-backup"
    "soak-jax-qwen3-0.6b|PY_JAX|-m mllm_rl.bench soak --backend jax --preset qwen3-0.6b --platform gpu --cycles 100"
    "engine-torch-qwen3-0.6b|PY_TORCH|-m mllm_rl.bench engine --engines embedded,hf --preset qwen3-0.6b --platform cuda --batch 1,32,128 --new-tokens 128"
    "engine-jax-qwen3-0.6b|PY_JAX|-m mllm_rl.bench engine --backend jax --preset qwen3-0.6b --platform gpu --batch 1,32,128 --new-tokens 128 --keep-going"
    "plan-torch-qwen3-4b|PY_TORCH|-m mllm_rl.bench plan vs-cuda --preset qwen3-4b --micro-batch 4 --seq-len 4096 --option remat=true"
    "plan-torch-qwen3-0.6b|PY_TORCH|-m mllm_rl.bench plan vs-cuda --preset qwen3-0.6b --micro-batch 4 --seq-len 4096"
  )
fi

if [ "$list" = 1 ]; then
  for s in "${STEPS[@]}"; do echo "${s%%|*}"; done
  exit 0
fi

selected() {  # $1: step name; true when --only is empty or names it (or a prefix of it)
  [ -z "$only" ] && return 0
  local item
  IFS=',' read -ra items <<<"$only"
  for item in "${items[@]}"; do
    case "$1" in "$item"*) return 0 ;; esac
  done
  return 1
}

if [ "$dry" = 1 ]; then
  echo "# install: $install; out: $out"
else
  do_install
  mkdir -p "$out"
fi
export MLLM_RL_NO_PROGRESS=1 PYTHONUNBUFFERED=1
export PY_TORCH PY_JAX
failed=0
ran=0
for s in "${STEPS[@]}"; do
  name=${s%%|*}
  rest=${s#*|}
  pyvar=${rest%%|*}
  args=${rest#*|}
  selected "$name" || continue
  py=${!pyvar}
  extra=()
  case "$name" in engine-jax-*) extra=(--python-torch "$PY_TORCH") ;; esac
  read -ra argv <<<"$args"
  cmd=("$py" "${argv[@]}" "${extra[@]}" --json "$out/$name.json")
  if [ "$dry" = 1 ]; then
    printf '%q ' "${cmd[@]}"; echo
    continue
  fi
  ran=$((ran + 1))
  echo "== $name: ${cmd[*]}" | tee -a "$out/commands.txt"
  t0=$(date +%s)
  set +e
  "${cmd[@]}" >"$out/$name.log" 2>&1
  rc=$?
  set -e
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >>"$out/status.tsv"
  if [ "$rc" != 0 ]; then
    failed=$((failed + 1))
    echo "   exit $rc (tail of $out/$name.log):"; tail -n 5 "$out/$name.log" | sed 's/^/   /'
  fi
done
[ "$dry" = 1 ] && exit 0
if [ "$ran" = 0 ]; then
  echo "error: --only '$only' selects no step (see --list)" >&2
  exit 2
fi
echo
"$PY_TORCH" -m mllm_rl.bench summary "$out" --markdown "$out/summary.md" ||
  python3 -m mllm_rl.bench summary "$out" --markdown "$out/summary.md"
echo "results: $out ($failed failed step(s))"
[ "$failed" = 0 ]
