#!/usr/bin/env bash
# The fleet figures of docs/reliability.md: one redis-server, four "hosts" (four cache
# directories, one process each) prewarming the same model in turn, then a new process on a fifth
# host fetching a whole family's catalog from Redis. Needs redis-server and a built tree
# (build/kiln); no GPU.
#   scripts/fleet_figures.sh [MODEL_CONFIG] [ARCHS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kiln="$root/build/kiln"
model=${1:-$root/tests/cli/models/tiny_llama.json}
archs=${2:-sm_90a,sm_80}
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" --logfile "$work/redis.log" &
redis_pid=$!
trap 'kill $redis_pid 2>/dev/null; wait $redis_pid 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/fleet.key"
chmod 600 "$work/fleet.key"
export KILN_REMOTE="redis://127.0.0.1:$port" KILN_FLEET_KEY_FILE="$work/fleet.key"

echo "model $(basename "$model"), archs $archs, 4 hosts in turn:"
for host in 1 2 3 4; do
  KILN_CACHE_DIR="$work/host$host" "$kiln" --embedded prewarm --model "$model" --arch "$archs" --json 2>/dev/null |
    python3 -c "import json,sys; r=json.load(sys.stdin); print(f'  host $host: {r[\"requested\"]} variants, {r[\"compiled\"]} compiled, {r[\"remote\"]} from Redis, {r[\"seconds\"]:.2f} s')"
done

echo "a new process on a fifth host, every rmsnorm variant for sm_90a:"
KILN_CACHE_DIR="$work/seed" "$kiln" --embedded prewarm --arch sm_90a --family rmsnorm --json >/dev/null 2>&1
KILN_CACHE_DIR="$work/host5" "$kiln" --embedded prewarm --arch sm_90a --family rmsnorm --jobs 1 --json 2>/dev/null |
  python3 -c "
import json, statistics, sys
r = json.load(sys.stdin)
ms = sorted(v['ms'] for v in r['variants'] if v['result'] == 'remote')
print(f'  {len(ms)} of {r[\"requested\"]} from Redis in {r[\"seconds\"]*1000:.0f} ms: per kernel median {statistics.median(ms):.2f} ms, '
      f'p90 {ms[int(len(ms)*0.9)]:.2f} ms, max {ms[-1]:.2f} ms (lookup, verification and the local store)')"
