#!/usr/bin/env bash
# The reliability suite (docs/reliability.md) beyond what CI runs.
#
#   scripts/reliability.sh            the CI counts (same as ctest -R reliability)
#   scripts/reliability.sh --long     long-run counts: 200 SIGKILLs, ... (KILN_RELIABILITY_LONG=1)
#   scripts/reliability.sh --soak [MINUTES]
#                                     the mixed-load soak for MINUTES (default 30), its samples
#                                     written to soak-<minutes>min.csv in the build directory
#   scripts/reliability.sh --fuzz [RUNS]
#                                     the protocol fuzzer for RUNS executions (default 1000000)
#
# KILN_BUILD_DIR picks the build directory (default: build). The test binary is built if needed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KILN_BUILD_DIR:-$root/build}
mode=${1:-ci}

build_tests() {
  [ -f "$build/CMakeCache.txt" ] || cmake -S "$root" -B "$build" >/dev/null
  cmake --build "$build" -j"$(nproc)" --target kiln_tests_reliability >/dev/null
}

case "$mode" in
  ci)
    build_tests
    "$build/tests/kiln_tests_reliability"
    ;;
  --long)
    build_tests
    KILN_RELIABILITY_LONG=1 "$build/tests/kiln_tests_reliability" --gtest_filter='-Soak.*'
    ;;
  --soak)
    minutes=${2:-30}
    build_tests
    csv="$build/soak-${minutes}min.csv"
    KILN_SOAK_SECONDS=$((minutes * 60)) KILN_SOAK_CSV="$csv" \
      "$build/tests/kiln_tests_reliability" --gtest_filter='Soak.*'
    echo "samples: $csv"
    ;;
  --fuzz)
    "$root/scripts/fuzz.sh" "${2:-1000000}"
    ;;
  *)
    sed -n '2,14p' "$0" >&2
    exit 2
    ;;
esac
