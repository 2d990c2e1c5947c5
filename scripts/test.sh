#!/usr/bin/env bash
# Quick start, part 2: build and run the `cpu` tests (the CI command). The `gpu` tests run on a GPU
# machine through scripts/gpu_run.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$root" -B "$root/build" >/dev/null
cmake --build "$root/build" -j"$(nproc)"
cd "$root/build"
ctest -L cpu -j"$(nproc)" --output-on-failure --timeout 600
