#!/usr/bin/env bash
# Runs the shape sweep (bench/sweep/run.py) on the GPU machine, from a directory that holds
# gpu-dist/ (scripts/stage_gpu.sh, then scripts/stage_python.sh), the checkout's bench/ and the
# Liger wheel (build-carry/liger_kernel-*.whl, else the one stage_python.sh put in
# gpu-dist/python/peers/). Installs both wheels into a private folder, keeps the compile caches
# (kiln, Inductor, Triton) under /tmp so that a second call on a warm machine does not compile
# again, writes the JSON and the log to $OUT and prints the report last.
#   SWEEP_ARGS="--shard 1/8" scripts/sweep_gpu_run.sh    # run.py's arguments, --json aside
# The JSON is $OUT/sweep.json, or $OUT/sweep-I-of-N.json for --shard I/N. SWEEP_TIMEOUT (default
# 570) bounds run.py, whose --budget-s (default 480) stops it cleanly before.
set -uo pipefail
root=$PWD
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
site=$(mktemp -d)/site
py=${PYTHON:-python3}
args=${SWEEP_ARGS:-}
if ! "$py" -m pip install --no-index --no-deps --target "$site" gpu-dist/python/*.whl >"$out/python_install.log" 2>&1; then
  # No pip: a wheel is a zip archive laid out for site-packages.
  "$py" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    "$site" gpu-dist/python/*.whl || { echo "cannot install the wheels"; exit 1; }
  chmod +x "$site"/kiln/libkiln.so
fi
liger=$(ls build-carry/liger_kernel-*.whl 2>/dev/null | head -1)
[ -n "$liger" ] || liger=$(ls gpu-dist/python/peers/liger_kernel-*.whl 2>/dev/null | head -1)
if [ -n "$liger" ]; then
  "$py" -m pip install --no-deps --no-index --target "$site" "$liger" >>"$out/python_install.log" 2>&1 \
    || echo "cannot install $liger: the sweep runs without Liger"
else
  echo "no liger_kernel wheel in build-carry/ or gpu-dist/python/peers/: the sweep runs without Liger"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-python-gpu-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/kiln-sweep-inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kiln-sweep-triton}
export XDG_RUNTIME_DIR=$(mktemp -d)
chmod 700 "$XDG_RUNTIME_DIR"
export KILN_KILND="$root/gpu-dist/kilnd"
name=sweep
if [[ "$args" =~ --shard[=\ ]([0-9]+)/([0-9]+) ]]; then
  name="sweep-${BASH_REMATCH[1]}-of-${BASH_REMATCH[2]}"
fi
cd "$(mktemp -d)"  # import the installed packages, not anything from the checkout
"$py" -c 'import sys, torch, kiln; print("python", sys.version.split()[0], "torch", torch.__version__, "kiln", kiln.__version__, kiln.library_path)' \
  2>&1 | tee "$out/python_env.txt"
# shellcheck disable=SC2086  # SWEEP_ARGS is a list of arguments
PYTHONUNBUFFERED=1 timeout -k 5 "${SWEEP_TIMEOUT:-570}" "$py" "$root/bench/sweep/run.py" $args \
  --json "$out/$name.json" 2>&1 | tee "$out/$name.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || echo "run.py exit $rc (124: the timeout; the JSON holds what was measured)"
if [ -f "$out/$name.json" ]; then
  "$py" "$root/bench/sweep/report.py" "$out/$name.json" | tee "$out/$name.md"
fi
echo "sweep_gpu_run exit $rc"
exit "$rc"
