#!/usr/bin/env bash
# Quick start, part 2: build and run the `cpu` tests (the CI command). The `gpu` tests run on a GPU
# machine through scripts/gpu_run.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$root" -B "$root/build" >/dev/null
cmake --build "$root/build" -j"$(nproc)"
cd "$root/build"
ctest -L cpu -j"$(nproc)" --output-on-failure --timeout 600
# The Python package: pip install ./python into a venv under build/, then its CPU tests.
"$root/scripts/python_test.sh"
# The protocol fuzzer (clang, ASan + UBSan), a short run: a crash fails CI (docs/reliability.md).
"$root/scripts/fuzz.sh" 50000
