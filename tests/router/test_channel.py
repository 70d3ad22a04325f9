"""The router's channel without Ray (router/channel.py): frames and their size limit, route and
price answered over a socket as the router answers them, the token, and the router's lock."""

import asyncio
import random
import socket
import threading

import pytest

from cluster.engine.kv_cache import hash_request_blocks
from router.channel import (HEADER, HELLO_BYTES, MAX_FRAME_BYTES, ChannelServer, FrameReader, FrameTooLarge,
                            RouterChannel, frame, locked)
from router.policy import NoReplicaError, PolicyConfig, ReplicaLoad, RoutingPolicy
from router.router import Router

BS = 16
SYSTEM = list(range(64))


def router() -> Router:
    r = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(7)))
    r.index.resync("p-a", "i1", 0, hash_request_blocks(SYSTEM, BS, b"m"))
    for rid, pool in (("p-a", "prefill"), ("p-b", "prefill"), ("d-0", "decode")):
        r.report_load(ReplicaLoad(rid, pool, 1000, 1000, 0, 0, 0, 0.01, group="g"))
    return r


def test_a_frame_over_the_limit_is_refused_naming_its_size_and_the_limit():
    reader = FrameReader(limit=100)
    assert reader.feed(frame(b"x" * 90)) == [b"x" * 90]  # 92 bytes of msgpack: under the limit
    with pytest.raises(FrameTooLarge) as e:
        reader.feed(HEADER.pack(101) + b"y")  # refused on its header, before its body arrives
    assert str(e.value) == "router channel: a frame of 101 bytes is over the limit of 100 bytes"
    assert (MAX_FRAME_BYTES, HELLO_BYTES) == (4 << 20, 64)


def test_a_streams_first_frame_has_a_limit_of_its_own():
    reader = FrameReader(limit=100, first_limit=20)
    assert reader.feed(frame(b"t" * 16) + frame(b"x" * 90)) == [b"t" * 16, b"x" * 90]  # 18 bytes, then 92
    with pytest.raises(FrameTooLarge) as e:
        FrameReader(limit=100, first_limit=20).feed(frame(b"t" * 19))
    assert str(e.value) == "router channel: a frame of 21 bytes is over the limit of 20 bytes"


def test_frames_cut_anywhere_are_read_whole_and_in_order():
    data = b"".join(frame([i, "route", [[b"\x00" * 16] * i, i * 16, None, "g", None, None]]) for i in range(5))
    reader = FrameReader()
    got = [f for i in range(len(data)) for f in reader.feed(data[i:i + 1])]
    assert [f[0] for f in got] == [0, 1, 2, 3, 4] and got[3][2][0] == [b"\x00" * 16] * 3


@pytest.fixture
def served():
    server = ChannelServer(router(), "127.0.0.1", "node-a")
    yield server
    server.close()


async def connected(address: dict, node: str) -> RouterChannel:
    channel = RouterChannel(None, node_id=node)
    await channel.connect(address)
    return channel


@pytest.mark.parametrize("node", ["node-a", "node-b"])  # the same node: its Unix socket; another: TCP
def test_route_and_price_over_the_channel_answer_as_the_router_does(served, node):
    twin = router()  # the same state and seed, called directly
    prompt = hash_request_blocks(SYSTEM + [1] * 16, BS, b"m")

    async def calls():
        channel = await connected(served.address, node)
        price = await channel.call("price", [prompt, 80, None, "g", None])
        decision = await channel.call("route", [prompt, 80, "s1", "g", None, None])
        with pytest.raises(NoReplicaError) as e:
            await channel.call("route", [prompt, 80, None, "other-group", None, None])
        unknown = await channel.call("route", [prompt, 80, None, "other-group", 4, None])  # a cell's: EMPTY
        return channel, price, decision, str(e.value), unknown

    channel, price, decision, error, unknown = asyncio.run(calls())
    assert price == twin.price(prompt, 80, None, "g") and decision == twin.route(prompt, 80, "s1", "g")
    assert (decision.prefill, decision.predicted_cached_tokens) == ("p-a", 64)
    assert error == "no decode replica" and unknown == "empty"
    assert served.calls == 4 and channel.connects == 1
    transport = channel.proto.transport
    assert isinstance(transport.get_extra_info("peername"), str if node == "node-a" else tuple)


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    return s


def test_the_router_closes_a_connection_without_its_token_or_with_a_frame_over_the_limit(served):
    with raw(served.path) as s:
        s.sendall(frame(b"not the token") + frame([1, "route", [[], 0, None, None, None, None]]))
        assert s.recv(100) == b""  # closed, unanswered
    with raw(served.path) as s:
        s.sendall(frame(served.token) + HEADER.pack(MAX_FRAME_BYTES + 1))
        assert s.recv(100) == b""
    with raw(served.path) as s:  # a first frame past HELLO_BYTES: nothing more is buffered
        s.sendall(HEADER.pack(HELLO_BYTES + 1))
        assert s.recv(100) == b""
    with raw(served.path) as s:
        s.sendall(frame(served.token) + frame([9, "stats", []]))  # only route and price are on the channel
        (n,) = HEADER.unpack(s.recv(4))
        assert FrameReader().feed(HEADER.pack(n) + s.recv(n)) == [
            [9, 2, ["ValueError", "method 'stats' is not on the router's channel (only ['price', 'route'])"]]]
    assert served.calls == 0


def test_a_closed_router_end_drops_the_ingress_connection(served):
    async def run():
        channel = await connected(served.address, "node-a")
        lost = asyncio.get_running_loop().create_future()
        proto = channel.proto
        proto.connection_lost = lambda exc, f=proto.connection_lost: (f(exc), lost.set_result(True))
        served.close()
        await asyncio.wait_for(lost, 10)
        return channel

    assert asyncio.run(run()).proto is None  # the next call looks the address up again


def test_every_public_method_of_a_locked_router_holds_its_lock():
    @locked
    class Locked(Router):
        def __init__(self):
            self._lock = threading.RLock()
            super().__init__()

    r = Locked()
    public = {n for n in dir(Router) if not n.startswith("_") and callable(getattr(Router, n))}
    assert {n for n in public if hasattr(getattr(Locked, n), "__wrapped__")} == public
    done = threading.Event()
    with r._lock:
        t = threading.Thread(target=lambda: (r.stats(), done.set()))
        t.start()
        assert not done.wait(0.2)  # stats waits for the lock
    t.join(10)
    assert done.is_set()


class FixedAddress:
    """What a channel asks its router's ref (`channel_address.remote()`), answering one address."""

    name = "a router"

    def __init__(self, address: dict):
        self.address, self.channel_address = address, self

    async def remote(self) -> dict:
        return self.address


def test_a_failed_connect_is_tried_again_later_each_time_until_one_holds(served):
    with socket.socket() as s:  # a port nothing listens on: the connect is refused
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    ref = FixedAddress(dict(served.address, port=closed))

    async def attempt(channel) -> bool:
        channel.retry_at = 0.0  # due now
        assert not channel.usable()  # the call goes by Ray; a connect starts
        await channel.connecting
        return channel.usable()

    async def run():
        channel = RouterChannel(ref, node_id="node-b")  # another node: TCP
        refused = [(await attempt(channel), channel.retry_s) for _ in range(6)]
        ref.address = served.address  # the router's real address (as after its restart)
        return refused, await attempt(channel), channel.retry_s, channel.connects

    refused, up, retry_s, connects = asyncio.run(run())
    assert refused == [(False, 2.0), (False, 4.0), (False, 8.0), (False, 16.0), (False, 30.0), (False, 30.0)]
    assert (up, retry_s, connects) == (True, 1.0, 1)
