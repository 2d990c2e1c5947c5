#!/usr/bin/env bash
# Installs kiln's build dependencies from Debian's packages (needs root or sudo). The CUDA toolkit
# (headers and NVRTC) is expected at /usr/local/cuda; it is not a Debian package.
set -euo pipefail
pkgs="cmake g++ make libsqlite3-dev libboost-dev nlohmann-json3-dev libcli11-dev libgtest-dev libbenchmark-dev python3-venv python3-dev clang libclang-rt-dev redis-server libssl-dev openssl"
# clang and libclang-rt-dev: the libFuzzer build of scripts/fuzz.sh (docs/reliability.md).
# python3-dev: Python.h for the Python package's extension module (kiln._fast, python/src/_fast.c).
# redis-server: the remote cache tier's tests start real servers (tests/remote; docs/reliability.md).
# libssl-dev: TLS to the remote tier's Redis (remote/tls.h); openssl: the TLS tests' throwaway CA.
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq $missing
fi
if [ ! -f /usr/local/cuda/include/nvrtc.h ]; then
  echo "deps: the CUDA toolkit (nvrtc.h, cuda.h, libnvrtc) is not at /usr/local/cuda; install it or pass -DCUDAToolkit_ROOT=..." >&2
  exit 1
fi
