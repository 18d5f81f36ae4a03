#!/usr/bin/env bash
# The device check of both backends (scripts/device_check.py says what it runs and writes):
#   scripts/device_check.sh [--cpu] [--out DIR] [--budget SECONDS] [--only STEP,...]
# GPU mode (default): an offline NVIDIA machine whose python3 has torch with CUDA, jax with its CUDA
#   plugin, optax, orbax-checkpoint and transformers (scripts/device/image.txt). What it lacks comes
#   as wheels in .whl/ (scripts/device/wheels.sh fetches them where the package index is reachable),
#   installed with --no-deps into a folder put first on PYTHONPATH; the project is installed into
#   that python3 offline. Both backends' steps run in python3.
# --cpu: the same steps on the tiny model on the CPU; the JAX steps in .venv-jax-next (the image's
#   JAX 0.11.2 and transformers 5, plus the same pins as the wheels; scripts/venv.sh jax-next), the
#   torch steps in .venv-torch. The test suite runs this mode.
set -euo pipefail
cd "$(dirname "$0")/.."
cpu=0
for a in "$@"; do
  case "$a" in
    --cpu) cpu=1 ;;
    -h|--help) exec python3 scripts/device_check.py --help ;;
  esac
done
if [ "$cpu" = 1 ]; then
  scripts/venv.sh jax-next
  scripts/venv.sh torch
  pj=.venv-jax-next/bin/python
  pt=.venv-torch/bin/python
else
  site=/tmp/mllm_rl-site
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "[device-check] no .whl/ folder: using python3's packages as they are (scripts/device/wheels.sh fetches the wheels)" >&2
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v "Editable installation" >&2 || true
  pj=python3
  pt=python3
fi
exec "$pj" scripts/device_check.py --python-jax "$pj" --python-torch "$pt" "$@"
