#!/usr/bin/env bash
# Download the wheels scripts/device_check.sh needs on an offline NVIDIA image into .whl/ (run where the
# package index is reachable; the folder travels with the repository to the GPU machine):
#   scripts/device/wheels.sh [DIR]     (default .whl)
# Exactly the pins of scripts/device/wheels.txt, each for CPython 3.12 on manylinux x86_64, no
# dependencies (the image has the rest). Idempotent: a wheel already there is not fetched again.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.whl}
mkdir -p "$dir"
py=$(command -v python3)
mapfile -t pins < <(grep -vE '^\s*(#|$)' scripts/device/wheels.txt)
plats=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
  manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  plats+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" -d "$dir" "${pins[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
n=$(find "$dir" -name '*.whl' | wc -l)
echo "[wheels] $n wheels in $dir ($(du -sh "$dir" | cut -f1)); the device machine takes at most 64 MiB with the tree"
