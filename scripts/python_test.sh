#!/usr/bin/env bash
# The Python package's CI step (no GPU, no torch): install it the way a user does, `pip install
# ./python` (scikit-build-core builds libkiln.so with CMake), into a venv under build/, then run
# its CPU tests from outside the source tree so they import the installed package.
#
# The wheel is built in build/ itself, configured as scripts/test.sh configures it, so libkiln.so
# is only relinked from the objects that build already has (CMAKE_GENERATOR and the cmake.*
# settings must match that configuration, or CMake would refuse or rebuild everything). Without
# build isolation: scikit-build-core in a fresh temporary environment each time reconfigures from
# scratch, which recompiles everything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KILN_BUILD_DIR:-$root/build}  # the folder scripts/test.sh builds
venv="$build/python-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check numpy pytest ml_dtypes "scikit-build-core>=0.10"
CMAKE_GENERATOR="Unix Makefiles" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps --force-reinstall \
  --config-settings=build-dir="$build" \
  --config-settings=cmake.build-type=RelWithDebInfo \
  --config-settings=cmake.define.KILN_BUILD_TESTS=ON \
  --config-settings=cmake.define.KILN_BUILD_BENCH=ON \
  --config-settings=cmake.define.KILN_BUILD_PLUGINS=ON \
  "$root/python"
cd "$build"
# The package tests, and every family's Python tests (families/*/tests/test_*.py).
"$venv/bin/python" -m pytest -q -rs "$root/tests/python" $(ls "$root"/families/*/tests/test_*.py 2>/dev/null)
