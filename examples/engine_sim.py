#!/usr/bin/env python3
"""A simulated inference engine in front of `lmcache server`: the smallest real picture of what
the cache is for.

It serves a stream of prompts that share prefixes (a few system prompts, repeated questions,
conversations that grow turn by turn). For each prompt it hashes the full chunks, looks them up,
retrieves the cached leading chunks into its paged KV cache (shared memory), "computes" the rest
by filling deterministic KV (a function of the chunk's prefix hash, as real KV is a function of
the prefix), and stores what it computed. Every retrieved byte is compared with the KV the engine
would have computed. It prints the hit rate and the KV bytes reused per second.

    PYTHONPATH=build/python examples/engine_sim.py --endpoint tcp://127.0.0.1:5555 --seconds 10

Exit status 1 if any retrieved byte was wrong.
"""
import argparse
import os
import sys
import time

import numpy as np

try:
    import lmcache_client as lc
except ImportError:  # run from a source checkout without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import lmcache_client as lc


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="server data socket")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to serve prompts")
    p.add_argument("--max-prompts", type=int, default=0, help="stop after this many (0: none)")
    p.add_argument("--model", default="engine-sim")
    p.add_argument("--instance-id", type=int, default=4242)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--block-order", default="layer_major", choices=["layer_major", "block_major"])
    p.add_argument("--system-prompts", type=int, default=4, help="shared prefixes")
    p.add_argument("--system-chunks", type=int, default=4, help="chunks of each shared prefix")
    p.add_argument("--max-question-chunks", type=int, default=3,
                   help="chunks of a question after the prefix (at most)")
    p.add_argument("--hash-seed", default="", help="the server's --hash-seed")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: random)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    return p.parse_args()


class Workload:
    """Prompts with shared prefixes: a system prompt, then a new question (40%), a question asked
    before (30%), or the next turn of an earlier conversation (30%). Each prompt ends with a
    partial chunk of tokens (never cached: only full chunks are)."""

    def __init__(self, a, chunk, rng):
        self.a, self.chunk, self.rng = a, chunk, rng
        self.systems = [self.tokens(a.system_chunks * chunk) for _ in range(a.system_prompts)]
        self.seen = []
        self.max_chunks = a.system_chunks + 2 * a.max_question_chunks + 1

    def tokens(self, n):
        return self.rng.integers(0, 128000, n, dtype=np.uint32)

    def next(self):
        r = self.rng.random()
        if self.seen and r < 0.3:
            base = self.seen[self.rng.integers(len(self.seen))]
        elif self.seen and r < 0.6:
            prev = self.seen[self.rng.integers(len(self.seen))]
            room = self.max_chunks * self.chunk - len(prev)
            more = min(room, int(self.rng.integers(1, self.a.max_question_chunks + 1)) * self.chunk)
            base = np.concatenate([prev, self.tokens(max(more, 0))])
        else:
            q = int(self.rng.integers(1, self.a.max_question_chunks + 1)) * self.chunk
            base = np.concatenate([self.systems[self.rng.integers(len(self.systems))],
                                   self.tokens(q)])
        base = base[:self.max_chunks * self.chunk]
        if len(self.seen) < 256:
            self.seen.append(base)
        else:
            self.seen[self.rng.integers(256)] = base
        tail = self.tokens(int(self.rng.integers(0, self.chunk)))
        return np.concatenate([base, tail])


def main():
    a = parse_args()
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    client = lc.Client(a.endpoint, timeout=a.timeout)
    chunk = client.chunk_size
    bpt = a.kv_heads * a.head_dim * a.dtype_bytes
    if chunk % a.tokens_per_block:
        sys.exit(f"chunk size {chunk} is not a multiple of --tokens-per-block {a.tokens_per_block}")
    bpc = chunk // a.tokens_per_block
    wl = Workload(a, chunk, rng)
    # Two block sets: the store of one prompt runs while the next prompt uses the other set.
    per_set = wl.max_chunks * bpc
    layout = lc.KVLayout(num_layers=a.layers, num_blocks=2 * per_set,
                         tokens_per_block=a.tokens_per_block, bytes_per_token=bpt,
                         block_order=a.block_order, dtype={2: "bfloat16"}.get(a.dtype_bytes))
    obj = layout.chunk_object_bytes(chunk)
    kv = lc.KVCache(client, a.instance_id, a.model, layout, dtype=np.uint8)
    print(f"engine-sim: {a.endpoint}, chunk {chunk} tokens, {a.layers} layers x {a.kv_heads} KV "
          f"heads x {a.head_dim} x {a.dtype_bytes} bytes, {a.block_order}, chunk object "
          f"{obj / 1024:.0f} KiB, seed {seed}")

    def kv_of(h):
        """The KV the engine computes for the chunk whose prefix hash is h: [k, layer, token,
        bytes], the L1 object layout."""
        g = np.random.default_rng(int.from_bytes(h[:8], "little"))
        return np.frombuffer(g.bytes(obj), np.uint8).reshape(2, a.layers, chunk, bpt)

    sets = [np.arange(i * per_set, (i + 1) * per_set) for i in range(2)]
    in_flight = [None, None]  # the store still reading each block set
    prompts = tokens = partial = total = hits_sum = wrong = stored = skipped = 0
    last_ping = t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < a.seconds and (a.max_prompts <= 0 or prompts < a.max_prompts):
            s = prompts % 2
            if in_flight[s] is not None:
                r = in_flight[s].result()
                stored, skipped = stored + r.stored_chunks, skipped + r.skipped_chunks
                in_flight[s] = None
            blocks = sets[s]
            toks = wl.next()
            hashes = lc.chunk_hashes(toks, chunk, seed=a.hash_seed)
            n = len(hashes)
            rid = f"sim-{prompts}"
            hits = kv.lookup_wait(rid, chunk_hashes=hashes)
            kv.view[:, :, blocks[:n * bpc]] = 0xEE  # poison: an unwritten block cannot pass
            if hits:
                got = kv.retrieve(blocks[:hits * bpc], chunk_hashes=hashes, end=hits * chunk,
                                  request_id=rid).retrieved_chunks
                if got != hits:
                    print(f"prompt {prompts}: retrieved {got} of {hits} chunks", file=sys.stderr)
                    wrong += (hits - got) * obj
                for j in range(got):
                    have = kv.read_tokens(blocks[j * bpc:(j + 1) * bpc])
                    wrong += int(np.count_nonzero(have != kv_of(hashes[j])))
            client.send_end_session(rid)  # pipelined: its reply is collected on the way
            for j in range(hits, n):  # "prefill": compute the chunks the cache did not have
                kv.write_tokens(blocks[j * bpc:(j + 1) * bpc], kv_of(hashes[j]))
            if hits < n:
                in_flight[s] = kv.send_store(blocks[hits * bpc:n * bpc], chunk_hashes=hashes,
                                             start=hits * chunk)
            prompts += 1
            tokens += len(toks)
            partial += len(toks) - n * chunk
            total += n
            hits_sum += hits
            if time.monotonic() - last_ping > 10:
                kv.ping()
                last_ping = time.monotonic()
        for h in in_flight:
            if h is not None:
                r = h.result()
                stored, skipped = stored + r.stored_chunks, skipped + r.skipped_chunks
        client.wait_all()
        elapsed = time.monotonic() - t0
    finally:
        kv.close()
        client.close()
    reused = hits_sum * obj
    print(f"prompts: {prompts} ({tokens} tokens, {partial} in partial chunks that are never "
          f"cached) in {elapsed:.2f} s")
    print(f"hit chunks: {hits_sum} of {total} ({100.0 * hits_sum / max(total, 1):.1f}%); "
          f"computed and stored {stored}, skipped {skipped}")
    print(f"wrong bytes: {wrong}")
    print(f"reused: {reused / elapsed / 1e6:.1f} MB/s of KV ({reused / 2**20:.1f} MiB retrieved "
          f"instead of computed)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
