#!/usr/bin/env python3
"""Throughput of the Python client (python/lmcache_client) through shared memory, phase for phase
what `lmcache bench server --mode throughput` measures with the C client: register a KV cache,
store every prompt (one `store` each), then rounds of lookups (`lookup_wait`) and retrieves under
the sessions' locks. GB/s are 10^9 bytes of KV per second of wall time of the phase. With
--bytes also store_bytes / retrieve_bytes (the KV inside the messages).

    PYTHONPATH=build/python examples/bench_py_client.py --endpoint tcp://127.0.0.1:5555

scripts/bench-py-client.sh runs it and the C benchmark against one server.
"""
import argparse
import os
import sys
import time

import numpy as np

try:
    import lmcache_client as lc
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import lmcache_client as lc


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--model", default="bench-model")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--block-order", default="layer_major", choices=["layer_major", "block_major"])
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--instance-id", type=int, default=2000)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--bytes", action="store_true", help="also store_bytes / retrieve_bytes")
    p.add_argument("--warmup", action="store_true",
                   help="untimed store pass then `clear` (empties L1!), as the C benchmark's")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--interleave-c", metavar="LIB",
                   help="also drive liblmcache-client (this .so, through ctypes) from the same "
                        "process and alternate its store/retrieve of each prompt with the Python "
                        "client's: both see the same load, the ratio is not skewed by drift")
    return p.parse_args()


def main():
    a = parse_args()
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    c = lc.Client(a.endpoint, timeout=a.timeout)
    chunk = c.chunk_size
    nchunks = a.prompt_tokens // chunk
    if nchunks < 1 or chunk % a.tokens_per_block:
        sys.exit("--prompt-tokens must hold a chunk, and the chunk a whole number of blocks")
    bpc = chunk // a.tokens_per_block
    bpp = nchunks * bpc
    layout = lc.KVLayout(num_layers=a.layers, num_blocks=a.prompts * bpp,
                         tokens_per_block=a.tokens_per_block,
                         bytes_per_token=a.kv_heads * a.head_dim * a.dtype_bytes,
                         block_order=a.block_order, dtype="bfloat16")
    obj = layout.chunk_object_bytes(chunk)
    print(f"python client: 1 client x {a.prompts} prompts x {nchunks} chunks of {chunk} tokens; "
          f"{a.layers} layers, {a.kv_heads} KV heads x {a.head_dim} dim x {a.dtype_bytes} bytes, "
          f"{a.tokens_per_block} tokens/block, {a.block_order}; chunk object "
          f"{obj / 2**20:.2f} MiB; seed {seed}")
    kv = lc.KVCache(c, a.instance_id, a.model, layout)
    try:
        m = 1 << 20  # random KV: a 1 MiB random block repeated over the region
        block = np.frombuffer(rng.bytes(m), np.uint8)
        full = kv.raw.size // m * m
        kv.raw[:full].reshape(-1, m)[:] = block
        kv.raw[full:] = block[:kv.raw.size - full]
        prompts = [rng.integers(0, 1 << 31, nchunks * chunk, dtype=np.uint32).tolist()
                   for _ in range(a.prompts)]
        blocks = [list(range(p * bpp, (p + 1) * bpp)) for p in range(a.prompts)]
        secs = {}
        nbytes = {}
        if a.warmup:  # the server's mapping of our blocks and L1's pages touched once
            for p in range(a.prompts):
                kv.store(blocks[p], token_ids=prompts[p], cache_salt="warmup")
            print(f"warm-up: stored and cleared {c.clear()} objects")

        t0 = time.perf_counter()
        n = 0
        for p in range(a.prompts):
            n += kv.store(blocks[p], token_ids=prompts[p]).stored_chunks
        secs["store (shm)"], nbytes["store (shm)"] = time.perf_counter() - t0, n * obj

        lat = []
        secs["retrieve (shm)"] = 0.0
        nbytes["retrieve (shm)"] = 0
        for r in range(a.rounds):
            for p in range(a.prompts):
                t1 = time.perf_counter()
                hits = kv.lookup_wait(f"py-{seed}-{p}", token_ids=prompts[p], poll_interval=2e-5)
                lat.append(time.perf_counter() - t1)
                if hits != nchunks:
                    sys.exit(f"lookup hit {hits} of {nchunks} chunks (is L1 large enough?)")
            t0 = time.perf_counter()
            for p in range(a.prompts):
                got = kv.retrieve(blocks[p], token_ids=prompts[p],
                                  request_id=f"py-{seed}-{p}").retrieved_chunks
                nbytes["retrieve (shm)"] += got * obj
            secs["retrieve (shm)"] += time.perf_counter() - t0
            for p in range(a.prompts):
                c.end_session(f"py-{seed}-{p}")

        if a.bytes:
            objs = [kv.read_tokens(blocks[0][j * bpc:(j + 1) * bpc]).tobytes()
                    for j in range(nchunks)]
            t0 = time.perf_counter()
            n = 0
            for p in range(a.prompts):
                n += c.store_bytes(a.model, objs, token_ids=prompts[p],
                                   cache_salt="b").stored_chunks
            secs["store_bytes"], nbytes["store_bytes"] = time.perf_counter() - t0, n * obj
            t0 = time.perf_counter()
            n = 0
            for r in range(a.rounds):
                for p in range(a.prompts):
                    n += sum(len(x) for x in c.retrieve_bytes(a.model, token_ids=prompts[p],
                                                              cache_salt="b").chunks)
            secs["retrieve_bytes"], nbytes["retrieve_bytes"] = time.perf_counter() - t0, n
        if a.interleave_c:
            ab = interleaved(a, c, kv, layout, prompts, blocks, bpp, seed)
    finally:
        kv.close()
        c.close()
    for name, s in secs.items():
        print(f"{name:<15} {nbytes[name] / s / 1e9:8.2f} GB/s  ({nbytes[name] / 2**30:.2f} GiB "
              f"in {s:.3f} s)")
    lat.sort()
    pct = lambda q: lat[min(len(lat) - 1, int(q / 100 * (len(lat) - 1) + 0.5))] * 1e6  # noqa
    print(f"lookup latency (lookup + query_prefetch_status until ready, {len(lat)} samples): "
          f"p50 {pct(50):.1f} us, p99 {pct(99):.1f} us")
    if a.interleave_c:
        for op in ("store", "retrieve"):
            py, cc = sorted(ab["py " + op]), sorted(ab["c " + op])
            med = lambda v: v[len(v) // 2]  # noqa
            print(f"interleaved {op:<8} (per prompt, {len(py)} each): Python median "
                  f"{nchunks * obj / med(py) / 1e9:.2f} GB/s, C median "
                  f"{nchunks * obj / med(cc) / 1e9:.2f} GB/s, Python/C {100 * med(cc) / med(py):.0f}%")
    return 0


def interleaved(a, c, kv, layout, prompts, blocks, bpp, seed):
    """Stores and retrieves each prompt through the Python client and through liblmcache-client
    (a second registration of the same shared memory, other keys), alternating which goes first;
    returns the seconds of every request."""
    import ctypes as C

    class Err(C.Structure):
        _fields_ = [("status", C.c_int), ("code", C.c_char * 32), ("message", C.c_char * 256)]

    class Chunks(C.Structure):
        _fields_ = [("token_ids", C.c_void_p), ("num_tokens", C.c_size_t),
                    ("chunk_hashes", C.c_void_p), ("num_chunk_hashes", C.c_size_t),
                    ("hash_len", C.c_size_t), ("start", C.c_int64), ("end", C.c_int64),
                    ("cache_salt", C.c_char_p)]

    class Layout(C.Structure):
        _fields_ = [("num_layers", C.c_uint32), ("num_blocks", C.c_uint32),
                    ("tokens_per_block", C.c_uint32), ("bytes_per_token", C.c_uint64),
                    ("kv_count", C.c_uint32), ("block_order", C.c_int), ("dtype", C.c_char_p)]

    class Reg(C.Structure):
        _fields_ = [("instance_id", C.c_int64), ("model_name", C.c_char_p),
                    ("world_size", C.c_int64), ("worker_id", C.c_int64),
                    ("shm_name", C.c_char_p), ("layout", Layout)]

    lib = C.CDLL(a.interleave_c)
    e, h = Err(), C.c_void_p()
    P64, U64 = C.POINTER(C.c_int64), C.c_uint64

    def check(rc, what):
        if rc != 0:
            sys.exit(f"C client: {what}: {e.code.decode()}: {e.message.decode()}")

    check(lib.lmc_client_connect_endpoint(a.endpoint.encode(), None, C.byref(h), C.byref(e)),
          "connect")
    lo = Layout(layout.num_layers, layout.num_blocks, layout.tokens_per_block,
                layout.bytes_per_token, layout.kv_count, int(layout.block_order != "layer_major"),
                b"bfloat16")
    reg = Reg(a.instance_id + 1, a.model.encode(), 1, 0, kv.shm_name.encode(), lo)
    check(lib.lmc_register_kv_cache_raw(h, C.byref(reg), C.byref(e)), "register_kv_cache")
    out = {"py store": [], "c store": [], "py retrieve": [], "c retrieve": []}
    try:
        for rnd in range(a.rounds):
            c.clear()
            for p in range(a.prompts):
                toks = {w: np.array(prompts[p], dtype=np.uint32) ^ np.uint32(1 + rnd * 2 + w)
                        for w in (0, 1)}  # fresh keys: 0 = Python, 1 = C
                ids = np.array(blocks[p], dtype=np.int64)
                order = (0, 1) if (p + rnd) % 2 else (1, 0)
                for op in ("store", "retrieve"):
                    for w in order:
                        t = time.perf_counter()
                        if w == 0 and op == "store":
                            ok = kv.store(ids, token_ids=toks[0]).stored_chunks
                        elif w == 0:
                            ok = kv.retrieve(ids, token_ids=toks[0]).retrieved_chunks
                        else:
                            ch = Chunks(toks[1].ctypes.data, len(toks[1]), None, 0, 0, 0, -1, None)
                            n, sk = U64(), U64()
                            if op == "store":
                                check(lib.lmc_store(h, C.c_int64(reg.instance_id), C.byref(ch),
                                                    ids.ctypes.data_as(P64), C.c_size_t(bpp),
                                                    C.byref(n), C.byref(sk), C.byref(e)), op)
                            else:
                                check(lib.lmc_retrieve(h, C.c_int64(reg.instance_id),
                                                       C.byref(ch), ids.ctypes.data_as(P64),
                                                       C.c_size_t(bpp), None, C.c_int64(0),
                                                       C.byref(n), C.byref(e)), op)
                            ok = n.value
                        dt = time.perf_counter() - t
                        if ok != len(toks[0]) // c.chunk_size:
                            sys.exit(f"interleaved {op}: {ok} chunks")
                        out[("py " if w == 0 else "c ") + op].append(dt)
    finally:
        lib.lmc_unregister_instance(h, C.c_int64(reg.instance_id), C.byref(e))
        lib.lmc_client_close(h)
    return out


if __name__ == "__main__":
    sys.exit(main())
