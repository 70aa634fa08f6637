"""Loopback helpers shared by the integration tests and their harnesses (standard library only,
so scripts that run a harness directly can import it too)."""
import random
import socket
import time

_rng = random.Random()
_given = set()  # ports this process handed out: never handed out twice


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range
    (32768 and up here): the outgoing connections of the tests and of everything else on the
    machine take their local ports from that range and would race a port picked there. Never
    one this process was given before: two ports asked for in a row (a server's HTTP and data
    ports) were sometimes the same one, and the second bind then failed."""
    for _ in range(200):
        port = _rng.randrange(20000, 32700)
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _given.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, what="process", timeout=20.0):
    """Waits until 127.0.0.1:port accepts connections; raises RuntimeError when proc exits first
    or the port is still closed after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("%s exited early with %s" % (what, proc.returncode))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("%s did not listen on %d" % (what, port))
