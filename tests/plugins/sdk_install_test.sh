#!/usr/bin/env bash
# The installed SDK end to end: installs kiln's build into a temporary prefix, checks that every
# installed header compiles on its own, builds a C program against kiln::kiln and the example
# plugin (plugins/softcap) as projects of their own with find_package(kiln), and loads the plugin
# with the installed kiln: listed by `kiln plugins`, rendered by `kiln why`, and its catalog
# compiled by `kiln prewarm` (when NVRTC loads).
#   sdk_install_test.sh <kiln build dir> <kiln source dir> <C++ compiler> <C compiler>
set -euo pipefail
build=$1 src=$2 cxx=$3 cc=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

step() { echo "== $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

step "install into $prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in include/kiln/family.h include/kiln/plugin_cpp.h include/kiln/half.h include/kiln/embedded_templates.h \
         lib/libkiln.so lib/libkiln_family_sdk.a lib/cmake/kiln/kilnConfig.cmake lib/cmake/kiln/KilnPlugin.cmake \
         lib/cmake/kiln/embed_templates.cmake lib/cmake/kiln/kiln_plugin.map bin/kiln bin/kilnd; do
  [[ -e $prefix/$f ]] || fail "$f was not installed"
done

step "every installed header compiles alone, with only the prefix on the include path"
for h in "$prefix"/include/kiln/*.h; do
  echo "#include <kiln/${h##*/}>" | "$cxx" -std=c++20 -fsyntax-only -Wall -Werror -I"$prefix/include" -x c++ - ||
    fail "kiln/${h##*/} is not self-contained"
done
# The C ABI headers are C too.
for h in kiln.h plugin.h; do
  echo "#include <kiln/$h>" | "$cc" -std=c11 -fsyntax-only -Wall -Werror -I"$prefix/include" -x c - ||
    fail "kiln/$h does not compile as C"
done

step "a program links kiln::kiln (libkiln.so, the C ABI) from the package"
mkdir "$work/app"
cat >"$work/app/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.24)
project(kiln_c_app LANGUAGES C)
find_package(kiln REQUIRED)
add_executable(app app.c)
target_link_libraries(app PRIVATE kiln::kiln)
CMAKE
cat >"$work/app/app.c" <<'C'
#include <stdio.h>
#include <kiln/kiln.h>
int main(void) { printf("%d %s\n", kiln_abi_version(), kiln_code_name(KILN_OK)); return 0; }
C
cmake -S "$work/app" -B "$work/app/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  >"$work/app.log" || { cat "$work/app.log"; fail "configuring a kiln::kiln user failed"; }
cmake --build "$work/app/build" >>"$work/app.log" || { cat "$work/app.log"; fail "building a kiln::kiln user failed"; }
"$work/app/build/app" || fail "a kiln::kiln user does not run"

step "build plugins/softcap against the installed kiln"
cmake -S "$src/plugins/softcap" -B "$work/softcap" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" \
  >"$work/configure.log" || { cat "$work/configure.log"; fail "configuring the plugin failed"; }
cmake --build "$work/softcap" -j2
so=$work/softcap/libkiln_softcap.so
[[ -f $so ]] || fail "no $so"
exported=$(nm -D --defined-only "$so" | awk '{print $3}')
[[ $exported == kiln_plugin_entry ]] || fail "the plugin exports more than its entry point: $exported"

# The loader wants a plugin nobody else can write, in a directory nobody else can write.
plugins=$work/plugins
mkdir -m 0755 "$plugins"
install -m 0755 "$so" "$plugins/"
export KILN_PLUGIN_PATH=$plugins KILN_CACHE_DIR=$work/cache KILN_SOCKET=$work/kilnd.sock
kiln=$prefix/bin/kiln

step "kiln plugins"
"$kiln" plugins --json >"$work/plugins.json"
cat "$work/plugins.json"
grep -q '"name": "kiln-example-softcap"' "$work/plugins.json" || fail "the plugin did not load"
grep -q '"skipped": \[\]' "$work/plugins.json" || fail "a plugin was skipped"

step "kiln why"
"$kiln" --embedded why 'softcap(block=256,dtype=bf16,vec=8)' --arch sm_90a | tee "$work/why.txt"
grep -q 'plugin kiln-example-softcap 1.0.0' "$work/why.txt" || fail "the key does not name the plugin"

step "kiln prewarm"
if "$kiln" --embedded prewarm --arch sm_90a --family softcap --jobs 2 --json >"$work/prewarm.json" 2>"$work/prewarm.err"; then
  cat "$work/prewarm.json"
  grep -q '"failed": 0' "$work/prewarm.json" || fail "variants failed to compile"
  grep -q '"compiled": 33' "$work/prewarm.json" || fail "the catalog (33 variants) was not compiled"
elif grep -qi 'nvrtc' "$work/prewarm.err"; then
  echo "NVRTC unavailable: prewarm left out"; cat "$work/prewarm.err"
else
  cat "$work/prewarm.json" "$work/prewarm.err"
  fail "kiln prewarm failed"
fi
echo "OK"
