#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool) from the repository root with gpu-dist/ carried (see
# scripts/stage_gpu.sh): the attention backward's GPU tests and conformance check, then kiln's
# backward benchmark and the cuDNN / FlashAttention-2 SDPA anchors in the same command, so the
# ratios come from one run. Logs go to $OUT.
#   scripts/gpu_attention_bwd.sh [--quick]
# Env: GPU_FILTER (gtest filter of the families binary; default the attention backward and the
# sm_90a forward), SKIP_TESTS=1 (benchmarks only).
set -uo pipefail
quick=${1:-}
out=${OUT:-gpu-out}
dist=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$dist/kilnd" ] || dist=$PWD/gpu-dist
root=$PWD
mkdir -p "$out"
build_path=$(cat "$dist/BUILD_PATH")
if [ ! -e "$build_path" ]; then mkdir -p "$(dirname "$build_path")" && ln -s "$dist" "$build_path"; fi
export KILN_CACHE_DIR=$(mktemp -d)
export XDG_RUNTIME_DIR=$(mktemp -d)
chmod 700 "$XDG_RUNTIME_DIR"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout -k 5 400 "$dist/tests/kiln_gpu_tests_families" \
    --gtest_filter="${GPU_FILTER:-AttentionBwdGpu.*:AttentionSm90Gpu.*}" 2>&1 | tee "$out/gpu_tests.log" || rc=1
  timeout -k 5 300 "$dist/tests/kiln_gpu_tests_conformance" \
    --gtest_filter='AllFamilies/ConformanceGpu.*/attention_bwd' 2>&1 | tee "$out/conformance.log" || rc=1
  if grep -q "SKIPPED \]" "$out/gpu_tests.log" "$out/conformance.log"; then echo "GPU TESTS WERE SKIPPED"; rc=1; fi
fi
KILN_BENCH_ATTENTION_PART=backward timeout -k 5 400 "$dist/bench/kiln_bench_gpu" --json "$out/bench.json" \
  --kilnd "$dist/kilnd" $quick --only attention 2>&1 | tee "$out/bench.log" || rc=1
(cd "$root/families/attention/bench" &&
  PYTHONUNBUFFERED=1 timeout -k 5 300 python3 -c "import attention; attention.run_backward('$quick' == '--quick')") \
  2>&1 | tee "$out/torch.log" || rc=1
echo "gpu_attention_bwd exit $rc"
exit $rc
