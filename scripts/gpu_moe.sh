#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool) from the repository root with gpu-dist/ carried (see
# scripts/stage_gpu.sh, then scripts/stage_python.sh): the MoE GPU tests (C++ and Python), kiln's
# MoE bench, and the PyTorch anchors with kiln importable (torch._grouped_mm, torch._scaled_grouped_mm and the whole
# layer beside kiln.torch.fused_moe) in the same command, so the ratios come from one run. Logs go
# to $OUT.
#   scripts/gpu_moe.sh [--quick]
# Env: GPU_FILTER (gtest filter of the families binary; default the MoE tests), PYTEST_K (pytest
# -k expression; default "moe"), SKIP_TESTS=1 (benchmarks only).
set -uo pipefail
quick=${1:-}
out=${OUT:-gpu-out}
root=$PWD
. "$(dirname "$0")/gpu_env.sh"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout -k 5 400 "$dist/tests/kiln_gpu_tests_families" --gtest_filter="${GPU_FILTER:-MoeGpu.*}" 2>&1 |
    tee "$out/gpu_tests.log" || rc=1
  timeout -k 5 300 "$dist/tests/kiln_gpu_tests_conformance" \
    --gtest_filter='AllFamilies/ConformanceGpu.*/grouped_gemm*' 2>&1 | tee "$out/conformance.log" || rc=1
  if grep -q "SKIPPED \]" "$out"/gpu_tests.log "$out"/conformance.log 2>/dev/null; then
    echo "GPU TESTS WERE SKIPPED"
    rc=1
  fi
fi
timeout -k 5 400 "$dist/bench/kiln_bench_gpu" --json "$out/bench.json" --kilnd "$dist/kilnd" $quick --only moe 2>&1 |
  tee "$out/bench.log" || rc=1
# The Python MoE tests (kiln.torch's ops and the layer's gradients against PyTorch), then the anchors.
py_parts=anchors
[ "${SKIP_TESTS:-0}" != 1 ] && py_parts="tests anchors"
PYTEST_K=${PYTEST_K:-moe} TORCH_ARGS="--only moe" OUT=$out bash "$root/scripts/python_gpu_run.sh" $quick $py_parts || rc=1
echo "gpu_moe exit $rc"
exit $rc
