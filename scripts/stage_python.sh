#!/usr/bin/env bash
# Builds the kiln wheel (cp310-abi3-linux_x86_64: libkiln.so, the extension module kiln._fast and
# the Python package) and stages it in gpu-dist/python/ with the wheels of pytest and its
# dependencies, for a GPU machine that has Python and torch but no compiler or network. Run it
# after scripts/stage_gpu.sh, which empties gpu-dist/ (and provides the kilnd the daemon test
# starts). Then, on the GPU machine:
#   scripts/python_gpu_run.sh      # the GPU tests and the benchmarks, logs in $OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src=${KILN_SRC:-$root}
build="$src/build-python"
venv="$build/venv"
mkdir -p "$build"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10"
dist="$root/gpu-dist/python"
rm -rf "$dist"
mkdir -p "$dist"
# No build isolation, a fixed build folder: a second run relinks instead of rebuilding.
"$venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
  --config-settings=build-dir="$build/cmake" -w "$dist" "$src/python"
# pytest for the GPU machine's Python (pure-Python wheels: any version).
"$venv/bin/python" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --platform any -d "$dist" pytest
# The peers the benchmarks compare with that the GPU machine lacks: Liger's Triton kernels (pure
# Python), in a folder of their own so the tests' install does not pick them up.
"$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$dist/peers" "liger-kernel==0.8.5"
ls -la "$dist"
du -sh "$dist"
