#!/usr/bin/env bash
# Installs every Debian package the build, the tests and the benchmarks need.
# Idempotent: packages already present are skipped, so a second run is fast.
set -euo pipefail

PKGS=(
  # toolchain
  build-essential cmake pkg-config git clang libclang-rt-14-dev clang-format
  # server
  libmicrohttpd-dev libjansson-dev libzmq3-dev libssl-dev libmsgpack-dev liburing-dev
  # S3 L2 adapter (libcurl + expat); awscli (and node/npm, below) for its tests
  libcurl4-openssl-dev libexpat1-dev awscli
  # master
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler protobuf-compiler-grpc
  # master: the Redis metadata store (hiredis) and the Redis its tests start
  libhiredis-dev redis-server redis-tools
  # tests
  libcmocka-dev python3-pytest python3-requests python3-zmq python3-msgpack python3-numpy
  python3-grpcio python3-protobuf python3-yaml prometheus curl procps systemd
  # admin API HTTPS tests (test certificate)
  openssl
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# s3rver (the S3 tests' server) runs on node and installs with npm. They are looked for as
# commands: a machine may have a Node.js of its own (e.g. a vendor build of nodejs that brings
# npm itself and conflicts with Debian's npm package); Debian's are installed only when absent.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
