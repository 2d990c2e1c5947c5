#!/usr/bin/env bash
# Quick start, part 1: install dependencies, build, and run kiln's main job on the embedded default
# (no daemon): prewarm every family's catalog for Hopper and Ampere into the cache with NVRTC (no GPU
# needed), then list what was cached.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build" -j"$(nproc)"
"$root/build/kiln" --embedded prewarm --arch sm_90a,sm_80
"$root/build/kiln" --embedded ls
"$root/build/kiln" --embedded stats
