#!/usr/bin/env python3
"""A two-node fleet on loopback: one master, two cache servers reporting to it, a prompt stored
on one of them, and the master's routing query sending the prompt there (docs/fleet.md).

    PYTHONPATH=build/python:python /usr/bin/python3 examples/fleet/route_demo.py [build/lmcache]
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import msgpack
import zmq

from lmcache_fleet import placement_hashes

BIN = sys.argv[1] if len(sys.argv) > 1 else "build/lmcache"
CHUNK = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("no answer from " + url)


def route(http_port, body):
    req = urllib.request.Request("http://127.0.0.1:%d/route" % http_port,
                                 data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def store(zmq_port, tokens):
    """store_bytes over the data socket (docs/protocol.md)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect("tcp://127.0.0.1:%d" % zmq_port)
    s.send_multipart([b"1", b"store_bytes", msgpack.packb({
        "model_name": "demo-model", "token_ids": tokens,
        "chunks": [b"kv" * 64] * (len(tokens) // CHUNK)})])
    reply = msgpack.unpackb(s.recv_multipart()[-1], raw=False)
    s.close(0)
    return reply


def main():
    procs = []
    try:
        grpc_port, http_port = free_port(), free_port()
        env = dict(os.environ, LMCACHE_MASTER_METRICS_HOST="127.0.0.1")
        procs.append(subprocess.Popen([BIN, "master", "127.0.0.1:%d" % grpc_port,
                                       str(http_port)], env=env))
        wait_http("http://127.0.0.1:%d/metrics" % http_port)
        nodes = {}
        for name in ("cache-a", "cache-b"):
            zp, hp = free_port(), free_port()
            procs.append(subprocess.Popen([
                BIN, "server", "--host", "127.0.0.1", "--port", str(zp), "--http-host",
                "127.0.0.1", "--http-port", str(hp), "--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                "--chunk-size",
                str(CHUNK), "--master-address", "127.0.0.1:%d" % grpc_port, "--node-id", name,
                "--node-address", "tcp://127.0.0.1:%d" % zp]))
            wait_http("http://127.0.0.1:%d/healthcheck" % hp)
            nodes[name] = zp
        tokens = list(range(4 * CHUNK))
        print("store on cache-b:", store(nodes["cache-b"], tokens))
        hashes = placement_hashes("demo-model", tokens, chunk_size=CHUNK)
        print("placement hashes:", [h[:12] for h in hashes])
        deadline = time.time() + 10
        while True:
            r = route(http_port, {"model_name": "demo-model", "chunk_size": CHUNK,
                                  "token_ids": tokens})
            if r["nodes"] or time.time() > deadline:
                break
            time.sleep(0.1)
        print(json.dumps(r, indent=1))
        ok = r["recommended"] and r["recommended"]["node_id"] == "cache-b"
        print("routed to", r["recommended"]["node_id"] if r["recommended"] else None)
        return 0 if ok else 1
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
