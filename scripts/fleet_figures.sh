#!/usr/bin/env bash
# The fleet figures of docs/reliability.md: one redis-server, four "hosts" (four cache
# directories, one process each) prewarming the same model in turn, then four more prewarming it
# at the same time (with compile locks, and without: KILN_REMOTE_LOCK_MS=0), then a new process on
# another host fetching a whole family's catalog from Redis, over plain TCP and over TLS (a second
# redis-server with a throwaway CA). Needs redis-server, openssl and a built tree (build/kiln); no
# GPU.
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
tls_pid=""
trap 'kill $redis_pid $tls_pid 2>/dev/null; wait $redis_pid $tls_pid 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/fleet.key"
chmod 600 "$work/fleet.key"
export KILN_REMOTE="redis://127.0.0.1:$port" KILN_FLEET_KEY_FILE="$work/fleet.key"

echo "model $(basename "$model"), archs $archs, 4 hosts in turn:"
for host in 1 2 3 4; do
  KILN_CACHE_DIR="$work/host$host" "$kiln" --embedded prewarm --model "$model" --arch "$archs" --json 2>/dev/null |
    python3 -c "import json,sys; r=json.load(sys.stdin); print(f'  host $host: {r[\"requested\"]} variants, {r[\"compiled\"]} compiled, {r[\"remote\"]} from Redis, {r[\"seconds\"]:.2f} s')"
done

# Four hosts at once, on an empty Redis (a database of its own per run).
at_once() {
  local db=$1 label=$2
  local pids=""
  for host in 1 2 3 4; do
    KILN_REMOTE="redis://127.0.0.1:$port/$db" KILN_CACHE_DIR="$work/db$db-host$host" \
      "$kiln" --embedded prewarm --model "$model" --arch "$archs" --json > "$work/db$db-host$host.json" 2>/dev/null &
    pids="$pids $!"
  done
  wait $pids
  python3 - "$work" "$db" "$label" <<'PY'
import json, sys
work, db, label = sys.argv[1:]
rs = [json.load(open(f"{work}/db{db}-host{h}.json")) for h in (1, 2, 3, 4)]
print(f"  {label}: {rs[0]['requested']} variants each; compiled " + " + ".join(str(r['compiled']) for r in rs) +
      f" = {sum(r['compiled'] for r in rs)}, from Redis {sum(r['remote'] for r in rs)}, "
      f"slowest host {max(r['seconds'] for r in rs):.1f} s")
PY
}
echo "the same model, 4 new hosts at the same time:"
at_once 1 "with compile locks"
KILN_REMOTE_LOCK_MS=0 at_once 2 "KILN_REMOTE_LOCK_MS=0 (no locks)"

# A new process fetching a family's catalog; $1 names the run, the environment the server.
fetch_catalog() {
  KILN_CACHE_DIR="$work/seed-$1" "$kiln" --embedded prewarm --arch sm_90a --family rmsnorm --json >/dev/null 2>&1
  KILN_CACHE_DIR="$work/fetch-$1" "$kiln" --embedded prewarm --arch sm_90a --family rmsnorm --jobs 1 --json 2>/dev/null |
    python3 -c "
import json, statistics, sys
r = json.load(sys.stdin)
ms = sorted(v['ms'] for v in r['variants'] if v['result'] == 'remote')
print(f'  $1: {len(ms)} of {r[\"requested\"]} from Redis in {r[\"seconds\"]*1000:.0f} ms: per kernel median {statistics.median(ms):.2f} ms, '
      f'p90 {ms[int(len(ms)*0.9)]:.2f} ms, max {ms[-1]:.2f} ms (lookup, verification and the local store)')"
}
echo "a new process on another host, every rmsnorm variant for sm_90a:"
KILN_REMOTE="redis://127.0.0.1:$port/3" fetch_catalog "plain TCP"

# The same over TLS: a throwaway CA, a server certificate for 127.0.0.1, Redis on a TLS port only.
(
  cd "$work"
  ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
  openssl req -x509 $ec -keyout ca.key -out ca.pem -days 1 -subj /CN=fleet-figures-ca
  openssl req $ec -keyout server.key -out server.csr -subj /CN=127.0.0.1
  printf 'subjectAltName=IP:127.0.0.1\n' > server.ext
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile server.ext
) >/dev/null 2>&1
tls_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$work/tls"
redis-server --port 0 --tls-port "$tls_port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work/tls" \
  --logfile "$work/tls/redis.log" --tls-cert-file "$work/server.pem" --tls-key-file "$work/server.key" \
  --tls-ca-cert-file "$work/ca.pem" --tls-auth-clients no &
tls_pid=$!
for _ in $(seq 100); do
  redis-cli --tls --cacert "$work/ca.pem" -p "$tls_port" ping >/dev/null 2>&1 && break
  sleep 0.05
done
KILN_REMOTE="rediss://127.0.0.1:$tls_port" KILN_REMOTE_CA_FILE="$work/ca.pem" fetch_catalog "TLS"
