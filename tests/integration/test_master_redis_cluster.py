

def test_redis_cli_reshard_while_matching(cluster):
    """Every slot of one master moved to another by `redis-cli --cluster reshard` while
    clients keep matching (with hits) and reporting: every answer complete and right."""
    import threading
    env = redis_cluster_env("live", cluster)
    with Master(env=env) as m:
        keys = ["r%d" % i for i in range(90)]
        c, s, tags = populate(m, cluster, "live", keys)
        tag, slot, src = apart(cluster, "live", tags)
        dst = next(n for n in cluster.nodes if n.port != src.port)
        nslots = sum(int(hi or lo) - int(lo) + 1
                     for line in src.cli("CLUSTER", "NODES").splitlines()
                     if line.split()[0] == src.cli("CLUSTER", "MYID")
                     for lo, _, hi in (r.partition("-") for r in line.split()[8:]))
        stop, bad, done = threading.Event(), [], [0]

        def load():
            cl = UMBPMasterClient(m.addr)
            while not stop.is_set():
                try:
                    got = sorted(h for x in cl.match_external_kv(keys, count_as_hit=True)
                                 for h in x.hashes_by_tier.get(UMBPTierType.DRAM, []))
                    if got != sorted(keys):
                        bad.append(len(got))
                    done[0] += 1
                except grpc.RpcError as e:
                    bad.append(e.details())

        t = threading.Thread(target=load)
        t.start()
        try:
            r = subprocess.run(["redis-cli", "--cluster", "reshard", "127.0.0.1:%d" % src.port,
                                "--cluster-from", src.cli("CLUSTER", "MYID"),
                                "--cluster-to", dst.cli("CLUSTER", "MYID"),
                                "--cluster-slots", str(nslots), "--cluster-yes"],
                               capture_output=True, text=True, timeout=300)
        finally:
            stop.set()
            t.join()
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert cluster.owner(slot).port == dst.port
        assert done[0] > 0 and bad == []
        assert dram(c, keys) == sorted(keys)
        n = {e.hash: e.hit_count_total for e in c.get_external_kv_hit_counts(keys)}
        assert n == {k: done[0] + 1 for k in keys}
        assert metric(m, "lmcache_master_redis_cluster_redirects_total",
                      backend="redis", kind="moved") >= 1
