#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool) from the repository root with gpu-dist/ carried (see
# scripts/stage_gpu.sh): every `gpu` test binary, then kiln's GPU benchmark and the PyTorch
# anchors in the same command, so ratios come from one run. Logs and JSON go to $OUT.
#   scripts/gpu_run.sh [--quick]
set -uo pipefail
quick=${1:-}
BENCH_ARGS=${BENCH_ARGS:-}
TORCH_ARGS=${TORCH_ARGS:-}
out=${OUT:-gpu-out}
mkdir -p "$out"
# The test binaries name kilnd by the absolute path it had on the build machine.
build_path=$(cat gpu-dist/BUILD_PATH)
if [ ! -e "$build_path" ]; then mkdir -p "$(dirname "$build_path")" && ln -s "$PWD/gpu-dist" "$build_path"; fi
export KILN_CACHE_DIR=$(mktemp -d)
export XDG_RUNTIME_DIR=$(mktemp -d)
chmod 700 "$XDG_RUNTIME_DIR"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
rc=0
for t in gpu-dist/tests/kiln_gpu_tests_*; do
  timeout -k 5 240 "$t" 2>&1 | tee -a "$out/gpu_tests.log" || rc=1
done
# A skipped GPU test is not a pass on a machine that has a GPU.
if grep -q "SKIPPED \]" "$out/gpu_tests.log"; then echo "GPU TESTS WERE SKIPPED"; rc=1; fi
timeout -k 5 240 gpu-dist/bench/kiln_bench_gpu --json "$out/bench.json" --kilnd gpu-dist/kilnd $quick $BENCH_ARGS 2>&1 | tee "$out/bench.log" || rc=1
PYTHONUNBUFFERED=1 timeout -k 5 300 python3 bench/torch_anchors.py $quick --json "$out/torch.json" $TORCH_ARGS 2>&1 | tee "$out/torch.log" || rc=1
echo "gpu_run exit $rc"
exit $rc
