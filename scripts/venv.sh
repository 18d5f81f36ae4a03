#!/usr/bin/env bash
# Create or refresh a backend venv idempotently: scripts/venv.sh jax|torch|jax-next
#   jax      -> .venv-jax      on Python 3.12 (sglang-jax needs >= 3.12), with sglang-jax's pins (jax 0.10.2)
#   torch    -> .venv-torch    on Python 3.11 (torch==2.13.0 CPU wheel on these machines) or 3.12
#   jax-next -> .venv-jax-next on Python 3.12: the packages of an NVIDIA accelerator image (jax 0.11.2,
#               transformers 5; scripts/device/image.txt, CPU jax) plus the wheels the device check carries
#               there (scripts/device/wheels.txt, no dependencies): the JAX backend on the next JAX
# The install is skipped when the venv's stamp matches the hash of pyproject.toml and this script.
# jax also gets the compile-only TPU/GPU compilers in .venv-jax/plan-compilers (python -m mllm_rl.memplan).
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${1:?usage: scripts/venv.sh jax|torch}

find_python() {  # $1 = wanted minor version (3.12); PATH first, then pyenv
  local want=$1 py
  for py in "python$want" python3 python; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
      command -v "$py"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local v
    for v in $(pyenv versions --bare 2>/dev/null | grep -E "^${want//./\\.}(\.|$)" | sort -rV); do
      py=$(PYENV_VERSION=$v pyenv which "python$want" 2>/dev/null || true)
      if [ -n "$py" ] && [ -x "$py" ]; then echo "$py"; return 0; fi
    done
  fi
  return 1
}

case "$backend" in
  jax)   venv=.venv-jax;   pys=(3.12);      extras="jax,wandb,dev" ;;
  torch) venv=.venv-torch; pys=(3.11 3.12); extras="torch,wandb,dev" ;;
  jax-next) venv=.venv-jax-next; pys=(3.12); extras="" ;;
  *) echo "error: unknown backend '$backend' (jax|torch|jax-next)" >&2; exit 2 ;;
esac

stamp_want=$(cat pyproject.toml scripts/venv.sh scripts/device/image.txt scripts/device/wheels.txt | sha256sum | cut -c1-16)
if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp_want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

py=""
for v in "${pys[@]}"; do py=$(find_python "$v") && break || py=""; done
if [ -z "$py" ]; then
  echo "error: $venv needs Python ${pys[*]}; none found on PATH or in pyenv. Install one (e.g. 'pyenv install 3.12') and retry." >&2
  exit 2
fi
echo "[venv] $venv from $py ($("$py" --version 2>&1))" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# A pip config may name local indexes that do not exist; drop those warnings.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet "$venv/bin/python" -m pip install -q --upgrade pip
if [ "$backend" = torch ] && "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  # CPU hosts: torch 2.13.0 for Python 3.11 is pinned (a CPU build); an unpinned torch can pull a
  # multi-GB CUDA build. GPU hosts install their own torch first.
  "$venv/bin/python" -c 'import torch' 2>/dev/null || quiet "$venv/bin/python" -m pip install -q "torch==2.13.0"
fi
if [ "$backend" = jax-next ]; then
  quiet "$venv/bin/python" -m pip install -q -r scripts/device/image.txt
  # shellcheck disable=SC2046  # one requirement per word
  quiet "$venv/bin/python" -m pip install -q --no-deps $(grep -vE '^\s*(#|$)' scripts/device/wheels.txt | grep -v torch-memory-saver)
  PYTHONWARNINGS="ignore:Editable installation" quiet "$venv/bin/python" -m pip install -q --no-deps -e .
  echo "$stamp_want" > "$venv/.stamp"
  exit 0
fi
# setuptools says "Editable installation ... Please be careful with folders ..." on every
# editable install with a package-dir mapping (informational): kept out of the log.
PYTHONWARNINGS="ignore:Editable installation" quiet "$venv/bin/python" -m pip install -q -e ".[$extras]"
if [ "$backend" = jax ]; then
  # The TPU and GPU compilers for compile-only memory plans (python -m mllm_rl.memplan), at the
  # pins of the 'tpu' and 'gpu-plan' extras, in a directory only the planner puts on sys.path:
  # JAX loads every installed plugin at start-up, so in site-packages they would cost every
  # plain CPU run host memory and start-up time (docs/PLAN.md).
  pins=$("$venv/bin/python" - <<'PY'
import importlib.metadata as md
import tomllib

extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
want = next(r for r in extras["tpu"] if r.startswith("jax[tpu]==")).split("==")[1]
have = md.version("jax")
if have != want:
    raise SystemExit(f"error: .venv-jax has jax {have}, the 'tpu' extra pins {want}")
libtpu = next(r.split(";")[0].strip() for r in md.requires("jax") if r.startswith("libtpu") and '"tpu"' in r)
print(libtpu, *extras["gpu-plan"])
PY
)
  rm -rf "$venv/plan-compilers"
  # shellcheck disable=SC2086  # $pins: several requirement words
  quiet "$venv/bin/python" -m pip install -q --no-deps --target "$venv/plan-compilers" $pins
fi
echo "$stamp_want" > "$venv/.stamp"
