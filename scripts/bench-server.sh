#!/usr/bin/env bash
# Data-plane benchmark with its reference figures, all measured in the same run:
#   - `lmcache bench server --mode throughput` against a fresh `lmcache server` (shared-memory
#     store/retrieve and store_bytes/retrieve_bytes of 256-token chunks, Llama-3-8B-like layout:
#     32 layers, 8 KV heads x 128, bf16, 16 tokens per block), with single-thread memcpy;
#   - Redis (Debian's redis-server, started here) SET/GET of values of the same chunk size with
#     redis-benchmark, one client.
# Usage: scripts/bench-server.sh [extra lmcache bench server options]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh >/dev/null
if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    apt-get install -y -qq redis-server redis-tools >/dev/null
fi
scripts/build.sh build >/dev/null

port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ZMQ=$(port); HTTP=$(port); REDIS=$(port)
LAYERS=32 HEADS=8 DIM=128 DTYPE=2 CHUNK=256
CHUNK_BYTES=$((2 * LAYERS * CHUNK * HEADS * DIM * DTYPE))
TMP=$(mktemp -d)
cleanup() {
    [ -n "${SRV:-}" ] && kill "$SRV" 2>/dev/null || true
    [ -n "${RED:-}" ] && kill "$RED" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT

echo "machine: $(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r)"
echo "chunk object: ${CHUNK_BYTES} bytes"

./build/lmcache server --host 127.0.0.1 --port "$ZMQ" --http-host 127.0.0.1 --http-port "$HTTP" \
    --l1-size-gb 6 --eviction-policy LRU >"$TMP/server.log" 2>&1 &
SRV=$!
for _ in $(seq 1 100); do
    grep -q "L1 prefault:" "$TMP/server.log" && break
    sleep 0.1
done
echo "--- lmcache"
./build/lmcache bench server --mode throughput --port "$ZMQ" --http-port "$HTTP" \
    --layers $LAYERS --kv-heads $HEADS --head-dim $DIM --dtype-bytes $DTYPE \
    --prompt-tokens 2048 --prompts 4 --rounds 3 "$@"

echo "--- redis $(redis-server --version | awk '{print $3}')"
redis-server --port "$REDIS" --bind 127.0.0.1 --save '' --appendonly no \
    --proto-max-bulk-len 1gb --client-query-buffer-limit 1gb --dir "$TMP" >"$TMP/redis.log" 2>&1 &
RED=$!
for _ in $(seq 1 50); do redis-cli -p "$REDIS" ping >/dev/null 2>&1 && break; sleep 0.1; done
N=64
for t in set get; do
    out=$(redis-benchmark -p "$REDIS" -t $t -n $N -c 1 -P 1 -d "$CHUNK_BYTES" -r 32 -q 2>/dev/null | tr '\r' '\n' | grep -i "requests per second" | tail -1)
    rps=$(echo "$out" | grep -oE '[0-9]+(\.[0-9]+)?' | head -1)
    gbs=$(awk -v r="$rps" -v b="$CHUNK_BYTES" 'BEGIN{printf "%.2f", r*b/1e9}')
    printf "redis %-4s %8s req/s  %s GB/s  (%d values of %d bytes, 1 client)\n" "$t" "$rps" "$gbs" $N "$CHUNK_BYTES"
done
