#!/usr/bin/env bash
# Data-plane benchmark with its reference figures, all measured in the same run, printed as one
# table per object size (1, 2 and 32 MiB; override with SIZES="1 2 32"):
#   - single-thread memcpy (the reference of every ratio; taken before and after each
#     measurement, the higher value counts);
#   - `lmcache bench server --mode throughput` against a fresh `lmcache server`: shared-memory
#     store/retrieve and store_bytes/retrieve_bytes of 256-token chunks (8 KV heads x 128, bf16,
#     16 tokens per block; the number of layers sets the object size: 1 MiB per layer), one
#     client, in layer_major and block_major layouts, and the bytes path again over the ipc
#     endpoint (--ipc-path); store_bytes again with chunk_frames (rows bytes_store_frames,
#     bytes_store_fr_ipc: the chunks sent from the client's buffers as frames, no request copy);
#     retrieve_bytes again with chunk_frames (rows bytes_retr_frames, bytes_retr_fr_ipc: the
#     chunks sent from L1 as frames, no reply copy); the server's minor page faults per phase
#     (--server-pid);
#   - before the table: the first store of each size into a fresh server without --warmup (first
#     touch of L1 and of the registered shared memory, with page-fault counts), and the lookup
#     latency of 4- and 128-chunk prompts;
#   - `lmcache bench server --mode echo`: a bare ZMQ DEALER/ROUTER exchange of messages of the
#     size of a store's request and a retrieve's reply (the 8 chunks of a prompt: 8, 16 and
#     256 MiB) over loopback tcp and over ipc (the transport alone), in three shapes: the echo
#     (the message sent back: it crosses twice per round trip), send (the message up, 8 bytes
#     back: a store's shape) and fetch (8 bytes up, the message back: a retrieve's shape); the
#     store rows are compared with send and the retrieve rows with fetch;
#   - Redis (Debian's redis-server, started here) SET/GET of values of the same size with
#     redis-benchmark, one client, before and after each size's runs (the higher counts).
#   - the shared-memory and bytes rows again, back to back with the first ones, against a server
#     started with --copy-threads 0 (rows *_nopool; skip them with POOL_OFF=0): the copy pool's
#     gain in the same run, each ratio to that run's own memcpy.
# GB/s count payload bytes once per request (an echo's message travels both ways). The machine
# may be shared: the load average is printed with the table.
# Usage: [SIZES="2 32"] [SERVER_OPTS="--max-workers 2 --copy-threads 2"] [POOL_OFF=0]
#        [WORKSET_MIB=2048 (bytes per phase; L1 is sized for three such sets)]
#        scripts/bench-server.sh [extra lmcache bench server --mode throughput options]
# SERVER_OPTS are added to every `lmcache server` started here (the pool-off server gets
# --copy-threads 0 after them).
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
# MiB each store phase writes (and each retrieve round reads; Redis moves as much): phases of
# a fraction of a second are at the mercy of other processes' time slices on a small machine.
WORKSET_MIB=${WORKSET_MIB:-2048}
L1_GB=$(( (3 * WORKSET_MIB + 1023) / 1024 + 2 )) # the shared-memory, bytes and frames keys
POOL_OFF=${POOL_OFF:-1}
read -r -a SERVER_OPTS <<<"${SERVER_OPTS:-}"
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

IPC="$TMP/dp.sock"
start_server() { # extra server options after SERVER_OPTS
    [ -n "${SRV:-}" ] && { kill "$SRV" 2>/dev/null || true; wait "$SRV" 2>/dev/null || true; }
    ./build/lmcache server --host 127.0.0.1 --port "$ZMQ" --http-host 127.0.0.1 --http-port "$HTTP" \
        --ipc-path "$IPC" --l1-size-gb "$L1_GB" --eviction-policy LRU ${SERVER_OPTS[@]+"${SERVER_OPTS[@]}"} \
        "$@" >"$TMP/server.log" 2>&1 &
    SRV=$!
    for _ in $(seq 1 600); do
        grep -q "L1 prefault:" "$TMP/server.log" && break
        sleep 0.1
    done
}
start_server
redis-server --port "$REDIS" --bind 127.0.0.1 --save '' --appendonly no \
    --proto-max-bulk-len 1gb --client-query-buffer-limit 1gb --dir "$TMP" >"$TMP/redis.log" 2>&1 &
RED=$!
for _ in $(seq 1 50); do redis-cli -p "$REDIS" ping >/dev/null 2>&1 && break; sleep 0.1; done

gbs() { awk -v p="$1" 'index($0, p) == 1 { for (i = 1; i <= NF; i++) if ($(i+1) == "GB/s") { print $i; exit } }'; }
ref() { awk '/^memcpy reference/ { a = $(NF-5); b = $(NF-2); print (a > b ? a : b); exit }'; }
redis_gbs() { # $1 set|get, $2 bytes
    local n=$(( WORKSET_MIB / ($2 >> 20) )) rps
    [ "$n" -lt 16 ] && n=16
    rps=$(redis-benchmark -p "$REDIS" -t "$1" -n "$n" -c 1 -P 1 -d "$2" -r 32 -q 2>/dev/null |
        tr '\r' '\n' | grep -i "requests per second" | tail -1 | grep -oE '[0-9]+(\.[0-9]+)?' | head -1)
    awk -v r="$rps" -v b="$2" 'BEGIN{printf "%.2f", r*b/1e9}'
}

CHUNKS=8 # chunks per request: --prompt-tokens 2048 in 256-token chunks
tp() { # $1 output file, then extra options
    local out=$1; shift
    ./build/lmcache bench server --mode throughput --port "$ZMQ" --http-port "$HTTP" \
        --server-pid "$SRV" --kv-heads 8 --head-dim 128 --dtype-bytes 2 \
        --prompt-tokens 2048 --rounds 3 "$@" >"$out" 2>&1 || { cat "$out"; exit 1; }
}

echo
echo "== first store (and the retrieves after it) into a fresh server (no --warmup): L1 and the registered shared memory untouched"
for mib in $SIZES; do
    start_server
    prompts=$(( 64 / mib )); [ "$prompts" -lt 4 ] && prompts=4
    tp "$TMP/fresh.$mib" --layers "$mib" --prompts "$prompts" --no-bytes --lookup-samples 0 "$@"
    echo "$mib MiB objects: $(grep '^store (shm)' "$TMP/fresh.$mib")"
    echo "    then: $(grep '^retrieve (shm)' "$TMP/fresh.$mib")"
done
start_server

echo
echo "== lookup latency (lookup_wait until ready, then end_session; chunks in L1)"
tp "$TMP/lookup" --layers 1 --prompts 1 --rounds 1 --no-bytes --lookup-samples 500 "$@"
grep '^lookup .* chunks by' "$TMP/lookup"

declare -A ROW RREF REF
for mib in $SIZES; do
    bytes=$((mib << 20))
    prompts=$(( WORKSET_MIB / 8 / mib )); [ "$prompts" -lt 4 ] && prompts=4
    echo "load average before the $mib MiB runs: $(cut -d' ' -f1-3 /proc/loadavg)"
    # Redis before and after this size's runs, the higher counts (as for memcpy): the machine's
    # speed drifts over tens of seconds, and the reference should not have had the worse moment.
    set0=$(redis_gbs set "$bytes")
    get0=$(redis_gbs get "$bytes")
    tp "$TMP/tp.$mib" --layers "$mib" --prompts "$prompts" --warmup --lookup-samples 0 "$@"
    tp "$TMP/bm.$mib" --layers "$mib" --prompts "$prompts" --warmup --lookup-samples 0 \
        --block-order block_major --no-bytes --instance-base 2000 "$@"
    if [ "$POOL_OFF" = 1 ]; then # the same two runs without the copy pool, then back
        start_server --copy-threads 0
        tp "$TMP/tp0.$mib" --layers "$mib" --prompts "$prompts" --warmup --lookup-samples 0 "$@"
        tp "$TMP/bm0.$mib" --layers "$mib" --prompts "$prompts" --warmup --lookup-samples 0 \
            --block-order block_major --no-bytes --instance-base 2000 "$@"
        start_server
    fi
    tp "$TMP/ipc.$mib" --layers "$mib" --prompts "$prompts" --warmup --lookup-samples 0 \
        --endpoint "ipc://$IPC" --instance-base 3000 "$@"
    for shape in echo send fetch; do
        for ep in tcp ipc; do
            f=$shape; [ "$ep" = ipc ] && f=${shape}ipc
            ./build/lmcache bench server --mode echo --echo-mib "$((mib * CHUNKS))" --rounds 3 --echo-endpoint "$ep" \
                --echo-shape "$shape" >"$TMP/$f.$mib" 2>&1 || { cat "$TMP/$f.$mib"; exit 1; }
        done
    done
    m=0
    runs="tp bm ipc echo echoipc send sendipc fetch fetchipc"
    [ "$POOL_OFF" = 1 ] && runs="$runs tp0 bm0"
    for f in $runs; do
        REF[$f]=$(ref <"$TMP/$f.$mib")
        m=$(awk -v a="$m" -v b="${REF[$f]}" 'BEGIN{print (a > b ? a : b)}')
    done
    ROW[$mib,memcpy]=$m
    # name|source run|line prefix; each ratio is to the memcpy of the row's own run
    for spec in "shm_store|tp|store (shm)" "shm_retrieve|tp|retrieve (shm)" \
        "shm_store_bm|bm|store (shm)" "shm_retrieve_bm|bm|retrieve (shm)" \
        "bytes_store|tp|store_bytes" "bytes_retrieve|tp|retrieve_bytes" \
        "bytes_store_ipc|ipc|store_bytes" "bytes_retr_ipc|ipc|retrieve_bytes" \
        "bytes_store_frames|tp|store_frames" "bytes_store_fr_ipc|ipc|store_frames" \
        "bytes_retr_frames|tp|retrieve_frames" "bytes_retr_fr_ipc|ipc|retrieve_frames" \
        "zmq_echo|echo|zmq echo" "zmq_echo_ipc|echoipc|zmq echo" \
        "zmq_send|send|zmq send" "zmq_send_ipc|sendipc|zmq send" \
        "zmq_fetch|fetch|zmq fetch" "zmq_fetch_ipc|fetchipc|zmq fetch" \
        "shm_store_nopool|tp0|store (shm)" "shm_retr_nopool|tp0|retrieve (shm)" \
        "store_bm_nopool|bm0|store (shm)" "retr_bm_nopool|bm0|retrieve (shm)" \
        "bytes_store_nopool|tp0|store_bytes" "bytes_retr_nopool|tp0|retrieve_bytes"; do
        IFS='|' read -r k f pfx <<<"$spec"
        [ -f "$TMP/$f.$mib" ] || continue
        ROW[$mib,$k]=$(gbs "$pfx" <"$TMP/$f.$mib")
        RREF[$mib,$k]=${REF[$f]}
    done
    ROW[$mib,redis_set]=$(awk -v a="$set0" -v b="$(redis_gbs set "$bytes")" 'BEGIN{print (a > b ? a : b)}')
    ROW[$mib,redis_get]=$(awk -v a="$get0" -v b="$(redis_gbs get "$bytes")" 'BEGIN{print (a > b ? a : b)}')
    RREF[$mib,redis_set]=$m
    RREF[$mib,redis_get]=$m
    for k in tp ipc; do
        grep -E '^(store|retrieve)' "$TMP/$k.$mib" | sed "s/^/  [$mib MiB, $k] /" >>"$TMP/faults"
    done
done

echo "load average after:  $(cut -d' ' -f1-3 /proc/loadavg)"
{ grep -h '^server: ' "$TMP"/tp.* | head -1 | sed 's/^server:/server (pool rows):/'; } || true
if [ "$POOL_OFF" = 1 ]; then
    { grep -h '^server: ' "$TMP"/tp0.* | head -1 | sed 's/^server:/server (*_nopool rows):/'; } || true
fi

echo "redis $(redis-server --version | awk '{print $3}'); GB/s (ratio to the single-thread memcpy of the same run;"
echo "memcpy row and Redis: the highest memcpy of the size's runs)"
printf "%-18s" "object"
for mib in $SIZES; do printf "%20s" "$mib MiB"; done
echo
for k in memcpy shm_store shm_retrieve shm_store_bm shm_retrieve_bm bytes_store bytes_retrieve \
    bytes_store_ipc bytes_retr_ipc bytes_store_frames bytes_store_fr_ipc bytes_retr_frames bytes_retr_fr_ipc zmq_echo zmq_echo_ipc \
    zmq_send zmq_send_ipc zmq_fetch zmq_fetch_ipc redis_set redis_get shm_store_nopool shm_retr_nopool store_bm_nopool retr_bm_nopool \
    bytes_store_nopool bytes_retr_nopool; do
    [ "$POOL_OFF" = 1 ] || case $k in *_nopool) continue ;; esac
    printf "%-18s" "$k"
    for mib in $SIZES; do
        v=${ROW[$mib,$k]:-}
        m=${RREF[$mib,$k]:-${ROW[$mib,memcpy]}}
        printf "%20s" "$(awk -v v="$v" -v m="$m" 'BEGIN{ if (v == "") print "-"; else printf "%.2f (%3.0f%%)", v, (m > 0 ? 100*v/m : 0) }')"
    done
    echo
done
ratio() { # $1 label, $2 numerator row, $3 denominator row
    printf "%-18s" "$1"
    for mib in $SIZES; do
        printf "%20s" "$(awk -v a="${ROW[$mib,$2]:-}" -v b="${ROW[$mib,$3]:-}" 'BEGIN{ if (a == "" || b == "" || b == 0) print "-"; else printf "%.2fx", a/b }')"
    done
    echo
}
ratio "store_b/redis_set" bytes_store redis_set
ratio "retr_b/redis_get" bytes_retrieve redis_get
ratio "store_b/echo" bytes_store zmq_echo
ratio "retr_b/echo" bytes_retrieve zmq_echo
ratio "store_b_ipc/echo" bytes_store_ipc zmq_echo_ipc
ratio "retr_b_ipc/echo" bytes_retr_ipc zmq_echo_ipc
ratio "store_f/redis_set" bytes_store_frames redis_set
ratio "store_f/echo" bytes_store_frames zmq_echo
ratio "store_f_ipc/echo" bytes_store_fr_ipc zmq_echo_ipc
ratio "retr_f/redis_get" bytes_retr_frames redis_get
ratio "retr_f/echo" bytes_retr_frames zmq_echo
ratio "retr_f_ipc/echo" bytes_retr_fr_ipc zmq_echo_ipc
# the same against the transport in the request's own shape
ratio "store_b/send" bytes_store zmq_send
ratio "store_f/send" bytes_store_frames zmq_send
ratio "store_b_ipc/send" bytes_store_ipc zmq_send_ipc
ratio "store_f_ipc/send" bytes_store_fr_ipc zmq_send_ipc
ratio "retr_b/fetch" bytes_retrieve zmq_fetch
ratio "retr_f/fetch" bytes_retr_frames zmq_fetch
ratio "retr_b_ipc/fetch" bytes_retr_ipc zmq_fetch_ipc
ratio "retr_f_ipc/fetch" bytes_retr_fr_ipc zmq_fetch_ipc
ratio "redis_set/send" redis_set zmq_send
ratio "redis_get/fetch" redis_get zmq_fetch
if [ "$POOL_OFF" = 1 ]; then
    ratio "shm_store pool/off" shm_store shm_store_nopool
    ratio "shm_retr pool/off" shm_retrieve shm_retr_nopool
    ratio "store_bm pool/off" shm_store_bm store_bm_nopool
    ratio "retr_bm pool/off" shm_retrieve_bm retr_bm_nopool
    ratio "store_b pool/off" bytes_store bytes_store_nopool
    ratio "retr_b pool/off" bytes_retrieve bytes_retr_nopool
fi
echo "minor page faults per phase (server / bench client):"
sed -E 's/ +[0-9.]+ GB\/s .*minor faults: /: /; s/\)$//' "$TMP/faults"
