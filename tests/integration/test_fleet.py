"""Servers reporting to the master (`lmcache server --master-address`), over real processes on
loopback: registration, placements of L1 (DRAM) and fs (SSD) objects under the documented
placement hashes, revokes on clear / delete / eviction, the reaper after SIGKILL, a master
restart followed by re-registration and a full report, and a master that is down costing the
data path nothing."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from conftest import free_port
from dp_util import DPClient
from master_util import ROOT, build_dir, lmcache_bin, use_python_package, wait_port

use_python_package()
sys.path.insert(0, os.path.join(ROOT, "python"))
from lmcache_fleet import kv_rank, placement_hash, placement_hashes  # noqa: E402
from umbp import UMBPMasterClient, UMBPTierType  # noqa: E402

CHUNK = 16
# Short TTLs: a node expires 2 s after its last heartbeat; heartbeats every 500 ms.
FAST = {"UMBP_HEARTBEAT_TTL_SEC": "1", "UMBP_MAX_MISSED_HEARTBEATS": "2",
        "UMBP_REAPER_INTERVAL_SEC": "1", "LMCACHE_MASTER_EXPIRED_RETENTION_SEC": "0"}


class Master:
    def __init__(self, port=None, env=None):
        self.port = port or free_port()
        self.http_port = free_port()
        self.addr = "127.0.0.1:%d" % self.port
        e = dict(os.environ, LMCACHE_MASTER_METRICS_HOST="127.0.0.1", **FAST)
        e.update(env or {})
        self.proc = subprocess.Popen([lmcache_bin(), "master", self.addr, str(self.http_port)], env=e,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_port(self.port, self.proc)
        wait_port(self.http_port, self.proc)

    def route(self, **body):
        return requests.post("http://127.0.0.1:%d/route" % self.http_port, json=body, timeout=30)

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.communicate(timeout=30)
        return self.proc.returncode


@pytest.fixture
def master():
    m = Master()
    yield m
    m.stop()


def prompt(seed, chunks):
    import random
    rnd = random.Random(seed)
    return [rnd.randrange(1 << 31) for _ in range(chunks * CHUNK)]


def wait_for(cond, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    return cond()


def fleet_server(make_server, master_addr, node_id, *args, **kw):
    s = make_server(args=["--chunk-size", str(CHUNK), "--master-address", master_addr,
                          "--node-id", node_id, "--node-address", node_id + ":5555"] + list(args),
                    **kw)
    return s, DPClient(s.zmq_port)


def matches(addr, hashes):
    """{node_id: {tier: set(hashes)}} for the hashes."""
    c = UMBPMasterClient(addr)
    out = {}
    for m in c.match_external_kv(hashes):
        out[m.node_id] = {int(t): set(hs) for t, hs in m.hashes_by_tier.items()}
    return out


def store(c, seed, chunks=2, salt="", model="m"):
    r = c.call("store_bytes", model_name=model, cache_salt=salt, token_ids=prompt(seed, chunks),
               chunks=[b"x" * 256] * chunks)
    assert r["stored_chunks"] == chunks
    return placement_hashes(model, prompt(seed, chunks), cache_salt=salt, chunk_size=CHUNK)


def test_recipe_vectors_match_the_c_side():
    # The same vectors as tests/unit/test_fleethash.c.
    assert kv_rank(1, 0) == 0x01000100 and kv_rank(4, 2) == 0x04020402
    assert placement_hash("m", "", kv_rank(), bytes(range(32))) == (
        "47c444583894c818c55e82694cdecad9e4f2e4c084a03b4c85b1f6373b3be27f")
    # Tenants and models never share a placement.
    assert placement_hash("m", "a", 1, b"\1") != placement_hash("m", "b", 1, b"\1")
    assert placement_hash("m", "", 1, b"\1") != placement_hash("n", "", 1, b"\1")


def test_two_servers_report_placements_and_revokes(master, make_server, tmp_path):
    base = tmp_path / "l2"
    base.mkdir()
    s1, c1 = fleet_server(make_server, master.addr, "node-a")
    s2, c2 = fleet_server(make_server, master.addr, "node-b", "--l2-adapter",
                          json.dumps({"type": "fs", "base_path": str(base)}))
    h1 = store(c1, 1)
    h2 = store(c2, 2)
    # The reported strings are the recipe's: a router computes them from token ids alone.
    assert wait_for(lambda: matches(master.addr, h1) == {
        "node-a": {UMBPTierType.DRAM: set(h1)}})
    assert wait_for(lambda: matches(master.addr, h2).get("node-b") == {
        UMBPTierType.DRAM: set(h2), UMBPTierType.SSD: set(h2)})
    # The same prompt under another tenant matches nothing.
    other = placement_hashes("m", prompt(1, 2), cache_salt="tenant-b", chunk_size=CHUNK)
    assert matches(master.addr, other) == {}
    st = s1.get("/status").json()["master"]
    assert st["connected"] and st["registered"] and st["node_id"] == "node-a"
    assert st["node_address"] == "node-a:5555" and st["tracked_hashes"] == 2
    m = s1.get("/metrics").text
    assert "lmcache_mp_master_connected 1" in m
    assert "lmcache_mp_master_reported_hashes_total 2" in m

    # POST /cache/clear revokes node-b's DRAM placements; its SSD copies stay.
    assert s2.post("/cache/clear").status_code == 200
    assert wait_for(lambda: matches(master.addr, h2).get("node-b") == {
        UMBPTierType.SSD: set(h2)})
    # DELETE /cache/objects of one L2 object revokes that hash on SSD.
    key = s2.get("/cache/objects").json()["entries"][0]["key"]
    gone = placement_hash(key["model_name"], key["cache_salt"], key["kv_rank"],
                          bytes.fromhex(key["chunk_hash_hex"]))
    assert gone in h2
    assert s2.delete("/cache/objects", json={"keys": [key]}).status_code == 200
    assert wait_for(lambda: matches(master.addr, h2).get("node-b") == {
        UMBPTierType.SSD: set(h2) - {gone}})
    # A clean shutdown unregisters: node-a's placements go at once.
    assert s1.stop() == 0
    assert matches(master.addr, h1) == {}


def test_l1_eviction_revokes(master, make_server):
    # 2 MiB of L1, 256 KiB objects: sixteen stores evict the first.
    s, c = fleet_server(make_server, master.addr, "node-e", l1_size_gb=2 / 1024)
    blob = b"e" * (256 << 10)
    first = None
    for i in range(16):
        toks = prompt(100 + i, 1)
        assert c.call("store_bytes", model_name="m", token_ids=toks,
                      chunks=[blob])["stored_chunks"] == 1
        if first is None:
            first = placement_hashes("m", toks, chunk_size=CHUNK)
    last = placement_hashes("m", prompt(115, 1), chunk_size=CHUNK)
    assert wait_for(lambda: "node-e" in matches(master.addr, last))
    assert wait_for(lambda: matches(master.addr, first) == {})


def test_sigkill_is_reaped_after_the_ttl(master, make_server):
    s, c = fleet_server(make_server, master.addr, "node-k")
    h = store(c, 7)
    assert wait_for(lambda: "node-k" in matches(master.addr, h))
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait()
    s.log.close()
    s.proc.returncode = 0  # the fixture's clean-exit check does not apply
    # TTL 1 s x 2 missed + reaper 1 s: gone within a few seconds, no unregister sent.
    assert wait_for(lambda: matches(master.addr, h) == {}, timeout=20)


def test_master_restart_is_followed_by_a_full_report(make_server):
    m = Master()
    try:
        s, c = fleet_server(make_server, m.addr, "node-r")
        h = store(c, 11)
        assert wait_for(lambda: "node-r" in matches(m.addr, h))
        full0 = s.get("/status").json()["master"]
        m.stop()
        # The master is down: stores still succeed, the reporter marks itself dirty.
        h2 = store(c, 12)
        assert wait_for(lambda: not s.get("/status").json()["master"]["connected"])
        assert "lmcache_mp_master_connected 0" in s.get("/metrics").text
        m = Master(port=m.port)
        # Back: the node registers anew and reports everything it holds (old and new).
        assert wait_for(lambda: matches(m.addr, h + h2).get("node-r") == {
            UMBPTierType.DRAM: set(h + h2)})
        st = s.get("/status").json()["master"]
        assert st["connected"] and not st["full_sync_pending"]
        assert full0["heartbeat_interval_ms"] == 500
        # Re-registered and re-synced on the first heartbeat the new master answered (within
        # two heartbeat intervals of its return), not after some longer retry or TTL.
        assert full0["resync_heartbeats"] == 0
        assert st["resync_heartbeats"] in (1, 2), st
        text = s.get("/metrics").text
        full = [ln for ln in text.splitlines()
                if ln.startswith("lmcache_mp_master_full_syncs_total ")]
        assert full and float(full[0].split()[1]) >= 2
    finally:
        m.stop()


def test_hung_master_costs_the_data_path_nothing(make_server):
    # A master that accepts connections but never answers (SIGSTOP): every RPC waits for its
    # deadline on the reporter thread; stores keep succeeding and are acknowledged meanwhile.
    m = Master()
    try:
        s, c = fleet_server(make_server, m.addr, "node-h")
        h = store(c, 20)
        assert wait_for(lambda: "node-h" in matches(m.addr, h))
        m.proc.send_signal(signal.SIGSTOP)
        held = list(h)
        for i in range(30):
            held += store(c, 21 + i)  # asserts every chunk was stored and acknowledged
            assert c.call("lookup", request_id="h%d" % i, model_name="m",
                          token_ids=prompt(21 + i, 2))["ok"]
            c.call("end_session", request_id="h%d" % i)
        assert s.get("/healthcheck").status_code == 200
        assert wait_for(lambda: s.get("/status").json()["master"]["tracked_hashes"] == 62)
        # Answering again: the node re-syncs and the master knows everything it holds.
        m.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: matches(m.addr, held).get("node-h") == {
            UMBPTierType.DRAM: set(held)}, timeout=30)
    finally:
        if m.proc.poll() is None:
            m.proc.send_signal(signal.SIGCONT)
        m.stop()


def test_master_never_up_costs_the_data_path_nothing(make_server):
    port = free_port()  # nobody listens there
    s, c = fleet_server(make_server, "127.0.0.1:%d" % port, "node-x")
    for i in range(20):
        store(c, 200 + i)
    st = s.get("/status").json()["master"]
    assert not st["connected"] and not st["registered"]
    assert st["tracked_hashes"] == 40
    assert s.get("/healthcheck").status_code == 200


def test_routing_query_picks_the_holder(master, make_server, tmp_path):
    base = tmp_path / "l2"
    base.mkdir()
    sa, ca = fleet_server(make_server, master.addr, "node-a")
    sb, cb = fleet_server(make_server, master.addr, "node-b", "--l2-adapter",
                          json.dumps({"type": "fs", "base_path": str(base)}))
    toks = prompt(5, 4)
    # node-a holds the first 2 chunks in DRAM; node-b all 4 (DRAM and SSD).
    ca.call("store_bytes", model_name="m", token_ids=toks[:2 * CHUNK], chunks=[b"a" * 64] * 2)
    cb.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"b" * 64] * 4)
    hashes = placement_hashes("m", toks, chunk_size=CHUNK)
    assert wait_for(lambda: len(matches(master.addr, hashes)) == 2 and
                    UMBPTierType.SSD in matches(master.addr, hashes)["node-b"])
    r = master.route(model_name="m", token_ids=toks + [1, 2, 3], chunk_size=CHUNK)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["chunks"] == 4 and j["chunk_size"] == CHUNK
    assert j["recommended"]["node_id"] == "node-b", j
    assert j["recommended"]["peer_address"] == "node-b:5555"
    by = {n["node_id"]: n for n in j["nodes"]}
    assert by["node-b"]["prefix_tokens"] == 4 * CHUNK
    assert by["node-b"]["tokens_by_tier"] == {"DRAM": 4 * CHUNK}  # DRAM wins over SSD
    assert by["node-a"]["prefix_tokens"] == 2 * CHUNK
    assert [n["node_id"] for n in j["nodes"]] == ["node-b", "node-a"]
    # The same with precomputed hashes.
    assert master.route(hashes=hashes, chunk_size=CHUNK).json()["recommended"]["node_id"] == "node-b"
    # node-b's DRAM copies go: the SSD tier still gives it the longest prefix.
    assert sb.post("/cache/clear").status_code == 200
    assert wait_for(lambda: master.route(hashes=hashes, chunk_size=CHUNK).json()["nodes"][0]["tokens_by_tier"] ==
                    {"SSD": 4 * CHUNK}), (master.route(hashes=hashes, chunk_size=CHUNK).json(),
                                          matches(master.addr, hashes))
    # Equal prefixes: DRAM beats SSD.
    two = master.route(hashes=hashes[:2], chunk_size=CHUNK).json()
    assert two["recommended"]["node_id"] == "node-a"
    # Another tenant matches nothing; a node is still recommended (the least loaded).
    other = master.route(model_name="m", cache_salt="t2", token_ids=toks, chunk_size=CHUNK).json()
    assert other["nodes"] == [] and other["recommended"]["prefix_tokens"] == 0
    assert other["recommended"]["node_id"] in ("node-a", "node-b")


def test_routing_query_is_bounded(master):
    assert master.route(model_name="m", token_ids=[0] * 131073).status_code == 413
    assert master.route(hashes=["0" * 64] * 4097).status_code == 413
    assert master.route(hashes=["zz"]).status_code == 400
    assert master.route(token_ids=[1, 2]).status_code == 400  # no model_name
    assert master.route(model_name="m", token_ids=[-1]).status_code == 400
    assert master.route(model_name="m", token_ids=[1], hashes=[]).status_code == 400
    assert master.route(model_name="m", token_ids=[1], chunk_size=0).status_code == 400
    url = "http://127.0.0.1:%d/route" % master.http_port
    assert requests.post(url, data=b"[1]", timeout=30).status_code == 400
    # An oversized Content-Length is refused from the headers, before any body byte is read.
    import socket
    with socket.create_connection(("127.0.0.1", master.http_port), timeout=30) as sk:
        sk.sendall(b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" %
                   ((1 << 20) + 1))
        assert sk.recv(4096).startswith(b"HTTP/1.1 413 ")
    # Empty prompt: nothing matched, no node known.
    assert master.route(hashes=[]).json() == {"chunks": 0, "chunk_size": 256, "nodes": [],
                                              "recommended": None}
    # /metrics is unchanged.
    assert requests.get("http://127.0.0.1:%d/metrics" % master.http_port,
                        timeout=30).status_code == 200


def test_routing_query_reads_bodies_strictly(master):
    url = "http://127.0.0.1:%d/route" % master.http_port

    def post(raw):
        return requests.post(url, data=raw, timeout=30)

    plain = post(b'{"model_name":"m","token_ids":[1,2,3,4],"chunk_size":2}')
    assert plain.status_code == 200 and plain.json()["chunks"] == 2, plain.text
    # Escaped keys mean the same member; whitespace anywhere between tokens; unknown members
    # (nested within the limit) are ignored.
    same = post(b' {\n"model\\u005fname" : "m" ,\t"token\\u005fids":[ 1 ,2, 3,4 ] ,'
                b'"chunk_size":2, "x":{"y":[[{"z":null}]]}}\r\n')
    assert same.status_code == 200 and same.json() == plain.json(), same.text
    bad = [
        b'{"model_name":"m","token_ids":[1],"token_ids":[2]}',        # a member twice
        b'{"model_name":"m","model\\u005fname":"n","token_ids":[1]}',  # the same, escaped
        b'{"model_name":"m","token_ids":[1.0]}',
        b'{"model_name":"m","token_ids":[4294967296]}',
        b'{"model_name":"m","token_ids":[01]}',
        b'{"model_name":"m","token_ids":["1"]}',
        b'{"model_name":"m","token_ids":[1,]}',
        b'{"model_name":"m","token_ids":[1]} x',
        b'{"model_name":"m\xc3\x28","token_ids":[1]}',               # not UTF-8
        b'{"model_name":"m\\ud800","token_ids":[1]}',                # a lone surrogate
        b'{"model_name":"m","token_ids":[1],"x":' + b"[" * 40 + b"]" * 40 + b"}",
    ]
    for raw in bad:
        r = post(raw)
        assert r.status_code == 400, (raw, r.status_code, r.text)
        assert "error" in r.json()


def test_kv_events_stream(make_server, tmp_path):
    import msgpack
    import zmq

    port = free_port()
    s = make_server(args=["--chunk-size", str(CHUNK), "--kv-events-endpoint",
                          "tcp://127.0.0.1:%d" % port] +
                    ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(tmp_path)})])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 500)
    sub.bind("tcp://127.0.0.1:%d" % port)  # the server connects (no '*' in its endpoint)
    c = DPClient(s.zmq_port)
    events, seqs = [], []

    def drain():
        try:
            while True:
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"" and len(seq) == 8
                seqs.append(int.from_bytes(seq, "big"))
                ts, evs, dp_rank = msgpack.unpackb(payload, raw=False)
                assert isinstance(ts, float) and dp_rank == 0
                events.extend(evs)
        except zmq.Again:
            pass
        return events

    try:
        # PUB/SUB joins late: store until the subscriber sees events, then check the stream.
        want = []
        for i in range(50):
            want += store(c, 300 + i, chunks=1)
            if drain():
                break
        assert events, "no KV events arrived"
        # Connected now: a new prompt shows up on both media.
        fresh = store(c, 400, chunks=2)
        want += fresh

        def stored_on(medium):
            return {h.hex() for e in drain() if e["type"] == "BlockStored" and
                    e["medium"] == medium for h in e["block_hashes"]}
        assert wait_for(lambda: set(fresh) <= stored_on("CPU") and set(fresh) <= stored_on("FS"))
        stored = {}
        for ev in events:
            if ev["type"] == "BlockStored":
                assert ev["block_size"] == CHUNK and ev["parent_block_hash"] is None
                stored.setdefault(ev["medium"], set()).update(h.hex() for h in ev["block_hashes"])
        assert stored["CPU"] <= set(want) and stored["CPU"]
        assert stored["FS"] <= set(want)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # A clear publishes the removals of every L1 block.
        assert s.post("/cache/clear").status_code == 200
        removed = set()

        def got_removed():
            for ev in drain():
                if ev["type"] == "BlockRemoved" and ev["medium"] == "CPU":
                    removed.update(h.hex() for h in ev["block_hashes"])
            return stored["CPU"] <= removed
        assert wait_for(got_removed)
        assert "lmcache_mp_kv_events_batches_total" in s.get("/metrics").text
    finally:
        sub.close(0)
        ctx.term()


def test_route_demo_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(build_dir(), "python"),
                                                       os.path.join(ROOT, "python")]))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fleet", "route_demo.py"),
                        lmcache_bin()], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "routed to cache-b" in r.stdout


def test_removal_and_readmission_keep_their_order(master, make_server):
    s, c = fleet_server(make_server, master.addr, "node-o")
    for _ in range(20):
        h = store(c, 500)
        assert s.post("/cache/clear").status_code == 200
    # Ends removed: nothing left at the master once the queue is sent.
    assert wait_for(lambda: s.get("/status").json()["master"]["queue_depth"] == 0)
    assert wait_for(lambda: matches(master.addr, h) == {})
    assert s.get("/status").json()["master"]["tracked_hashes"] == 0
    # Stored again right after a clear: the admission is the last word.
    store(c, 500)
    assert s.post("/cache/clear").status_code == 200
    store(c, 500)
    assert wait_for(lambda: matches(master.addr, h) == {"node-o": {UMBPTierType.DRAM: set(h)}})
    assert wait_for(lambda: s.get("/status").json()["master"]["queue_depth"] == 0)
    assert matches(master.addr, h) == {"node-o": {UMBPTierType.DRAM: set(h)}}
    assert s.get("/status").json()["master"]["tracked_hashes"] == 2


def test_heartbeats_carry_capacities_for_the_least_loaded_pick(master, make_server):
    sa, ca = fleet_server(make_server, master.addr, "node-full", l1_size_gb=8 / 1024)
    sb, cb = fleet_server(make_server, master.addr, "node-empty", l1_size_gb=8 / 1024)
    blob = b"f" * (256 << 10)
    for i in range(20):  # 5 MiB of node-full's 8
        ca.call("store_bytes", model_name="m", token_ids=prompt(700 + i, 1), chunks=[blob])
    unknown = {"model_name": "m", "token_ids": prompt(999, 2), "chunk_size": CHUNK}
    # No node holds the prompt: the one with more room left is recommended once heartbeats
    # have told the master (capacities at registration were equal).
    assert wait_for(lambda: master.route(**unknown).json()["recommended"]["node_id"] ==
                    "node-empty")
    text = requests.get("http://127.0.0.1:%d/metrics" % master.http_port, timeout=30).text
    avail = [ln for ln in text.splitlines()
             if ln.startswith("mori_umbp_client_capacity_available_bytes") and "node-full" in ln]
    assert avail and float(avail[0].split()[-1]) <= 3 * (1 << 20) + (1 << 20)


def client_count(m):
    text = requests.get("http://127.0.0.1:%d/metrics" % m.http_port, timeout=30).text
    line = [ln for ln in text.splitlines() if ln.startswith("mori_umbp_client_count ")]
    return float(line[0].split()[1]) if line else None


def test_node_revived_after_expiry_reports_its_placements_again(make_server):
    # A server stalled past TTL x max_missed (SIGSTOP here; a VM stall or a long pause alike)
    # is expired and its placements wiped; its record is kept (retention), so its next
    # heartbeat revives it. The master then asks for a full sync, and the server sends one.
    m = Master(env={"LMCACHE_MASTER_EXPIRED_RETENTION_SEC": "300"})
    try:
        s, c = fleet_server(make_server, m.addr, "node-p")
        h = store(c, 21)
        assert wait_for(lambda: "node-p" in matches(m.addr, h))
        assert wait_for(lambda: client_count(m) == 1)
        os.kill(s.proc.pid, signal.SIGSTOP)
        try:
            assert wait_for(lambda: matches(m.addr, h) == {}, timeout=30)
            assert wait_for(lambda: client_count(m) == 0)
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: matches(m.addr, h) == {"node-p": {UMBPTierType.DRAM: set(h)}},
                        timeout=30)
        assert wait_for(lambda: client_count(m) == 1)
        assert wait_for(lambda: not s.get("/status").json()["master"]["full_sync_pending"])
        # Changes after the revival are reported as usual.
        h2 = store(c, 22)
        assert wait_for(lambda: "node-p" in matches(m.addr, h2))
    finally:
        m.stop()


def test_restart_with_a_new_address_replaces_the_old_record(make_server):
    # A server restarted (same --node-id, new --node-address: a new pod IP) while its previous
    # life is still ALIVE at the master replaces that record instead of adopting it: peers
    # get the new address, and SIGTERM unregisters the node.
    m = Master(env={"UMBP_HEARTBEAT_TTL_SEC": "10", "UMBP_MAX_MISSED_HEARTBEATS": "3"})

    def peers(h):
        return {x.node_id: x.peer_address for x in UMBPMasterClient(m.addr).match_external_kv(h)}

    def srv(addr):
        s = make_server(args=["--chunk-size", str(CHUNK), "--master-address", m.addr,
                              "--node-id", "node-x", "--node-address", addr])
        return s, DPClient(s.zmq_port)

    try:
        s1, c1 = srv("tcp://10.0.0.1:5555")
        h1 = store(c1, 31)
        assert wait_for(lambda: peers(h1) == {"node-x": "tcp://10.0.0.1:5555"})
        s1.proc.send_signal(signal.SIGKILL)
        s1.proc.wait()
        s1.proc.returncode = 0  # the fixture's clean-exit check does not apply
        s2, c2 = srv("tcp://10.0.0.2:5555")
        h2 = store(c2, 32)
        assert wait_for(lambda: peers(h2) == {"node-x": "tcp://10.0.0.2:5555"})
        assert peers(h1) == {}  # the first life's placements went with its record
        assert m.route(hashes=h2, chunk_size=CHUNK).json()["recommended"]["peer_address"] == \
            "tcp://10.0.0.2:5555"
        st = s2.get("/status").json()["master"]
        assert st["registered"] and st["connected"] and not st["full_sync_pending"]
        # SIGTERM unregisters: gone at once, not after the 30 s expiry.
        assert s2.stop() == 0
        assert wait_for(lambda: peers(h2) == {}, timeout=5)
        assert wait_for(lambda: client_count(m) == 0, timeout=5)
    finally:
        m.stop()
