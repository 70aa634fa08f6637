#!/usr/bin/python3
"""Soak test of `lmcache server` (not part of CI; scripts/soak.sh runs it).

Several engines store and retrieve through the data socket (shared memory and bytes), every
byte they get back is compared with what was stored under that key; meanwhile L1 is cleared,
quotas change, a client is SIGKILLed in the middle of its requests, and S3 (the L2 tier) goes
away and comes back. A prober calls /healthcheck every 100 ms and RSS is sampled every 5 s.
Everything runs on 127.0.0.1 and stops by itself after --seconds.

Passes when: zero wrong bytes, no failed health probe and p99 under 100 ms, RSS after warm-up
grows by less than --rss-slack-mb, and the server is still alive and exits 0 on SIGTERM."""
import argparse
import http.client
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

import dp_util  # noqa: E402
import s3_harness  # noqa: E402

CHUNK = 256  # tokens per chunk (--chunk-size)
TPB = 16  # tokens per block
BPT = 256  # bytes per token and layer
LAYERS = 4
KV = 2
BLOCK_BYTES = TPB * BPT
BLOCKS_PER_CHUNK = CHUNK // TPB
CHUNKS_PER_PROMPT = 4
PROMPTS = 48  # per engine


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {}

    def add(self, name, n=1):
        with self.lock:
            self.c[name] = self.c.get(name, 0) + n


def tokens_of(engine, prompt):
    base = (engine * 1000 + prompt) * 7919
    return [(base + i) % 2_000_000_000 for i in range(CHUNK * CHUNKS_PER_PROMPT)]


def block_pattern(engine, prompt, chunk, layer, k, blk):
    head = struct.pack("<6I", 0x50414B53, engine, prompt, chunk, layer * KV + k, blk)
    return (head * (BLOCK_BYTES // len(head) + 1))[:BLOCK_BYTES]


def bytes_pattern(engine, prompt, chunk, size):
    head = struct.pack("<4I", 0x53455442, engine, prompt, chunk)
    return (head * (size // len(head) + 1))[:size]


def http_call(port, method, path, body=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers=hdrs)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class Engine(threading.Thread):
    """One inference engine: a KV cache in shared memory, a salt, a pool of prompts."""

    def __init__(self, idx, port, stop, stats):
        super().__init__(name=f"engine-{idx}", daemon=True)
        self.idx, self.port, self.stop, self.stats = idx, port, stop, stats
        self.salt = f"tenant-{idx}"
        self.model = "soak-model"
        self.rng = random.Random(idx)

    def register(self, c, kv):
        c.call("register_kv_cache", instance_id=self.idx, model_name=self.model,
               **kv.layout())

    def shm_round(self, c, kv, rid):
        p = self.rng.randrange(PROMPTS)
        toks = tokens_of(self.idx, p)
        blocks = list(range(BLOCKS_PER_CHUNK * CHUNKS_PER_PROMPT))
        for ch in range(CHUNKS_PER_PROMPT):
            for j in range(BLOCKS_PER_CHUNK):
                b = ch * BLOCKS_PER_CHUNK + j
                for layer in range(LAYERS):
                    for k in range(KV):
                        off = kv.block_off(layer, k, b)
                        kv.mem[off:off + BLOCK_BYTES] = block_pattern(self.idx, p, ch, layer, k, j)
        r = c.raw("store", dict(instance_id=self.idx, token_ids=toks, block_ids=blocks,
                                cache_salt=self.salt))
        self.stats.add("store_ok" if r["ok"] else "store_fail_" + r.get("code", "?"))
        kv.zero()
        req = f"e{self.idx}-{rid}"
        r = c.raw("lookup", dict(request_id=req, model_name=self.model, token_ids=toks,
                                 cache_salt=self.salt))
        if not r["ok"]:
            self.stats.add("lookup_fail_" + r.get("code", "?"))
            return
        deadline = time.monotonic() + 30
        while True:
            st = c.raw("query_prefetch_status", dict(request_id=req))
            if st.get("ready") or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        hits = st.get("hit_chunks", 0) if st.get("ready") else 0
        if hits:
            r = c.raw("retrieve", dict(instance_id=self.idx, request_id=req, token_ids=toks,
                                       end=hits * CHUNK, block_ids=blocks, cache_salt=self.salt))
            got = r.get("retrieved_chunks", 0)
            self.stats.add("retrieved_chunks", got)
            for ch in range(got):
                for j in range(BLOCKS_PER_CHUNK):
                    b = ch * BLOCKS_PER_CHUNK + j
                    for layer in range(LAYERS):
                        for k in range(KV):
                            off = kv.block_off(layer, k, b)
                            if kv.mem[off:off + BLOCK_BYTES] != block_pattern(self.idx, p, ch,
                                                                              layer, k, j):
                                self.stats.add("wrong_blocks")
        c.raw("end_session", dict(request_id=req))

    def bytes_round(self, c):
        p = self.rng.randrange(PROMPTS)
        toks = tokens_of(self.idx, p)
        size = LAYERS * KV * CHUNK * BPT
        chunks = [bytes_pattern(self.idx, p, ch, size) for ch in range(CHUNKS_PER_PROMPT)]
        r = c.raw("store_bytes", dict(model_name=self.model + "-bytes", token_ids=toks,
                                      chunks=chunks, cache_salt=self.salt))
        self.stats.add("store_bytes_ok" if r["ok"] else "store_bytes_fail_" + r.get("code", "?"))
        r = c.raw("retrieve_bytes", dict(model_name=self.model + "-bytes", token_ids=toks,
                                         cache_salt=self.salt))
        if not r["ok"]:
            self.stats.add("retrieve_bytes_fail_" + r.get("code", "?"))
            return
        for ch, data in enumerate(r["chunks"]):
            self.stats.add("retrieved_bytes_chunks")
            if data != chunks[ch]:
                self.stats.add("wrong_chunks")

    def run(self):
        kv = dp_util.ShmKV(layers=LAYERS, blocks=BLOCKS_PER_CHUNK * CHUNKS_PER_PROMPT,
                           tokens_per_block=TPB, bytes_per_token=BPT, kv_count=KV)
        c = dp_util.DPClient(self.port)
        try:
            self.register(c, kv)
            rid = 0
            while not self.stop.is_set():
                rid += 1
                try:
                    if rid % 3:
                        self.shm_round(c, kv, rid)
                    else:
                        self.bytes_round(c)
                    if rid % 50 == 0:
                        self.register(c, kv)  # liveness, as an engine pings
                except Exception as e:  # a timeout is a finding, not a crash of the soak
                    self.stats.add("client_errors")
                    print(f"{self.name}: {e!r}", file=sys.stderr)
                    c.close()
                    c = dp_util.DPClient(self.port)
                    try:  # a registration belongs to its connection: register the new one
                        self.register(c, kv)
                    except Exception as e2:
                        print(f"{self.name}: register: {e2!r}", file=sys.stderr)
        finally:
            c.close()
            kv.close()
            try:
                os.unlink("/dev/shm" + kv.name)
            except FileNotFoundError:
                pass


KILLED_CLIENT = r"""
import sys, msgpack, zmq
sys.path.insert(0, sys.argv[2])
port = int(sys.argv[1])
s = zmq.Context().socket(zmq.DEALER)
s.connect(f"tcp://127.0.0.1:{port}")
toks = list(range(7_000_000, 7_000_000 + 256 * 8))
s.send_multipart([b"1", b"lookup", msgpack.packb(dict(request_id="victim", model_name="soak-model",
                  token_ids=toks, cache_salt="tenant-0"))])
big = [bytes(4 * 1024 * 1024)] * 8
s.send_multipart([b"2", b"store_bytes", msgpack.packb(dict(model_name="soak-killed",
                  token_ids=toks, chunks=big, cache_salt="tenant-0"))])
while True:
    s.recv_multipart()
"""


def periodic(stop, every, fn, stats, name):
    while not stop.wait(every):
        try:
            fn()
            stats.add(name)
        except Exception as e:
            stats.add(name + "_errors")
            print(f"{name}: {e!r}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--l1-size-gb", default="0.25")
    ap.add_argument("--rss-slack-mb", type=float, default=64)
    ap.add_argument("--no-s3", action="store_true", help="no L2 tier (when node/npm are missing)")
    for name, every in (("clear", 5), ("quota", 3), ("kill", 10), ("s3-outage", 60)):
        ap.add_argument(f"--{name}-every", type=float, default=every,
                        help=f"seconds between two {name} events (0: none; default {every})")
    ap.add_argument("--json", help="write the summary here too")
    args = ap.parse_args()
    binary = os.environ.get("LMCACHE_BIN", os.path.join(ROOT, "build", "lmcache"))

    s3 = None
    argv_l2 = []
    if not args.no_s3:
        s3 = s3_harness.S3Env().start()
        argv_l2 = ["--l2-adapter", json.dumps({
            "type": "s3", "endpoint": s3.endpoint, "bucket": s3.bucket,
            "access_key_id": s3_harness.AKID, "secret_access_key": s3_harness.SECRET,
            "request_timeout_ms": 5000, "connect_timeout_ms": 500})]
    http_port, zmq_port = s3_harness.free_port(), s3_harness.free_port()
    log = tempfile.NamedTemporaryFile(prefix="lmcache-soak-", suffix=".log", delete=False)
    srv = subprocess.Popen([binary, "server", "--host", "127.0.0.1", "--port", str(zmq_port),
                            "--http-host", "127.0.0.1", "--http-port", str(http_port),
                            "--l1-size-gb", args.l1_size_gb, "--eviction-policy", "IsolatedLRU",
                            "--chunk-size", str(CHUNK), "--max-workers", "2",
                            "--l1-read-ttl-seconds", "20", *argv_l2],
                           stdout=log, stderr=subprocess.STDOUT)
    stats = Stats()
    stop = threading.Event()
    threads = []
    health, rss = [], []
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if http_call(http_port, "GET", "/healthcheck", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or srv.poll() is not None:
                raise RuntimeError("server did not start; log: " + log.name)
            time.sleep(0.05)
        quota_mb = 96
        for i in range(args.engines):
            http_call(http_port, "PUT", f"/quota/tenant-{i}", {"limit_gb": quota_mb / 1024})

        def probe():
            while not stop.is_set():
                t = time.monotonic()
                try:
                    ok = http_call(http_port, "GET", "/healthcheck", timeout=2)[0] == 200
                except OSError:
                    ok = False
                health.append((time.monotonic() - t, ok))
                stop.wait(0.1)

        def sample_rss():
            while not stop.is_set():
                with open(f"/proc/{srv.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            rss.append((time.monotonic() - t0, int(line.split()[1]) // 1024))
                stop.wait(5)

        def clear():
            st, _ = http_call(http_port, "POST", "/cache/clear")
            assert st == 200, st

        qrng = random.Random(7)

        def quota():
            i = qrng.randrange(args.engines)
            if qrng.random() < 0.2:
                http_call(http_port, "DELETE", f"/quota/tenant-{i}")
            http_call(http_port, "PUT", f"/quota/tenant-{i}",
                      {"limit_gb": qrng.choice([16, 48, 96]) / 1024})

        def kill_client():
            p = subprocess.Popen(["/usr/bin/python3", "-c", KILLED_CLIENT, str(zmq_port), HERE])
            time.sleep(random.uniform(0.05, 0.6))
            p.kill()
            p.wait()

        s3_down = []

        def s3_outage():
            proc = s3.procs[0]
            proc.terminate()
            proc.wait(10)
            s3_down.append(time.monotonic() - t0)
            stop.wait(15)
            log3 = open(os.path.join(s3.tmp, "s3rver.log"), "a")
            js = s3_harness.ensure_s3rver(s3.cache)
            s3.procs[0] = subprocess.Popen(
                ["node", "--openssl-legacy-provider", js, "-s", "-d", os.path.join(s3.tmp, "data"),
                 "-a", "127.0.0.1", "-p", str(s3.s3_port), "--no-vhost-buckets"],
                stdout=log3, stderr=subprocess.STDOUT)
            s3_harness.wait_port(s3.s3_port, s3.procs[0], "s3rver", timeout=60)

        for i in range(args.engines):
            threads.append(Engine(i, zmq_port, stop, stats))
        threads.append(threading.Thread(target=probe, daemon=True))
        threads.append(threading.Thread(target=sample_rss, daemon=True))
        events = [(args.clear_every, clear, "clears"), (args.quota_every, quota, "quota_changes"),
                  (args.kill_every, kill_client, "killed_clients")]
        if s3:
            events.append((args.s3_outage_every, s3_outage, "s3_outages"))
        for every, fn, name in events:
            if every > 0:
                threads.append(threading.Thread(target=periodic, args=(stop, every, fn, stats, name),
                                                daemon=True))
        for t in threads:
            t.start()
        while time.monotonic() - t0 < args.seconds and srv.poll() is None:
            time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        alive = srv.poll() is None
        if alive:
            srv.send_signal(signal.SIGTERM)
            try:
                rc = srv.wait(30)
            except subprocess.TimeoutExpired:
                srv.kill()
                rc = "hung"
        else:
            rc = srv.returncode
        if s3:
            s3.stop()

    lat = sorted(x[0] for x in health)
    fails = sum(1 for x in health if not x[1])

    def pct(q):
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 2) if lat else None

    warm = args.seconds * 0.2
    after = [m for (t, m) in rss if t >= warm]
    growth = (max(after) - after[0]) if after else None
    summary = {
        "seconds": args.seconds, "engines": args.engines, "counters": stats.c,
        "wrong_bytes": stats.c.get("wrong_blocks", 0) + stats.c.get("wrong_chunks", 0),
        "health_probes": len(lat), "health_failed": fails, "health_p50_ms": pct(0.5),
        "health_p99_ms": pct(0.99), "health_max_ms": round(lat[-1] * 1000, 2) if lat else None,
        "rss_mb_after_warmup": [min(after), max(after)] if after else None,
        "rss_growth_mb": growth, "server_alive_at_end": alive, "exit_code": rc,
        "load_average": os.getloadavg(), "server_log": log.name,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    problems = []
    if summary["wrong_bytes"]:
        problems.append("wrong bytes")
    if fails or (lat and pct(0.99) >= 100):
        problems.append("health probes")
    if growth is None or growth > args.rss_slack_mb:
        problems.append("RSS growth")
    if not alive or rc != 0:
        problems.append("server exit")
    if not stats.c.get("retrieved_chunks") or not stats.c.get("retrieved_bytes_chunks"):
        problems.append("no traffic verified")
    print("soak:", "FAILED: " + ", ".join(problems) if problems else "passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
