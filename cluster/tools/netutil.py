"""Small network helpers."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (for tests and benchmarks that start servers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
