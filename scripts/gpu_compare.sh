#!/usr/bin/env bash
# Runs on the GPU machine: the GPU tests and benchmarks of two staged builds, one after the other
# on the same machine, for a before/after comparison of a change (docs/benchmarks.md).
#   scripts/gpu_compare.sh BEFORE.tgz AFTER.tgz [gpu_run.sh arguments]
# Each archive is a gpu-dist/ folder as scripts/stage_gpu.sh leaves it, packed with
#   tar czf build-carry/NAME.tgz -C <checkout> gpu-dist
# Env: as scripts/gpu_run.sh (GPU_TESTS, BENCH_ARGS, TORCH_ARGS); ORDER="after before" swaps the
# order. Logs and JSON go to $OUT/before and $OUT/after.
set -uo pipefail
before=$1 after=$2
shift 2
out=${OUT:-gpu-out}
rc=0
for which in ${ORDER:-before after}; do
  archive=$before
  [ "$which" = after ] && archive=$after
  dir=$(mktemp -d)
  tar xzf "$archive" -C "$dir"
  echo "== $which: $archive"
  OUT="$out/$which" "$dir/gpu-dist/scripts/gpu_run.sh" "$@" || rc=1
done
echo "gpu_compare exit $rc"
exit $rc
