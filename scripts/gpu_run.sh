#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool) from the repository root with gpu-dist/ carried (see
# scripts/stage_gpu.sh): every `gpu` test binary, then kiln's GPU benchmark and the PyTorch
# anchors in the same command, so ratios come from one run. Logs and JSON go to $OUT.
#   scripts/gpu_run.sh [--quick]
# Env: GPU_TESTS (glob of test binaries), BENCH_ARGS (e.g. "--only variants"), TORCH_ARGS
# (e.g. "--only rmsnorm"; "skip" skips the PyTorch anchors).
set -uo pipefail
quick=${1:-}
BENCH_ARGS=${BENCH_ARGS:-}
TORCH_ARGS=${TORCH_ARGS:-}
out=${OUT:-gpu-out}
# Staged copies of this script live in gpu-dist/scripts/ (scripts/stage_gpu.sh), beside the
# binaries and the PyTorch anchors they go with.
. "$(dirname "$0")/gpu_env.sh"
# The GPU machine has no redis-server: the fleet's GPU test starts the one staged in gpu-dist/redis
# (scripts/stage_redis.sh), whose wrapper gives it its own libraries and nothing else.
if [ -z "${KILN_REDIS_SERVER:-}" ] && [ -x "$dist/redis/bin/redis-server" ]; then
  export KILN_REDIS_SERVER="$dist/redis/bin/redis-server"
fi
rc=0
# Every catalog for this GPU first, on all cores: the tests start from copies of this cache
# (KILN_GPU_TEST_CACHE), and so does the bench's runtime.
t0=$SECONDS
"$dist/kiln" --embedded prewarm --arch sm_90a --jobs "$(nproc)" 2>&1 | tail -2 | tee "$out/prewarm.log"
echo "prewarm sm_90a took $((SECONDS - t0)) s" | tee -a "$out/prewarm.log"
export KILN_GPU_TEST_CACHE="$KILN_CACHE_DIR/kernels.sqlite"
touch "$out/gpu_tests.log"
# GPU_TESTS narrows the test binaries (a glob on their names; "none" runs none).
for t in "$dist"/tests/${GPU_TESTS:-kiln_gpu_tests_*}; do
  [ -x "$t" ] || continue
  timeout -k 5 300 "$t" 2>&1 | tee -a "$out/gpu_tests.log" || rc=1
done
# A skipped GPU test is not a pass on a machine that has a GPU.
if grep -q "SKIPPED \]" "$out/gpu_tests.log"; then echo "GPU TESTS WERE SKIPPED"; rc=1; fi
timeout -k 5 400 "$dist/bench/kiln_bench_gpu" --json "$out/bench.json" --kilnd "$dist/kilnd" $quick $BENCH_ARGS 2>&1 | tee "$out/bench.log" || rc=1
[ "$TORCH_ARGS" = skip ] || PYTHONUNBUFFERED=1 timeout -k 5 300 python3 "$dist/bench/torch_anchors.py" $quick --json "$out/torch.json" $TORCH_ARGS 2>&1 | tee "$out/torch.log" || rc=1
echo "gpu_run exit $rc"
exit $rc
