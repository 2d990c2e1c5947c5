#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool) from the repository root with gpu-dist/ carried (see
# scripts/stage_gpu.sh, then scripts/stage_python.sh): one family group's GPU tests (C++ and
# Python), its section of kiln's bench, and its PyTorch anchors with kiln importable (moe:
# torch._grouped_mm, torch._scaled_grouped_mm and the whole layer beside kiln.torch.fused_moe;
# lora: the cuBLAS base GEMM, PEFT's eager adapter, the LoRA MLP step and multi-adapter decode) in
# the same command, so the ratios come from one run. Logs go to $OUT.
#   scripts/gpu_family.sh moe|lora [--quick]
# Env: GPU_FILTER (gtest filter of the families binary; default the group's tests), PYTEST_K
# (pytest -k expression; default the group's name), SKIP_TESTS=1 (benchmarks only).
set -uo pipefail
group=${1:-}
quick=${2:-}
case "$group" in
  moe) tests="MoeGpu.*" conformance="grouped_gemm*" ;;
  lora) tests="LoraGpu.*" conformance="lora*" ;;
  *) echo "usage: scripts/gpu_family.sh moe|lora [--quick]" >&2; exit 2 ;;
esac
out=${OUT:-gpu-out}
root=$PWD
. "$(dirname "$0")/gpu_env.sh"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  gpu_tests "$tests" "$conformance" || rc=1
fi
timeout -k 5 400 "$dist/bench/kiln_bench_gpu" --json "$out/bench.json" --kilnd "$dist/kilnd" $quick --only "$group" 2>&1 |
  tee "$out/bench.log" || rc=1
# The group's Python tests (kiln.torch's ops and modules against PyTorch), then the anchors.
py_parts=anchors
[ "${SKIP_TESTS:-0}" != 1 ] && py_parts="tests anchors"
PYTEST_K=${PYTEST_K:-$group} TORCH_ARGS="--only $group" OUT=$out bash "$root/scripts/python_gpu_run.sh" $quick $py_parts || rc=1
echo "gpu_family $group exit $rc"
exit $rc
