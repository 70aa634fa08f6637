#!/usr/bin/env bash
# Data-plane benchmark with its reference figures, all measured in the same run, printed as one
# table per object size (1, 2 and 32 MiB; override with SIZES="1 2 32"):
#   - single-thread memcpy (the reference of every ratio; taken before and after each
#     measurement, the higher value counts);
#   - `lmcache bench server --mode throughput` against a fresh `lmcache server`: shared-memory
#     store/retrieve and store_bytes/retrieve_bytes of 256-token chunks (8 KV heads x 128, bf16,
#     16 tokens per block; the number of layers sets the object size: 1 MiB per layer), one
#     client;
#   - `lmcache bench server --mode echo`: a bare ZMQ DEALER/ROUTER echo of messages of the same
#     size over loopback tcp (the transport alone);
#   - Redis (Debian's redis-server, started here) SET/GET of values of the same size with
#     redis-benchmark, one client.
# GB/s count payload bytes once per request (an echo's message travels both ways). The machine
# may be shared: the load average is printed with the table.
# Usage: scripts/bench-server.sh [extra lmcache bench server --mode throughput options]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh >/dev/null 2>&1 || echo "(scripts/install-deps.sh failed: using what is installed)" >&2
if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    apt-get install -y -qq redis-server redis-tools >/dev/null
fi
scripts/build.sh build >/dev/null

port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ZMQ=$(port); HTTP=$(port); REDIS=$(port)
SIZES=${SIZES:-"1 2 32"}
TMP=$(mktemp -d)
cleanup() {
    [ -n "${SRV:-}" ] && kill "$SRV" 2>/dev/null || true
    [ -n "${RED:-}" ] && kill "$RED" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT

echo "machine: $(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

./build/lmcache server --host 127.0.0.1 --port "$ZMQ" --http-host 127.0.0.1 --http-port "$HTTP" \
    --l1-size-gb 3 --eviction-policy LRU >"$TMP/server.log" 2>&1 &
SRV=$!
for _ in $(seq 1 100); do
    grep -q "L1 prefault:" "$TMP/server.log" && break
    sleep 0.1
done
redis-server --port "$REDIS" --bind 127.0.0.1 --save '' --appendonly no \
    --proto-max-bulk-len 1gb --client-query-buffer-limit 1gb --dir "$TMP" >"$TMP/redis.log" 2>&1 &
RED=$!
for _ in $(seq 1 50); do redis-cli -p "$REDIS" ping >/dev/null 2>&1 && break; sleep 0.1; done

gbs() { awk -v p="$1" 'index($0, p) == 1 { for (i = 1; i <= NF; i++) if ($(i+1) == "GB/s") { print $i; exit } }'; }
ref() { awk '/^memcpy reference/ { a = $(NF-5); b = $(NF-2); print (a > b ? a : b); exit }'; }
redis_gbs() { # $1 set|get, $2 bytes
    local n=$(( 512 / ($2 >> 20) )) rps
    [ "$n" -lt 16 ] && n=16
    rps=$(redis-benchmark -p "$REDIS" -t "$1" -n "$n" -c 1 -P 1 -d "$2" -r 32 -q 2>/dev/null |
        tr '\r' '\n' | grep -i "requests per second" | tail -1 | grep -oE '[0-9]+(\.[0-9]+)?' | head -1)
    awk -v r="$rps" -v b="$2" 'BEGIN{printf "%.2f", r*b/1e9}'
}

declare -A ROW
for mib in $SIZES; do
    bytes=$((mib << 20))
    prompts=$(( 64 / mib )); [ "$prompts" -lt 4 ] && prompts=4
    ./build/lmcache bench server --mode throughput --port "$ZMQ" --http-port "$HTTP" \
        --layers "$mib" --kv-heads 8 --head-dim 128 --dtype-bytes 2 \
        --prompt-tokens 2048 --prompts "$prompts" --rounds 3 --warmup "$@" >"$TMP/tp.$mib" 2>&1 ||
        { cat "$TMP/tp.$mib"; exit 1; }
    ./build/lmcache bench server --mode echo --echo-mib "$mib" --rounds 3 >"$TMP/echo.$mib" 2>&1 ||
        { cat "$TMP/echo.$mib"; exit 1; }
    m1=$(ref <"$TMP/tp.$mib"); m2=$(ref <"$TMP/echo.$mib")
    ROW[$mib,memcpy]=$(awk -v a="$m1" -v b="$m2" 'BEGIN{print (a > b ? a : b)}')
    ROW[$mib,shm_store]=$(gbs "store (shm)" <"$TMP/tp.$mib")
    ROW[$mib,shm_retrieve]=$(gbs "retrieve (shm)" <"$TMP/tp.$mib")
    ROW[$mib,bytes_store]=$(gbs "store_bytes" <"$TMP/tp.$mib")
    ROW[$mib,bytes_retrieve]=$(gbs "retrieve_bytes" <"$TMP/tp.$mib")
    ROW[$mib,zmq_echo]=$(gbs "zmq echo" <"$TMP/echo.$mib")
    ROW[$mib,redis_set]=$(redis_gbs set "$bytes")
    ROW[$mib,redis_get]=$(redis_gbs get "$bytes")
done

echo "load average after:  $(cut -d' ' -f1-3 /proc/loadavg)"
echo "redis $(redis-server --version | awk '{print $3}'); GB/s (ratio to memcpy of the same size's run)"
printf "%-16s" "object"
for mib in $SIZES; do printf "%20s" "$mib MiB"; done
echo
for k in memcpy shm_store shm_retrieve bytes_store bytes_retrieve zmq_echo redis_set redis_get; do
    printf "%-16s" "$k"
    for mib in $SIZES; do
        v=${ROW[$mib,$k]:-}
        m=${ROW[$mib,memcpy]}
        printf "%20s" "$(awk -v v="$v" -v m="$m" 'BEGIN{ if (v == "") print "-"; else printf "%.2f (%3.0f%%)", v, (m > 0 ? 100*v/m : 0) }')"
    done
    echo
done
