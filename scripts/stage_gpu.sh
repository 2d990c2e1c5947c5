#!/usr/bin/env bash
# Builds a Release tree in build-gpu/ and stages what the GPU machine needs in gpu-dist/ (small
# enough to carry): kilnd, kiln, the `gpu` test binaries and the GPU benchmark. Binaries link
# libstdc++, libgcc and SQLite statically, so they run on the GPU machine's Ubuntu.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$root" -B "$root/build-gpu" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build-gpu" -j2 --target kilnd kiln_cli kiln_bench_gpu \
  $(cd "$root/tests" && for d in */; do ls "$d"*_gpu_test.cpp >/dev/null 2>&1 && echo "kiln_gpu_tests_${d%/}"; done)
rm -rf "$root/gpu-dist"
mkdir -p "$root/gpu-dist/tests" "$root/gpu-dist/bench"
cp "$root/build-gpu/kilnd" "$root/build-gpu/kiln" "$root/gpu-dist/"
find "$root/build-gpu/tests" -maxdepth 1 -type f -perm -u+x -name "kiln_gpu_tests_*" -exec cp {} "$root/gpu-dist/tests/" \;
cp "$root/build-gpu/bench/kiln_bench_gpu" "$root/gpu-dist/bench/"
du -sh "$root/gpu-dist"
