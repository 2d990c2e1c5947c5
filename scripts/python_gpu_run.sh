#!/usr/bin/env bash
# Runs on the GPU machine from the repository root with gpu-dist/ carried (scripts/stage_gpu.sh,
# then scripts/stage_python.sh): installs the staged kiln wheel from the file into a private
# folder, runs the Python GPU tests (every op and module against PyTorch, torch.compile, CUDA
# graphs, training, daemon and embedded), the side-by-side benchmark and the training-step
# benchmark (bench/python/train_step.py, against eager, torch.compile and Liger). Logs and JSON go
# to $OUT.
#   scripts/python_gpu_run.sh [--quick] [--host-only] [tests|bench|train|anchors|serve]...  (default: tests bench)
# anchors: bench/torch_anchors.py with kiln importable, so the families' anchors that also time
# kiln's Python layer (the MoE layer, say) do; TORCH_ARGS narrows it (e.g. "--only moe").
# serve: bench/python/serve_tiny_llama.py, a tiny Llama served with continuous batching from kiln's
# ops (tokens/s, and a check of its first requests against the PyTorch reference); SERVE_ARGS adds
# its arguments (e.g. "--dtype f16 --concurrency 64").
# --host-only: the benchmark times only the host cost per call (side_by_side.py --host-only).
# Env: PYTEST_K, a pytest -k expression that narrows the tests (e.g. "launch or describe");
# TRAIN_ARGS, extra arguments of train_step.py (e.g. "--only llama_layer").
set -uo pipefail
quick="" host="" what=""
for a in "$@"; do
  case "$a" in --quick) quick=--quick ;; --host-only) host=--host-only ;; tests|bench|train|anchors|serve) what="$what $a " ;; *) echo "unknown argument $a" >&2; exit 2 ;; esac
done
what=${what:- tests bench }
root=$PWD
out=${OUT:-gpu-out}
mkdir -p "$out"
site=$(mktemp -d)/site
py=${PYTHON:-python3}
if ! "$py" -m pip install --no-index --no-deps --target "$site" gpu-dist/python/*.whl >"$out/python_install.log" 2>&1; then
  # No pip: a wheel is a zip archive laid out for site-packages.
  "$py" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    "$site" gpu-dist/python/*.whl || { echo "cannot install the wheels"; exit 1; }
  chmod +x "$site"/kiln/libkiln.so
fi
# The peers (liger-kernel), where staged: into a folder the tests do not see.
peers=$(mktemp -d)/peers
ls gpu-dist/python/peers/*.whl >/dev/null 2>&1 &&
  "$py" -m pip install --no-index --no-deps --target "$peers" gpu-dist/python/peers/*.whl >>"$out/python_install.log" 2>&1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# One cache for the calls of a warm machine: a second call does not compile the kernels again.
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-python-gpu-cache}
export XDG_RUNTIME_DIR=$(mktemp -d)
chmod 700 "$XDG_RUNTIME_DIR"
export KILN_KILND="$root/gpu-dist/kilnd"
cd "$(mktemp -d)"  # import the installed package, not anything from the checkout
"$py" -c 'import sys, torch, kiln; print("python", sys.version.split()[0], "torch", torch.__version__, "kiln", kiln.__version__, "abi", kiln.abi_version(), kiln.library_path)' \
  2>&1 | tee "$out/python_env.txt"
rc=0
if [[ "$what" == *" tests "* ]]; then
  # The package's tests and every family's Python tests (families/*/tests/test_*.py).
  tests="$root/tests/python/gpu $root/tests/python/test_torch_cpu.py $root/tests/python/test_e2e_tiny_llama_cpu.py $(ls "$root"/families/*/tests/test_*.py 2>/dev/null)"
  "$py" -c 'import numpy' 2>/dev/null && tests="$tests $root/tests/python/test_cpu.py"
  PYTHONUNBUFFERED=1 timeout -k 5 400 "$py" -m pytest -q -rs -p no:cacheprovider --durations=10 \
    ${PYTEST_K:+-k "$PYTEST_K"} $tests 2>&1 \
    | tee "$out/python_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  # A skipped GPU test is not a pass on a machine with a GPU (the bf16 NumPy test needs ml_dtypes).
  if grep -E "^SKIPPED" "$out/python_tests.log" | grep -v ml_dtypes; then echo "PYTHON GPU TESTS WERE SKIPPED"; rc=1; fi
fi
if [[ "$what" == *" bench "* ]]; then
  PYTHONUNBUFFERED=1 timeout -k 5 170 "$py" "$root/bench/python/side_by_side.py" $quick $host \
    --json "$out/python_bench.json" 2>&1 | tee "$out/python_bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ "$what" == *" train "* ]]; then
  PYTHONPATH="$PYTHONPATH:$peers" PYTHONUNBUFFERED=1 timeout -k 5 300 "$py" "$root/bench/python/train_step.py" $quick ${TRAIN_ARGS:-} \
    --json "$out/train_step.json" 2>&1 | tee "$out/train_step.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ "$what" == *" anchors "* ]]; then
  PYTHONUNBUFFERED=1 timeout -k 5 400 "$py" "$root/bench/torch_anchors.py" $quick ${TORCH_ARGS:-} \
    --json "$out/anchors_with_kiln.json" 2>&1 | tee "$out/anchors_with_kiln.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ "$what" == *" serve "* ]]; then
  PYTHONUNBUFFERED=1 timeout -k 5 400 "$py" "$root/bench/python/serve_tiny_llama.py" $quick ${SERVE_ARGS:-} \
    --json "$out/serve_tiny_llama.json" 2>&1 | tee "$out/serve_tiny_llama.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
echo "python_gpu_run exit $rc"
exit $rc
