#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool) from the repository root with gpu-dist/ carried (see
# scripts/stage_gpu.sh): one part of the attention bench with its GPU tests, then the PyTorch
# anchors of that part in the same command, so the ratios come from one run. Logs go to $OUT.
#   scripts/gpu_attention.sh PART [--quick]
# PART: forward (the forward's checks and the heuristic's rows, with the rest of the default bench,
# beside SDPA's cuDNN and flash backends), variants (every tuning-space variant of the forward
# beside the same anchors), backward (kiln's backward beside SDPA's cuDNN and flash backends) or
# masks (sliding windows and packed documents beside FlexAttention and cuDNN's causal SDPA, and
# kiln's Python op beside them in the same process when the wheel is staged).
# Env: GPU_FILTER (gtest filter of the families binary; default the part's tests), SKIP_TESTS=1
# (benchmarks only).
set -uo pipefail
part=${1:-}
quick=${2:-}
bench_env=KILN_BENCH_ATTENTION_PART=$part
case "$part" in
  forward) filter='AttentionGpu.*:AttentionSm90Gpu.*' conformance=attention anchor=run_forward bench_env=KILN_BENCH_ATTENTION_PART= ;;
  variants) filter='AttentionSm90Gpu.*' conformance='' anchor=run_forward bench_env=KILN_BENCH_ATTENTION_VARIANTS=only ;;
  backward) filter='AttentionBwdGpu.*:AttentionSm90Gpu.*' conformance=attention_bwd anchor=run_backward ;;
  masks) filter='AttentionGpu.*:AttentionSm90Gpu.*' conformance='' anchor=run_masks ;;
  *) echo "usage: scripts/gpu_attention.sh forward|variants|backward|masks [--quick]" >&2; exit 2 ;;
esac
out=${OUT:-gpu-out}
root=$PWD
. "$(dirname "$0")/gpu_env.sh"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  gpu_tests "$filter" "$conformance" || rc=1
fi
env "$bench_env" timeout -k 5 400 "$dist/bench/kiln_bench_gpu" --json "$out/bench.json" \
  --kilnd "$dist/kilnd" $quick --only attention 2>&1 | tee "$out/bench.log" || rc=1
# The staged kiln wheel, where there is one, makes kiln importable beside the anchors (the masks
# part then times kiln's Python op against FlexAttention in the same process).
site=""
if ls "$dist"/python/kiln-*.whl >/dev/null 2>&1; then
  site=$(mktemp -d)/site
  python3 -m pip install -q --no-index --no-deps --target "$site" "$dist"/python/kiln-*.whl >"$out/pip.log" 2>&1 || site=""
fi
(cd "$root/families/attention/bench" &&
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout -k 5 300 \
    python3 -c "import attention; attention.$anchor('$quick' == '--quick')") \
  2>&1 | tee "$out/torch.log" || rc=1
echo "gpu_attention $part exit $rc"
exit $rc
