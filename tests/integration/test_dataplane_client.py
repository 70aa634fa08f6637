"""liblmcache-client against the real server: the smoke program (every operation through the
shared library), `lmcache bench server` in correctness and throughput modes with small layouts,
and the installed library (cmake --install, pkg-config) building the example of docs/client.md."""
import os
import re
import shutil
import signal
import subprocess

import pytest

from conftest import BIN, ROOT

BUILD = os.environ.get("LMCACHE_BUILD_DIR", os.path.dirname(BIN))
SMALL = ["--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--tokens-per-block", "16",
         "--prompt-tokens", "512"]


def run(argv, timeout=300, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def bench(s, *args):
    return run([BIN, "bench", "server", "--port", str(s.zmq_port), "--http-port",
                str(s.http_port)] + SMALL + list(args))


def test_smoke_program_every_operation(server):
    exe = os.path.join(BUILD, "lmcache_client_smoke")
    r = run([exe, "127.0.0.1", str(server.zmq_port)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK")
    assert "FAIL" not in r.stdout


def test_store_with_chunk_frames_that_times_out_gives_the_buffer_back(make_server):
    """The smoke program stops the server (SIGSTOP) under a 64 MiB store with chunk frames:
    the call times out, the client resets its connection to take the frames back from libzmq,
    the caller frees the buffer, and the store never reaches the server once it resumes."""
    s = make_server()
    exe = os.path.join(BUILD, "lmcache_client_smoke")
    try:
        r = run([exe, "127.0.0.1", str(s.zmq_port), "frames-reset", str(s.proc.pid)], timeout=120)
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   the timed-out store was never delivered" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("OK")


def test_large_store_requests_reuse_the_kept_buffer(make_server):
    """48 MiB store_bytes requests under glibc's default malloc (every such allocation a fresh
    mmap): with the client's kept buffers the later stores fault nothing in; with none kept each
    faults all 12,288 pages of its buffer again. Every stored byte reads back in both cases."""
    s = make_server(l1_size_gb="1")
    exe = os.path.join(BUILD, "lmcache_client_smoke")
    r = run([exe, "127.0.0.1", str(s.zmq_port), "keep-buffers"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   a kept buffer is not faulted in again" in r.stdout, r.stdout
    assert "ok   every stored byte reads back" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("OK")


class OldServer:
    """A stand-in for a server that predates reply_status: lookup answers {ok}, and the status
    comes from query_prefetch_status (pending twice, then ready). Records what it was sent."""

    def __init__(self):
        import threading
        import msgpack
        import zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seen = []
        self.stop = False

        def serve():
            queries = 0
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            while not self.stop:
                if not poller.poll(50):
                    continue
                ident, rid, op, payload = self.sock.recv_multipart()
                p = msgpack.unpackb(payload)
                self.seen.append((op.decode(), p))
                if op == b"lookup":
                    reply = {"ok": True}
                else:
                    queries += 1
                    reply = ({"ok": True, "ready": False} if queries < 3 else
                             {"ok": True, "ready": True, "hit_chunks": 3})
                self.sock.send_multipart([ident, rid, op, msgpack.packb(reply)])

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


def test_lookup_wait_against_a_server_without_reply_status():
    old = OldServer()
    try:
        exe = os.path.join(BUILD, "lmcache_client_smoke")
        r = run([exe, "127.0.0.1", str(old.port), "lookup-wait"], timeout=60)
        assert r.returncode == 0 and "hits 3" in r.stdout, r.stdout + r.stderr
        ops = [op for op, _ in old.seen]
        assert ops == ["lookup", "query_prefetch_status", "query_prefetch_status",
                       "query_prefetch_status"], ops
        assert old.seen[0][1]["reply_status"] is True
    finally:
        old.close()


def test_bench_correctness_passes(make_server):
    s = make_server(args=["--chunk-size", "128"])
    r = bench(s, "--prompts", "3", "--seed", "11")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("server match -> ok") == 3
    assert "PASSED: 3 prompts, 0 mismatches, 0 errors" in r.stdout


@pytest.mark.parametrize("extra", [["--block-order", "block_major"], ["--kv-count", "1"]])
def test_bench_correctness_other_layouts(make_server, extra):
    s = make_server()
    r = bench(s, "--prompts", "2", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASSED" in r.stdout


def test_bench_correctness_exits_1_on_mismatch(make_server):
    # Same seed twice: the second cold pass finds its prompts already cached.
    s = make_server()
    assert bench(s, "--prompts", "2", "--seed", "5").returncode == 0
    r = bench(s, "--prompts", "2", "--seed", "5", "--instance-base", "2000")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED: 2 prompts, 2 mismatches" in r.stdout


def test_bench_reports_a_server_that_is_not_there():
    r = run([BIN, "bench", "server", "--port", "9", "--timeout-ms", "300"] + SMALL)
    assert r.returncode == 1
    assert "timeout" in r.stderr


def test_bench_throughput_small(make_server):
    s = make_server(l1_size_gb="0.5")
    r = bench(s, "--mode", "throughput", "--clients", "2", "--prompts", "3", "--rounds", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("memcpy reference", "before", "store (shm)", "retrieve (shm)", "store_bytes",
                 "retrieve_bytes", "retrieve_frames"):
        assert line in r.stdout, r.stdout
    m = re.search(r"lookup latency .*?(\d+) samples\): p50 ([\d.]+) us", r.stdout)
    assert m and int(m.group(1)) == 2 * 3 * 2


def test_bench_usage():
    r = run([BIN, "bench", "server", "--help"])
    assert r.returncode == 0 and "--prompt-tokens" in r.stdout
    r = run([BIN, "bench", "server", "--no-such-flag"])
    assert r.returncode == 2
    r = run([BIN, "bench"])
    assert "server" in r.stderr and "l1" in r.stderr


def sanitizer_flags():
    """A sanitized build installs a sanitized library: the example must link the runtime too."""
    try:
        with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
            cache = f.read()
    except FileNotFoundError:
        return []
    if re.search(r"^LMCACHE_SANITIZE:BOOL=ON$", cache, re.M):
        return ["-fsanitize=address,undefined"]
    if re.search(r"^LMCACHE_TSAN:BOOL=ON$", cache, re.M):
        return ["-fsanitize=thread"]
    return []


def example_source():
    with open(os.path.join(ROOT, "docs", "client.md")) as f:
        text = f.read()
    blocks = re.findall(r"```c\n(.*?)```", text, re.S)
    return next(b for b in blocks if "int main" in b)


@pytest.mark.skipif(not shutil.which("pkg-config") or not shutil.which("cc"),
                    reason="needs pkg-config and a C compiler")
def test_installed_library_builds_the_docs_example(server, tmp_path):
    prefix = tmp_path / "prefix"
    r = run(["cmake", "--install", BUILD, "--prefix", str(prefix)])
    assert r.returncode == 0, r.stderr
    for f in ("include/lmcache/client.h", "lib/liblmcache-client.a", "lib/liblmcache-client.so",
              "lib/pkgconfig/lmcache-client.pc"):
        assert (prefix / f).exists(), f
    env = dict(os.environ, PKG_CONFIG_PATH=str(prefix / "lib" / "pkgconfig"))
    flags = run(["pkg-config", "--cflags", "--libs", "lmcache-client"], env=env)
    assert flags.returncode == 0, flags.stderr
    src = tmp_path / "example.c"
    src.write_text(example_source())
    exe = tmp_path / "example"
    r = run(["cc", "-std=c11", "-Wall", "-Werror", str(src), "-o", str(exe)]
            + flags.stdout.split() + ["-Wl,-rpath," + str(prefix / "lib")] + sanitizer_flags())
    assert r.returncode == 0, r.stderr
    r = run([str(exe), "127.0.0.1", str(server.zmq_port)], timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stored 2, skipped 0, hit 2, retrieved 2 chunks" in r.stdout


def test_bench_throughput_warmup_clears_first(make_server):
    s = make_server(l1_size_gb="0.5")
    r = bench(s, "--mode", "throughput", "--prompts", "2", "--rounds", "1", "--no-bytes",
              "--warmup")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warm-up: stored and cleared 4 objects" in r.stdout
    assert "store_bytes" not in r.stdout


def _faults(out, phase):
    m = re.search(re.escape(phase) + r" .*minor faults: (\d+) server / (\d+) client", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


@pytest.mark.skipif(bool(sanitizer_flags()),
                    reason="a sanitizer's allocator replaces glibc malloc and its set-up")
def test_large_messages_reuse_server_memory(make_server):
    # 36 MiB objects, one per prompt: every retrieve_bytes reply and store_bytes request is one
    # allocation above glibc's mmap threshold. With the data plane's malloc set-up the server
    # reuses freed memory; before it, each reply cost one page fault per 4 KiB (36 MiB: 9216).
    # The heap may still grow once in the phase (a reply a few bytes larger than the chunk the
    # store_frames phase before it freed): at most one reply's pages, not one per reply.
    s = make_server(l1_size_gb="0.5")
    r = bench(s, "--mode", "throughput", "--layers", "36", "--kv-heads", "8", "--head-dim", "128",
              "--prompt-tokens", "256", "--prompts", "2", "--rounds", "4",
              "--lookup-samples", "0", "--server-pid", str(s.proc.pid))
    assert r.returncode == 0, r.stdout + r.stderr
    server, _ = _faults(r.stdout, "retrieve_bytes")
    assert server < 9216 + 2000, r.stdout  # 8 replies of 36 MiB: 73728 faults without the reuse
    server, _ = _faults(r.stdout, "retrieve (shm)")
    assert server < 2000, r.stdout  # the registration mapped the shared memory in (MAP_POPULATE)


def test_bench_prints_lookup_latency_and_faults(make_server):
    s = make_server(l1_size_gb="0.5")
    r = bench(s, "--mode", "throughput", "--prompts", "1", "--rounds", "1", "--no-bytes",
              "--lookup-samples", "20", "--server-pid", str(s.proc.pid))
    assert r.returncode == 0, r.stdout + r.stderr
    for what in (r"lookup   4 chunks by token_ids ", r"lookup 128 chunks by token_ids ",
                 r"lookup 128 chunks by chunk_hashes"):
        assert re.search(what + r".*20 samples\): p50 [\d.]+ us, p90 [\d.]+ us, p99 [\d.]+ us",
                         r.stdout), r.stdout
    _faults(r.stdout, "store (shm)")


def test_bench_echo_over_tcp_and_ipc_in_every_shape():
    for ep in ("tcp", "ipc"):
        for shape in ("echo", "send", "fetch"):
            r = run([BIN, "bench", "server", "--mode", "echo", "--echo-mib", "1", "--rounds", "1",
                     "--echo-endpoint", ep, "--echo-shape", shape])
            assert r.returncode == 0, r.stdout + r.stderr
            assert re.search(r"zmq %s .* GB/s\s+\(\d+ round trips of 1 MiB over %s" % (shape, ep),
                             r.stdout), r.stdout
    r = run([BIN, "bench", "server", "--mode", "echo", "--echo-shape", "sideways"])
    assert r.returncode == 2 and "--echo-shape must be" in r.stderr, r.stdout + r.stderr
