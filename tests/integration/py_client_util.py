"""Makes `import lmcache_client` find the build tree's copy of python/lmcache_client."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("LMCACHE_BUILD_DIR", os.path.join(ROOT, "build"))
PYDIR = os.path.join(BUILD, "python")

if not os.path.isfile(os.path.join(PYDIR, "lmcache_client", "__init__.py")):
    raise RuntimeError(f"{PYDIR}/lmcache_client is missing: build the project first")
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)
