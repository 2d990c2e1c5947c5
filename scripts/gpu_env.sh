# Sourced by the GPU machine's run scripts (gpu_run.sh, gpu_attention.sh, gpu_family.sh), from the
# repository root: sets `dist` (the staged binaries: the script's own gpu-dist/ when it is the
# staged copy, else ./gpu-dist), creates $out, links gpu-dist where the test binaries look for
# kilnd (the absolute build path they were linked with), gives the run a private kernel cache and
# runtime directory, and records the device in $out/device.txt.
dist=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$dist/kilnd" ] || dist=$PWD/gpu-dist
mkdir -p "$out"
build_path=$(cat "$dist/BUILD_PATH")
if [ ! -e "$build_path" ]; then mkdir -p "$(dirname "$build_path")" && ln -s "$dist" "$build_path"; fi
export KILN_CACHE_DIR=$(mktemp -d)
export XDG_RUNTIME_DIR=$(mktemp -d)
chmod 700 "$XDG_RUNTIME_DIR"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
