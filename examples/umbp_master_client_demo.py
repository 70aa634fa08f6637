#!/usr/bin/env python3
"""Starts `lmcache master` (or $UMBP_MASTER_BIN) on free loopback ports, runs a multi-tier
report / match / revoke scenario with the umbp Python client, and shuts the master down.

    PYTHONPATH=build/python /usr/bin/python3 examples/umbp_master_client_demo.py
"""

import os
import signal
import socket
import subprocess
import sys
import time

from umbp import UMBPMasterClient, UMBPTierType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_1GB = 1 << 30


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master():
    port, mport = free_port(), free_port()
    binary = os.environ.get("UMBP_MASTER_BIN") or os.path.join(ROOT, "build", "umbp_master")
    env = dict(os.environ, LMCACHE_MASTER_METRICS_HOST="127.0.0.1")
    proc = subprocess.Popen([binary, "127.0.0.1:%d" % port, str(mport)], env=env)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, "127.0.0.1:%d" % port
        except OSError:
            if proc.poll() is not None:
                sys.exit("master exited with %s" % proc.returncode)
            time.sleep(0.05)
    proc.kill()
    sys.exit("master did not start")


def stop_master(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def main():
    proc, addr = start_master()
    clients = []
    try:
        def node(name, tier):
            c = UMBPMasterClient(addr, node_id=name, node_address=name + ":8080")
            c.register_self({tier: (8 << 20, 8 << 20)})
            clients.append(c)
            return c

        # 1. One node, five hashes on DRAM.
        a = node("node-a", UMBPTierType.DRAM)
        five = ["demo-a-%d" % i for i in range(5)]
        a.report_external_kv_blocks("node-a", five, UMBPTierType.DRAM)
        (m,) = a.match_external_kv(five)
        assert m.node_id == "node-a" and m.hashes_by_tier == {UMBPTierType.DRAM: five}
        print("scenario 1:", m)

        # 2. Two nodes share four hashes on different tiers.
        shared = ["demo-shared-%d" % i for i in range(4)]
        node("node-b", UMBPTierType.DRAM).report_external_kv_blocks(
            "node-b", shared, UMBPTierType.DRAM)
        node("node-c", UMBPTierType.HBM).report_external_kv_blocks(
            "node-c", shared, UMBPTierType.HBM)
        got = {m.node_id: list(m.hashes_by_tier) for m in a.match_external_kv(shared)}
        assert got == {"node-b": [UMBPTierType.DRAM], "node-c": [UMBPTierType.HBM]}, got
        print("scenario 2:", got)

        # 3. Report six, revoke three.
        d = node("node-d", UMBPTierType.DRAM)
        six = ["demo-d-%d" % i for i in range(6)]
        d.report_external_kv_blocks("node-d", six, UMBPTierType.DRAM)
        d.revoke_external_kv_blocks("node-d", six[:3], UMBPTierType.DRAM)
        (m,) = d.match_external_kv(six)
        assert m.hashes_by_tier[UMBPTierType.DRAM] == six[3:]
        print("scenario 3:", m.hashes_by_tier)

        # 4. An unregistered query-only client asks for unknown hashes.
        assert UMBPMasterClient(addr).match_external_kv(["nope-1", "nope-2"]) == []
        print("scenario 4: []")
        print("all scenarios passed")
    finally:
        for c in clients:
            c.unregister_self()
            c.close()
        rc = stop_master(proc)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
