#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) in build-fuzz/ and runs the protocol
# fuzzer. Usage: scripts/fuzz.sh [RUNS]   (default 20000 executions; 0 = until stopped)
# A crash leaves its input as build-fuzz/crash-* and makes this script fail.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
runs=${1:-20000}
build="$root/build-fuzz"
cmake -S "$root" -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKILN_BUILD_FUZZ=ON -DKILN_STATIC_RUNTIME=OFF -DKILN_BUILD_TESTS=OFF -DKILN_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target kiln_fuzz_protocol
# A scratch corpus: the seeds stay as committed, what the fuzzer finds stays in the build dir.
corpus="$build/corpus-protocol"
mkdir -p "$corpus"
cd "$build"
# -max_len: a header plus a body well past the interesting sizes; -timeout: one input may not
# take a second (a hang is a finding too).
./fuzz/kiln_fuzz_protocol -runs="$runs" -max_len=4096 -timeout=1 -print_final_stats=1 \
  "$corpus" "$root/fuzz/corpus/protocol"
