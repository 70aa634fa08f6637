#!/usr/bin/python3
"""What a registration costs the registering client and the others: `register_kv_cache` of one
allocated shared-memory object (2 GiB by default) against a fresh `lmcache server` (one worker,
the default), while a second client sends a `noop` every 10 ms. Prints the time to the reply,
the time until `ping` no longer says `warming` (the region faulted in), and the second client's
`noop` round trips meanwhile (max and median).

    scripts/build.sh build && /usr/bin/python3 scripts/bench-register.py [LMCACHE_BINARY] [MiB]
"""
import os
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from dp_util import DPClient, ShmKV  # noqa: E402
from netutil import free_port  # noqa: E402

binary = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "lmcache")
mib = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
http, zmq_port = free_port(), free_port()
srv = subprocess.Popen([binary, "server", "--eviction-policy", "LRU", "--l1-size-gb", "1",
                        "--host", "127.0.0.1", "--port", str(zmq_port), "--http-host",
                        "127.0.0.1", "--http-port", str(http)], stderr=subprocess.DEVNULL)
kv = a = b = None
try:
    for _ in range(400):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/healthcheck", timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    # 32 layers x 2 x blocks x 16 tokens x 1 KiB: 1 MiB per block
    kv = ShmKV(layers=32, blocks=max(1, mib // 1), tokens_per_block=16, bytes_per_token=1024)
    kv.allocate()
    a, b = DPClient(zmq_port), DPClient(zmq_port)
    b.call("noop")
    lat, stop = [], threading.Event()

    def pinger():
        while not stop.is_set():
            t = time.monotonic()
            b.call("noop")
            lat.append(time.monotonic() - t)
            time.sleep(0.01)

    th = threading.Thread(target=pinger)
    th.start()
    t0 = time.monotonic()
    a.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
    t1 = time.monotonic()
    while a.call("ping", instance_id=1).get("warming"):
        time.sleep(0.005)
    t2 = time.monotonic()
    stop.set()
    th.join()
    lat.sort()
    print(f"{binary}: {kv.size >> 20} MiB, load average {os.getloadavg()[0]:.2f}: reply "
          f"{t1 - t0:.3f} s, faulted in after {t2 - t0:.3f} s; the other client's noop: max "
          f"{lat[-1] * 1e3:.1f} ms, p50 {lat[len(lat) // 2] * 1e3:.1f} ms ({len(lat)} calls)")
finally:
    for c in (a, b):
        if c:
            c.close()
    if kv:
        kv.close()
    srv.terminate()
    srv.wait()
