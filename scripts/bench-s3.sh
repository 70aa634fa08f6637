#!/usr/bin/env bash
# S3 L2 adapter PUT/GET throughput next to awscli, against the same s3rver in the same run.
#   scripts/bench-s3.sh [BUILD_DIR] [OBJECTS] [SIZE_MIB]
# Both clients talk to s3rver directly (no verifying proxy: its single Python process would be
# the bottleneck); s3rver (single-threaded Node) is the limit for both, so these figures say how
# close the adapter gets to that limit, not what real S3 would give.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
n=${2:-64}
mib=${3:-4}
export LMCACHE_BUILD_DIR=$PWD/$build
exec /usr/bin/python3 tests/integration/s3_harness.py run -- /bin/bash -c '
set -euo pipefail
build='"$build"' n='"$n"' mib='"$mib"'
export AWS_ACCESS_KEY_ID=$LMCACHE_S3_TEST_AKID AWS_SECRET_ACCESS_KEY=$LMCACHE_S3_TEST_SECRET
export AWS_DEFAULT_REGION=us-east-1 AWS_CONFIG_FILE=/nonexistent AWS_SHARED_CREDENTIALS_FILE=/nonexistent
export AWS_EC2_METADATA_DISABLED=true AWS_PAGER=
ep=$LMCACHE_S3_TEST_DIRECT b=$LMCACHE_S3_TEST_BUCKET
echo "machine: $(nproc) cores, $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | xargs), $(uname -r)"
echo "s3rver 3.7.1 on 127.0.0.1 (node $(node --version)), $n objects x $mib MiB"
for k in 1 16; do
  "$build/lmcache" bench s3 --endpoint "$ep" --bucket "$b" --objects "$n" --size-mib "$mib" --in-flight "$k"
done
"$build/lmcache" bench s3 --endpoint "$ep" --bucket "$b" --objects "$n" --size-mib "$mib" --in-flight 16 --unsigned-payload
tmp=$(mktemp -d)
trap "rm -rf $tmp" EXIT
mkdir "$tmp/up" "$tmp/down"
for i in $(seq 1 "$n"); do head -c $((mib << 20)) /dev/urandom > "$tmp/up/obj$i"; done
mb=$(( n * (mib << 20) ))
# awscli s3 cp: 10 concurrent requests (its default); objects up to 8 MiB are single PUTs.
t0=$(date +%s.%N)
/usr/bin/aws --endpoint-url "$ep" s3 cp --recursive --quiet "$tmp/up" "s3://$b/awscli/"
t1=$(date +%s.%N)
/usr/bin/aws --endpoint-url "$ep" s3 cp --recursive --quiet "s3://$b/awscli/" "$tmp/down"
t2=$(date +%s.%N)
cmp -s <(cat "$tmp"/up/*) <(cat "$tmp"/down/*) || { echo "awscli round trip differs"; exit 1; }
awk -v a="$t0" -v b="$t1" -v c="$t2" -v mb="$mb" -v n="$n" "BEGIN {
  printf \"awscli PUT (s3 cp, 10 concurrent): %.3f s, %.1f MB/s\n\", b-a, mb/1e6/(b-a);
  printf \"awscli GET (s3 cp, 10 concurrent): %.3f s, %.1f MB/s\n\", c-b, mb/1e6/(c-b) }"
'
