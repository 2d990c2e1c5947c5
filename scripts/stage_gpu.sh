#!/usr/bin/env bash
# Builds a Release tree in build-gpu/ and stages what the GPU machine needs in gpu-dist/ (small
# enough to carry): kilnd, kiln, the `gpu` test binaries and the plugins they load, the GPU
# benchmark, the PyTorch anchors, scripts/gpu_run.sh, and redis-server with its libraries for the
# fleet's GPU test (the GPU machine has none; scripts/stage_redis.sh). On the device:
# `gpu-dist/scripts/gpu_run.sh [--quick]`. Binaries link libstdc++, libgcc and SQLite statically,
# so they run on the GPU machine's Ubuntu.
set -euo pipefail
# KILN_SRC builds another checkout (a clean worktree, say) and stages it into this one.
root=$(cd "$(dirname "$0")/.." && pwd)
src=${KILN_SRC:-$root}
cmake -S "$src" -B "$src/build-gpu" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$src/build-gpu" -j2 --target kilnd kiln_cli kiln_bench_gpu \
  $(cd "$src/tests" && for d in */; do ls "$d"*_gpu_test.cpp >/dev/null 2>&1 && echo "kiln_gpu_tests_${d%/}"; done) \
  $(ls "$src"/families/*/tests/*_gpu_test.cpp >/dev/null 2>&1 && echo kiln_gpu_tests_families)
rm -rf "$root/gpu-dist"
mkdir -p "$root/gpu-dist/tests" "$root/gpu-dist/bench"
cp "$src/build-gpu/kilnd" "$src/build-gpu/kiln" "$root/gpu-dist/"
# The test binaries name kilnd by this absolute path; gpu_run.sh links it to gpu-dist there.
echo "$src/build-gpu" > "$root/gpu-dist/BUILD_PATH"
find "$src/build-gpu/tests" -maxdepth 1 -type f -perm -u+x -name "kiln_gpu_tests_*" -exec cp {} "$root/gpu-dist/tests/" \;
cp "$src/build-gpu/bench/kiln_bench_gpu" "$root/gpu-dist/bench/"
# The plugins the tests load (the example and the C fixture), where the test binaries look for
# them: next to their own folder, as in the build tree (tests/plugin_util.h).
mkdir -p "$root/gpu-dist/plugins/softcap" "$root/gpu-dist/tests/test_plugins"
cp "$src/build-gpu/plugins/softcap/libkiln_softcap.so" "$root/gpu-dist/plugins/softcap/"
cp "$src/build-gpu/tests/test_plugins/libc_ok.so" "$root/gpu-dist/tests/test_plugins/"
# The run script and the PyTorch anchors travel with the binaries they go with, so a device call
# runs what was built even when the checkout it copies holds other work in progress.
mkdir -p "$root/gpu-dist/scripts"
cp "$src/scripts/gpu_run.sh" "$src/scripts/gpu_env.sh" "$root/gpu-dist/scripts/"
cp "$src/bench/torch_anchors.py" "$src/bench/anchor_util.py" "$root/gpu-dist/bench/"
for f in "$src"/families/*/bench/*.py; do
  rel=${f#"$src"/}
  mkdir -p "$root/gpu-dist/$(dirname "$rel")"
  cp "$f" "$root/gpu-dist/$rel"
done
# The fleet tier's GPU test starts real redis-server processes; gpu_run.sh points the tests at this
# one (KILN_REDIS_SERVER).
"$root/scripts/stage_redis.sh" "$root/gpu-dist/redis" >/dev/null
du -sh "$root/gpu-dist"
