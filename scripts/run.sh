#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, and runs
# `lmcache server` with an embedded default (in-memory L1, no external service).
# Extra arguments are passed to the server, e.g. scripts/run.sh --http-port 9090
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build
exec ./build/lmcache server --l1-size-gb "${LMCACHE_L1_SIZE_GB:-1}" --eviction-policy LRU "$@"
