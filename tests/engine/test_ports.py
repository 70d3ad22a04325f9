"""free_port draws outside the kernel's ephemeral range, which outgoing connections take their
local ports from: a port picked there was taken by one of Ray's connections before `pdserve up`'s
gRPC server bound it (CI: "the gRPC server could not bind 127.0.0.1:37223")."""

import socket

from cluster.engine.distributed.ports import RAY_WORKER_PORTS_END, ephemeral_range, free_port


def test_free_port_is_below_the_ephemeral_range_and_above_rays_worker_ports():
    low, _ = ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert all(RAY_WORKER_PORTS_END <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # drawn at random, not one fixed port every caller collides on
    port = ports.pop()
    with socket.socket() as s:  # and it is free: a server can bind it
        s.bind(("127.0.0.1", port))
        s.listen()


def test_ephemeral_range_reads_the_kernels_setting(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "absent")) == (49152, 65535)
