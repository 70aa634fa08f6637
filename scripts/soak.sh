#!/usr/bin/env bash
# Soak test (not in CI): installs, builds, then runs tests/soak/soak.py against the release
# build for 10 minutes (override: scripts/soak.sh --seconds 120). Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build
LMCACHE_BIN="$PWD/build/lmcache" LMCACHE_BUILD_DIR="$PWD/build" exec /usr/bin/python3 tests/soak/soak.py "$@"
