#!/usr/bin/env bash
# Regenerates the option table of docs/configuration.md from the option table in the code:
# scripts/gen-config-doc.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build}/lmcache
table=$("$bin" server --help-markdown)
/usr/bin/python3 - "$table" <<'PY'
import sys
p = "docs/configuration.md"
doc = open(p).read()
start = doc.index("\n", doc.index("<!-- BEGIN OPTIONS")) + 1
end = doc.index("<!-- END OPTIONS")
open(p, "w").write(doc[:start] + sys.argv[1] + "\n" + doc[end:])
PY
