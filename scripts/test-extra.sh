#!/usr/bin/env bash
# Extra checks run by scripts/test.sh after the sanitizer pass: the concurrency stress tests
# under ThreadSanitizer (any report fails the run).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/build.sh build-tsan -DLMCACHE_TSAN=ON -DLMCACHE_TESTS=ON

export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
rc=0
for t in build-tsan/test_l1_stress; do
    echo "--- $t (ThreadSanitizer)"
    timeout 600 "$t" || rc=1
done
exit $rc
