# Sourced by the GPU machine's run scripts (gpu_run.sh, gpu_attention.sh, gpu_family.sh), from the
# repository root: sets `dist` (the staged binaries: the script's own gpu-dist/ when it is the
# staged copy, else ./gpu-dist), creates $out, links gpu-dist where the test binaries look for
# kilnd (the absolute build path they were linked with), gives the run a private kernel cache
# (seeded from KILN_CACHE_SEED when set) and runtime directory, records the device in
# $out/device.txt, and defines gpu_tests.
dist=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$dist/kilnd" ] || dist=$PWD/gpu-dist
mkdir -p "$out"
build_path=$(cat "$dist/BUILD_PATH")
if [ ! -e "$build_path" ]; then mkdir -p "$(dirname "$build_path")" && ln -s "$dist" "$build_path"; fi
export KILN_CACHE_DIR=$(mktemp -d)
# KILN_CACHE_SEED: a kernels.sqlite prewarmed on the build machine (`kiln prewarm --spec` or
# `--arch`); keys do not depend on the device, so the run starts with those variants compiled.
# The GPU tests and the bench start their private caches from it too (KILN_GPU_TEST_CACHE).
if [ -n "${KILN_CACHE_SEED:-}" ]; then
  cp "$KILN_CACHE_SEED" "$KILN_CACHE_DIR/kernels.sqlite"
  export KILN_GPU_TEST_CACHE="$KILN_CACHE_DIR/kernels.sqlite"
fi
export XDG_RUNTIME_DIR=$(mktemp -d)
chmod 700 "$XDG_RUNTIME_DIR"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"

# gpu_tests FILTER [CONFORMANCE]: the families binary's GPU tests matching FILTER (GPU_FILTER
# overrides it) and, with CONFORMANCE, the GPU conformance of the families it names (a gtest
# pattern on the family); logs in $out. Fails on a failed test, and on a skipped one: a skipped
# GPU test is not a pass on a machine that has a GPU.
gpu_tests() {
  local r=0
  timeout -k 5 400 "$dist/tests/kiln_gpu_tests_families" --gtest_filter="${GPU_FILTER:-$1}" 2>&1 |
    tee "$out/gpu_tests.log" || r=1
  if [ -n "${2:-}" ]; then
    timeout -k 5 300 "$dist/tests/kiln_gpu_tests_conformance" --gtest_filter="AllFamilies/ConformanceGpu.*/$2" 2>&1 |
      tee "$out/conformance.log" || r=1
  fi
  if grep -q "SKIPPED \]" "$out"/gpu_tests.log "$out"/conformance.log 2>/dev/null; then
    echo "GPU TESTS WERE SKIPPED"
    r=1
  fi
  return $r
}
