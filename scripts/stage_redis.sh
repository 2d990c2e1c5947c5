#!/usr/bin/env bash
# Stages redis-server for a machine that has none (the GPU machine; scripts/stage_gpu.sh calls
# this): the server, the shared libraries it needs beyond glibc, and a wrapper that runs it with
# those libraries on its own library path only, so that kiln's binaries and the tests that start
# the server keep the machine's libraries (its libssl, say).
#   scripts/stage_redis.sh DEST
# DEST/bin/redis-server is the wrapper (what KILN_REDIS_SERVER names), DEST/libexec/redis-server
# the server, DEST/lib the libraries. REDIS_SERVER names another server binary to stage (default:
# redis-server on PATH, else /usr/bin/redis-server). The libraries need the glibc of this machine
# or a later one, as kiln's own binaries do.
set -euo pipefail
dest=${1:?usage: scripts/stage_redis.sh DEST}
src=${REDIS_SERVER:-$(command -v redis-server || echo /usr/bin/redis-server)}
if [ ! -x "$src" ]; then
  echo "stage_redis.sh: no redis-server at $src (scripts/deps.sh installs it)" >&2
  exit 1
fi
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/libexec" "$dest/lib"
# Debian's redis-server is a link to redis-check-rdb and Redis picks its mode by the name it runs
# under, so the copy is the file itself under the server's name.
cp -L "$src" "$dest/libexec/redis-server"
# Every library the loader resolves for it, but glibc's own (they must match the machine's loader).
ldd "$src" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | while read -r name path; do
  case "$name" in
    libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | librt.so.* | libresolv.so.* | ld-linux*) continue ;;
  esac
  cp -L "$path" "$dest/lib/$name"
done
chmod u+w "$dest/libexec/redis-server" "$dest"/lib/*
strip --strip-unneeded "$dest/libexec/redis-server" "$dest"/lib/* 2>/dev/null || true
cat > "$dest/bin/redis-server" <<'EOF'
#!/bin/sh
# redis-server with the libraries staged beside it (scripts/stage_redis.sh). exec keeps the pid, so
# whoever started this script can stop, pause and kill the server itself.
here=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$here/lib"
export LD_LIBRARY_PATH
exec "$here/libexec/redis-server" "$@"
EOF
chmod 755 "$dest/bin/redis-server"
du -sh "$dest"
