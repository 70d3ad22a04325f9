"""A TCP port to hand to a server that binds it later (a test's gRPC port, `plan --validate`'s). A
tensor-parallel group's rendezvous binds port 0 and publishes what it got (launch.host_rendezvous):
nothing can take a port held from the moment it is known.

A port the kernel just gave to a probe socket (bind to port 0) lies in its ephemeral range
(`net.ipv4.ip_local_port_range`, 32768-60999 by default), the same range it draws every outgoing
connection's local port from. Between the probe and the server's bind, seconds here, a busy Ray
node opens hundreds of connections (workers, the GCS, Serve's controller and proxies), and one of
them can take the port: the server then fails to bind. CI met it: an ingress's gRPC server could not
bind 127.0.0.1:37223, picked that way ~10 s earlier. So the port is drawn below the ephemeral range
and above Ray's worker ports (10002-19999 by default), where no connection is ever auto-bound, and
probed free now. Only another process that binds explicitly can still take it."""

from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS_END = 20000  # Ray's default max_worker_port is 19999
ATTEMPTS = 200


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):  # not Linux: IANA's dynamic range
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now and outside the range outgoing connections draw from
    (falling back to the kernel's choice when that range leaves no room below it)."""
    low, _ = ephemeral_range()
    if low - RAY_WORKER_PORTS_END >= 1000:
        rng = random.Random()
        for _ in range(ATTEMPTS):
            port = rng.randrange(RAY_WORKER_PORTS_END, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
