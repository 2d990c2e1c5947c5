#!/usr/bin/env bash
# Runs on the GPU machine from a directory holding gpu-dist/ (scripts/stage_gpu.sh): `kiln tune`
# on each line of a problems list, so each prints the tuning space's winner against the
# heuristic's choice on this GPU. Lines: FAMILY DTYPE SHAPE (as `kiln tune --shape`); # comments.
#   scripts/tune_probe.sh bench/tune_probe.txt      # log in $OUT/tune_probe.log
set -uo pipefail
list=${1:?problems list}
out=${OUT:-gpu-out}
mkdir -p "$out"
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-$(mktemp -d)}
rc=0
while read -r family dtype shape; do
  case "$family" in ''|'#'*) continue ;; esac
  echo "== $family $dtype $shape"
  timeout -k 5 120 gpu-dist/kiln --embedded tune --family "$family" --dtype "$dtype" --shape "$shape" 2>&1 || rc=1
done < "$list" | tee "$out/tune_probe.log"
exit $rc
