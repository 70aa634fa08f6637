#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, and runs every test
# (unit + integration), then the whole suite again under AddressSanitizer +
# UndefinedBehaviorSanitizer, the concurrency stress test under ThreadSanitizer,
# and every fuzz driver for a bounded time.
#   LMCACHE_TEST_QUICK=1  skips the sanitizer, TSan and fuzz passes (local iteration).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

scripts/install-deps.sh || exit 1

passed=0
failed=0
failures=()
step() { # step NAME CMD...
    local name=$1; shift
    echo "=== $name"
    if "$@"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        failures+=("$name")
    fi
}

unit() { (cd "$1" && ctest --output-on-failure -j2 --timeout 600); }
integ() {
    local bin=$1
    local rc=0
    LMCACHE_BIN="$root/$bin/lmcache" LMCACHE_BUILD_DIR="$root/$bin" \
        /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/integration || rc=$?
    [ "$rc" -eq 5 ] && rc=0 # no tests collected
    return $rc
}
fmt() {
    local bad
    bad=$(find src include tests -name '*.[ch]' -print0 | xargs -0 clang-format --dry-run 2>&1 | grep -c 'warning:' || true)
    [ "$bad" -eq 0 ] || { echo "clang-format: $bad places differ; run clang-format -i"; return 1; }
}

step "build (release, -Werror)" scripts/build.sh build
step "unit tests" unit build
step "integration tests" integ build
step "clang-format" fmt

if [ -z "${LMCACHE_TEST_QUICK:-}" ]; then
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    step "build (ASan+UBSan)" scripts/build.sh build-asan -DLMCACHE_SANITIZE=ON
    step "unit tests (ASan+UBSan)" unit build-asan
    step "integration tests (ASan+UBSan)" integ build-asan
    [ -x scripts/test-extra.sh ] && step "TSan + fuzz" scripts/test-extra.sh
fi

echo
for f in "${failures[@]}"; do echo "FAILED: $f"; done
echo "suites: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
