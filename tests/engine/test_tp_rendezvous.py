"""The tensor-parallel group's rendezvous holds its port from the moment any rank can learn it
(issue 52). It used to check that a port was free, hand it to the workers, and bind it later in
init_process_group: a process that bound the port in between (another replica's rendezvous, a
server drawing ports the same way) broke the group's start."""

from __future__ import annotations

import errno
import socket

import pytest

from cluster.engine.distributed import launch, ports, step
from cluster.engine.distributed.launch import LocalRanks, host_rendezvous
from cluster.engine.distributed.step import Stop


def test_the_rendezvous_port_is_bound_before_it_is_known():
    store, address = host_rendezvous("127.0.0.1", 2, timeout_s=5)
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == store.port > 0
    with socket.socket() as s, pytest.raises(OSError) as e:
        s.bind(("127.0.0.1", int(port)))  # held: nothing else can take it
    assert e.value.errno == errno.EADDRINUSE


@pytest.mark.timeout(60)
def test_a_process_that_binds_a_checked_free_port_does_not_break_the_group(monkeypatch):
    """Every port a free-port check hands out is bound by another process straight after the check
    (the old design's race, made certain): the group still forms and stops cleanly."""
    squatters = []

    def taken_after_the_check(host: str = "127.0.0.1") -> int:
        port = free_port(host)
        s = socket.socket()
        s.bind((host, port))
        s.listen()
        squatters.append(s)
        return port

    free_port = ports.free_port
    monkeypatch.setattr(ports, "free_port", taken_after_the_check)
    monkeypatch.setattr(launch, "free_port", taken_after_the_check, raising=False)
    try:
        ranks = LocalRanks.start(2, timeout_s=20)
        step.send(Stop())  # the worker waits for a spec; a Stop first ends it cleanly
        assert ranks.close() == [0]
    finally:
        for s in squatters:
            s.close()
