#!/usr/bin/env bash
# The Python client against the C client, through shared memory, against one `lmcache server`:
# alternately `lmcache bench server --mode throughput --no-bytes` (liblmcache-client) and
# examples/bench_py_client.py (python/lmcache_client) with the same layout and prompts of the
# same size, each after an untimed warm-up store pass (Llama-3-8B-like: 32 layers, 8 KV heads x 128, bf16, 16 tokens per block;
# 256-token chunks = 32 MiB objects), L1 cleared before each, the order swapped every run.
# The Python benchmark then also alternates, prompt by prompt, its own requests with the C
# library's (through ctypes, --interleave-c), the comparison least skewed by other load.
# Prints both and the ratio per run, with the load average, and the medians: on a shared
# machine single phases vary by tens of percent, in both directions.
# Usage: scripts/bench-py-client.sh [RUNS (5)]  (then the medians of the runs)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
scripts/install-deps.sh >/dev/null
scripts/build.sh build >/dev/null

port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ZMQ=$(port); HTTP=$(port)
TMP=$(mktemp -d)
cleanup() {
    [ -n "${SRV:-}" ] && kill "$SRV" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT
export PYTHONPATH="$PWD/build/python"
LAYOUT=(--layers 32 --kv-heads 8 --head-dim 128 --dtype-bytes 2 --tokens-per-block 16
        --prompt-tokens 2048 --prompts 8 --rounds 4 --warmup)

echo "machine: $(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r)"
./build/lmcache server --host 127.0.0.1 --port "$ZMQ" --http-host 127.0.0.1 --http-port "$HTTP" \
    --l1-size-gb 5 --eviction-policy LRU >"$TMP/server.log" 2>&1 &
SRV=$!
for _ in $(seq 1 200); do
    grep -qs "L1 prefault:" "$TMP/server.log" && break
    sleep 0.1
done

clear_l1() {
    /usr/bin/python3 -c "import lmcache_client as l; l.Client($ZMQ).clear()"
}
run_c() {
    clear_l1
    ./build/lmcache bench server --mode throughput --no-bytes --port "$ZMQ" --http-port "$HTTP" \
        "${LAYOUT[@]}" >"$TMP/c.out" 2>&1 || { cat "$TMP/c.out"; exit 1; }
}
run_py() {
    clear_l1
    /usr/bin/python3 examples/bench_py_client.py --endpoint "tcp://127.0.0.1:$ZMQ" \
        "${LAYOUT[@]}" --interleave-c build/liblmcache-client.so >"$TMP/py.out" 2>&1 ||
        { cat "$TMP/py.out"; exit 1; }
}
gbs() { awk -v p="$2" 'index($0, p) == 1 { for (i = 1; i <= NF; i++) if ($(i+1) == "GB/s") { print $i; exit } }' "$1"; }

printf "%-4s %-16s %10s %10s %7s %10s %10s %7s %8s %8s\n" run load C-store Py-store Py/C \
    C-retr Py-retr Py/C "il-store" "il-retr"
: >"$TMP/all"
for r in $(seq 1 "$RUNS"); do
    load=$(cut -d' ' -f1-3 /proc/loadavg | tr ' ' '/')
    if [ $((r % 2)) -eq 1 ]; then run_c; run_py; else run_py; run_c; fi
    cs=$(gbs "$TMP/c.out" "store (shm)"); ps=$(gbs "$TMP/py.out" "store (shm)")
    cr=$(gbs "$TMP/c.out" "retrieve (shm)"); pr=$(gbs "$TMP/py.out" "retrieve (shm)")
    is=$(grep -o 'interleaved store .*Python/C [0-9]*' "$TMP/py.out" | grep -o '[0-9]*$')
    ir=$(grep -o 'interleaved retrieve .*Python/C [0-9]*' "$TMP/py.out" | grep -o '[0-9]*$')
    echo "$cs $ps $cr $pr $is $ir" >>"$TMP/all"
    printf "%-4s %-16s %10s %10s %6.0f%% %10s %10s %6.0f%% %7s%% %7s%%\n" "$r" "$load" "$cs GB/s" \
        "$ps GB/s" "$(awk -v a="$ps" -v b="$cs" 'BEGIN{print 100*a/b}')" "$cr GB/s" "$pr GB/s" \
        "$(awk -v a="$pr" -v b="$cr" 'BEGIN{print 100*a/b}')" "$is" "$ir"
    if [ -n "${VERBOSE:-}" ]; then cat "$TMP/c.out" "$TMP/py.out"; fi
done
med() { sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
cs=$(awk '{print $1}' "$TMP/all" | med); ps=$(awk '{print $2}' "$TMP/all" | med)
cr=$(awk '{print $3}' "$TMP/all" | med); pr=$(awk '{print $4}' "$TMP/all" | med)
is=$(awk '{print $5}' "$TMP/all" | med); ir=$(awk '{print $6}' "$TMP/all" | med)
printf "%-21s %10s %10s %6.0f%% %10s %10s %6.0f%% %7s%% %7s%%\n" "median of $RUNS" "$cs GB/s" \
    "$ps GB/s" "$(awk -v a="$ps" -v b="$cs" 'BEGIN{print 100*a/b}')" "$cr GB/s" "$pr GB/s" \
    "$(awk -v a="$pr" -v b="$cr" 'BEGIN{print 100*a/b}')" "$is" "$ir"
echo "il-store, il-retr: Python/C of the per-prompt medians when the Python benchmark alternates"
echo "its requests with liblmcache-client's in one process (--interleave-c): same load for both"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "lookup latency, last run: C: $(grep -o 'p50 [0-9.]* us' "$TMP/c.out")," \
     "Python: $(grep -o 'p50 [0-9.]* us' "$TMP/py.out")"
