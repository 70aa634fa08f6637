#!/usr/bin/env bash
# Extra checks run by scripts/test.sh after the sanitizer pass:
#  1. the concurrency stress tests under ThreadSanitizer (any report fails the run), and the
#     server's data-plane, L1, L2 and admin integration tests against a ThreadSanitizer build
#     of the server (a report makes it exit 66, which fails the test; tests/tsan.supp names the
#     uninstrumented libraries whose own hand-overs it cannot see); then the master's
#     concurrency, life-cycle and Redis read-cache/Cluster tests against the same build;
#  2. every libFuzzer driver (tests/fuzz/fuzz_*.c) for a bounded time each
#     (LMCACHE_FUZZ_SECONDS, default 30), with ASan+UBSan; a crash fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."

rc=0
scripts/build.sh build-tsan -DLMCACHE_TSAN=ON -DLMCACHE_TESTS=ON
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
for t in build-tsan/test_l1_stress build-tsan/test_l1_clear_stress build-tsan/test_l2_stress build-tsan/test_l2_dax build-tsan/test_kvwarm; do
    echo "--- $t (ThreadSanitizer)"
    timeout 600 "$t" || rc=1
done
echo "--- server integration tests (ThreadSanitizer)"
TSAN_OPTIONS="$TSAN_OPTIONS suppressions=$(pwd)/tests/tsan.supp" \
    LMCACHE_BIN="$(pwd)/build-tsan/lmcache" LMCACHE_BUILD_DIR="$(pwd)/build-tsan" \
    timeout 1800 /usr/bin/python3 -m pytest -q -p no:cacheprovider \
    tests/integration/test_store_truth.py tests/integration/test_dp_loop.py \
    tests/integration/test_dataplane_server.py tests/integration/test_dp_chunk_frames.py \
    tests/integration/test_l1_hardening.py tests/integration/test_copy_pool.py \
    tests/integration/test_l2_fs_server.py tests/integration/test_admin_hardening.py \
    tests/integration/test_reconfigure.py || rc=1
# The master (~4 min under ThreadSanitizer): every path at once, the life cycle on the four
# stores, the Redis read cache's listener and watch threads, the Cluster slot map under
# resharding. test_master_extkv, test_master_hardening and test_master_redis also pass under it
# (~4 min more), but they check the answers of single calls (validation, semantics, restarts)
# one at a time, on paths the concurrency test already runs in parallel, so they are left out.
echo "--- master integration tests (ThreadSanitizer)"
TSAN_OPTIONS="$TSAN_OPTIONS suppressions=$(pwd)/tests/tsan.supp" \
    LMCACHE_BIN="$(pwd)/build-tsan/lmcache" LMCACHE_BUILD_DIR="$(pwd)/build-tsan" \
    timeout 900 /usr/bin/python3 -m pytest -q -p no:cacheprovider \
    tests/integration/test_master_concurrency.py tests/integration/test_master_basic.py \
    tests/integration/test_master_redis_cache.py tests/integration/test_master_redis_cluster.py \
    || rc=1

CC=clang scripts/build.sh build-fuzz -DLMCACHE_FUZZ=ON -DLMCACHE_TESTS=OFF
secs=${LMCACHE_FUZZ_SECONDS:-30}
for f in build-fuzz/fuzz_*; do
    [ -x "$f" ] || continue
    name=$(basename "$f")
    corpus=build-fuzz/corpus/$name
    mkdir -p "$corpus"
    seeds=""
    [ -d "tests/fuzz/corpus/$name" ] && seeds="$(pwd)/tests/fuzz/corpus/$name"
    echo "--- $name (libFuzzer, ${secs}s)"
    if ! (cd build-fuzz && timeout $((secs * 3 + 60)) "./$name" -max_total_time="$secs" \
            -max_len=8192 -rss_limit_mb=4096 -print_final_stats=0 "corpus/$name" $seeds \
            >"$name.log" 2>&1); then
        tail -40 "build-fuzz/$name.log"
        rc=1
    else
        grep -E '^Done' "build-fuzz/$name.log" || true
    fi
done
exit $rc
