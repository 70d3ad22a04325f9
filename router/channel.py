"""The route call on a channel of its own: the ingress asks a router `route` and `price` over one
persistent socket per router, not as Ray actor calls.

    ingress (the door's event loop)                    router process
    RouterRef.route.remote(...) ── frame ──▶ Unix socket (same node) / TCP ──▶ ChannelServer thread
                                ◀── frame ──                                   (Router under its lock)

Why: a Ray actor call's reply comes back on Ray's C++ threads, which call Python to complete the
future and wake the caller's loop from another thread (docs/benchmarks.md, "The front door's
wake-ups"). Here the reply is a socket read on the door's own loop, woken by its own epoll.

**Frames.** A 4-byte big-endian length, then that many bytes of msgpack (no pickle: nothing a peer
sends is run). The first frame of a connection is the token the router published (`hello`); a
connection that sends another is closed. A call is `[id, method, args]` (args positional, the
method's parameters in order); a reply `[id, kind, value]` (DECISION: a RouteDecision's fields,
VALUE: a string (EMPTY, HOT) or a price, ERROR: the exception's class name and message). Every frame
either side reads is at most MAX_FRAME_BYTES, a connection's first HELLO_BYTES (FrameTooLarge names
the size and the limit, and the reader closes the connection); a call whose frame would be larger
goes as a Ray call.

**Who runs a call.** The router is a sync Ray actor (one task at a time on Ray's thread); the
channel's calls run on the server's own thread, so every public method of the router holds one
lock (`locked`), whichever thread calls it: the router's state is never touched by two at once.

**Failures.** Anything wrong with the channel (no address yet, connect refused, the router
restarted at a new address, the connection lost mid-call, a frame too large) sends the call as the
Ray call it was before (the flow's `route_timeout_s` bounds both, and its fallback to route memory
is unchanged); the address is looked up again (a Ray call, off the request path) at once after a
lost connection, and after a failed connect at most once a RETRY_S, doubled while connects keep
failing (up to MAX_RETRY_S: a router whose port a firewall drops costs a lookup a half minute).
Only `route` and `price` use the channel: replicas' feeds and every other call stay Ray calls."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import inspect
import itertools
import logging
import os
import secrets
import shutil
import struct
import tempfile
import threading
import time
from typing import Any

import msgpack

from router.policy import NoReplicaError, RouteDecision

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 4 << 20  # a route call of ~230,000 blocks (16-byte hashes); larger ones go by Ray
HELLO_BYTES = 64  # a connection's first frame (the token: 18 bytes): no peer without it gets more buffered
HEADER = struct.Struct(">I")
CONNECT_TIMEOUT_S = 2.0  # the address lookup and the connect, each (off the request path)
RETRY_S = 1.0  # after a failed connect, calls go by Ray this long before the address is looked up again,
MAX_RETRY_S = 30.0  # doubled after each failure in a row, up to this

# the methods on the channel, with their parameters in order (what a call's positional args are)
METHODS = {"route": ("hashes", "num_prompt_tokens", "session", "group", "spill_at", "carried"),
           "price": ("hashes", "num_prompt_tokens", "session", "group", "carried")}
DECISION, VALUE, ERROR = 0, 1, 2
_FIELDS = tuple(f.name for f in dataclasses.fields(RouteDecision))


class FrameTooLarge(ValueError):
    pass


class ChannelDown(ConnectionError):
    """The channel cannot carry this call (the caller sends it as a Ray call)."""


class RouterCallError(RuntimeError):
    """The router raised an error other than NoReplicaError on a channel call."""


def frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into decoded frames; raises FrameTooLarge for a length over `limit`
    (`first_limit` for the stream's first frame), before reading its body."""

    def __init__(self, limit: int = MAX_FRAME_BYTES, first_limit: int | None = None):
        self.limit = limit
        self._next_limit = limit if first_limit is None else first_limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        buf = self._buf
        buf += data
        out, at = [], 0
        while len(buf) - at >= 4:
            (n,) = HEADER.unpack_from(buf, at)
            limit = self._next_limit
            if n > limit:
                raise FrameTooLarge(f"router channel: a frame of {n} bytes is over the limit of {limit} bytes")
            if len(buf) - at - 4 < n:
                break
            self._next_limit = self.limit
            out.append(msgpack.unpackb(bytes(buf[at + 4:at + 4 + n]), raw=False, use_list=True))
            at += 4 + n
        del buf[:at]
        return out


def encode_result(call_id: int, result: Any) -> bytes:
    if isinstance(result, RouteDecision):
        return frame([call_id, DECISION, [getattr(result, f) for f in _FIELDS]])
    return frame([call_id, VALUE, result])


def decode_result(kind: int, value: Any) -> Any:
    if kind == DECISION:
        return RouteDecision(*value)
    if kind == VALUE:
        return value
    name, message = value
    if name == "NoReplicaError":
        raise NoReplicaError(message)
    raise RouterCallError(f"{name}: {message}")


def positional(method: str, args: tuple, kwargs: dict) -> list:
    """A channel call's args: `args` then each later parameter from `kwargs` (None when absent)."""
    params = METHODS[method]
    extra = set(kwargs) - set(params[len(args):])
    if extra or len(args) > len(params):
        raise TypeError(f"{method}() got unexpected arguments {sorted(extra) or args[len(params):]}")
    return [*args, *(kwargs.get(p) for p in params[len(args):])]


# ---- the router's side --------------------------------------------------------------------------

def _locked(fn):
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        with self._lock:
            return fn(self, *args, **kwargs)
    return call


def locked(cls):
    """`cls` (a Router) with every public method, its own and inherited, holding `self._lock` (a
    re-entrant lock its `__init__` creates first): a router that its channel's thread and Ray's
    task thread both call. A method calling another takes the lock again (re-entrant)."""
    names = {name for klass in cls.__mro__[:-1] for name, fn in vars(klass).items()
             if not name.startswith("_") and inspect.isfunction(fn)}
    for name in names:
        setattr(cls, name, _locked(getattr(cls, name)))
    return cls


class ChannelServer:
    """The router's end: a thread with its own event loop serving the channel on a Unix socket
    (in a fresh 0700 directory) and on TCP at this node's address. `router`: its methods are
    called from this thread (they must hold their own lock: `locked`). `calls`: channel calls served."""

    def __init__(self, router, host: str, node_id: str):
        self.router = router
        self.token = secrets.token_bytes(16)
        self.calls = 0
        self.connections: set = set()  # the transports open now
        sweep(DIR_PREFIX)
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        self.path = os.path.join(self._dir, "channel.sock")
        self.address: dict = {}
        self._host, self._node_id = host, node_id
        self._loop = _new_loop()
        ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ready,), name="pdserve-router-channel", daemon=True)
        self._thread.start()
        ready.wait(CONNECT_TIMEOUT_S * 5)
        if self._failure is not None:
            raise self._failure
        if not self.address:
            raise TimeoutError("the router's channel did not start")

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            unix = loop.run_until_complete(loop.create_unix_server(lambda: _ServerProtocol(self), self.path))
            os.chmod(self.path, 0o600)
            tcp = loop.run_until_complete(loop.create_server(lambda: _ServerProtocol(self), self._host, 0))
            self.servers = (unix, tcp)
            self.address = {"node": self._node_id, "unix": self.path, "host": self._host,
                            "port": tcp.sockets[0].getsockname()[1], "token": self.token}
        except BaseException as e:  # noqa: BLE001 — the actor method that started it raises it
            self._failure = e
        ready.set()
        if self._failure is None:
            loop.run_forever()
        loop.close()

    def call(self, method: str, args: list) -> Any:
        if method not in METHODS:
            raise ValueError(f"method {method!r} is not on the router's channel (only {sorted(METHODS)})")
        self.calls += 1
        return getattr(self.router, method)(*args)

    def close(self) -> None:
        """Stop serving: the listening sockets and every connection closed, the thread ended."""
        async def stop():
            for server in getattr(self, "servers", ()):
                server.close()
            for transport in list(self.connections):
                transport.abort()
            for _ in range(3):  # the closes complete over the loop's next turns
                await asyncio.sleep(0)
            self._loop.stop()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(stop()))
            self._thread.join(CONNECT_TIMEOUT_S)
        shutil.rmtree(self._dir, ignore_errors=True)


DIR_PREFIX = "pdserve-router-"


def sweep(prefix: str) -> None:
    """Remove the socket directories named `prefix`PID- whose process is gone (killed: none removed its own)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(prefix):].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # noqa: PLC0415 — Ray's and Serve's loops are uvloop where it is installed

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class _FramedProtocol(asyncio.Protocol):
    """Either end of a connection: bytes in, decoded frames to `frames_received`; a stream that
    cannot be read on (a frame over its limit, not msgpack) is closed."""

    def __init__(self, reader: FrameReader):
        self.reader = reader
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except Exception as e:  # noqa: BLE001 — too large, or not msgpack
            log.warning("router channel: closing a connection: %s", e)
            self.transport.close()
            return
        self.frames_received(frames)

    def frames_received(self, frames: list) -> None:
        raise NotImplementedError


class _ServerProtocol(_FramedProtocol):
    def __init__(self, server: ChannelServer):
        super().__init__(FrameReader(first_limit=HELLO_BYTES))
        self.server = server
        self.authed = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.server.connections.add(transport)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self.transport)

    def frames_received(self, frames: list) -> None:
        for f in frames:
            if not self.authed:
                if not (isinstance(f, bytes) and hmac.compare_digest(f, self.server.token)):
                    log.warning("router channel: a connection without the router's token closed")
                    self.transport.close()
                    return
                self.authed = True
                continue
            self.transport.write(self._answer(f))

    def _answer(self, f) -> bytes:
        call_id = f[0] if isinstance(f, list) and f else 0
        try:
            _, method, args = f
            return encode_result(call_id, self.server.call(method, args))
        except Exception as e:  # noqa: BLE001 — the caller raises it (NoReplicaError by name)
            return frame([call_id, ERROR, [type(e).__name__, str(e)]])


# ---- the ingress's side -------------------------------------------------------------------------

class RouterChannel:
    """One router's channel from the ingress: connected in the background (the first calls go by
    Ray meanwhile) on the loop of the call that asked first; calls from any other loop go by Ray."""

    def __init__(self, ref, node_id=None):
        self.ref = ref  # the router's ActorRef: its `channel_address` gives the address
        self._node_id = node_id
        self.loop: asyncio.AbstractEventLoop | None = None
        self.proto: _ClientProtocol | None = None
        self.connecting: asyncio.Task | None = None
        self.retry_at = 0.0
        self.retry_s = RETRY_S
        self._ids = itertools.count(1)
        self.connects = 0  # connections made (1 while the first one holds)

    def usable(self) -> bool:
        """Connected, on this loop; else starts a connect (at most once a RETRY_S) and says no."""
        loop = asyncio.get_running_loop()
        if self.proto is not None and self.loop is loop:
            return True
        if self.loop is None:
            self.loop = loop
        if self.loop is loop and self.connecting is None and time.monotonic() >= self.retry_at:
            self.connecting = loop.create_task(self._connect())
        return False

    async def _connect(self) -> None:
        try:
            await self.connect(await asyncio.wait_for(self.ref.channel_address.remote(), CONNECT_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 — calls go by Ray meanwhile
            self.retry_at = time.monotonic() + self.retry_s
            log.log(logging.INFO if self.retry_s == RETRY_S else logging.DEBUG,
                    "router channel to %s: not connected (%r); calls go by Ray", self.ref.name, e)
            self.retry_s = min(2 * self.retry_s, MAX_RETRY_S)
        else:
            self.retry_s = RETRY_S
        finally:
            self.connecting = None

    async def connect(self, address: dict) -> None:
        """Connect to the router's channel at `address` (its `channel_address`), on this loop."""
        self.loop = asyncio.get_running_loop()
        self.proto = await self._open(address)
        self.connects += 1

    async def _open(self, address: dict) -> "_ClientProtocol":
        loop = asyncio.get_running_loop()
        if address["node"] == self._node():
            try:
                _, proto = await asyncio.wait_for(loop.create_unix_connection(
                    lambda: _ClientProtocol(self), address["unix"]), CONNECT_TIMEOUT_S)
                return proto.hello(address["token"])
            except OSError as e:  # another filesystem view (a container): TCP then
                log.info("router channel: %s unreachable (%r); TCP", address["unix"], e)
        _, proto = await asyncio.wait_for(loop.create_connection(
            lambda: _ClientProtocol(self), address["host"], address["port"]), CONNECT_TIMEOUT_S)
        return proto.hello(address["token"])

    def _node(self) -> str:
        if self._node_id is None:
            import ray  # noqa: PLC0415

            self._node_id = ray.get_runtime_context().get_node_id()
        return self._node_id

    async def call(self, method: str, args: list) -> Any:
        """The router's answer over the channel (ChannelDown: send it by Ray instead)."""
        proto = self.proto
        call_id = next(self._ids)
        data = frame([call_id, method, args])
        if len(data) - HEADER.size > MAX_FRAME_BYTES:
            raise ChannelDown(f"a {method} call of {len(data)} bytes is over the channel's frame limit")
        future = self.loop.create_future()
        proto.pending[call_id] = future
        proto.transport.write(data)
        try:
            kind, value = await future
        finally:
            proto.pending.pop(call_id, None)
        return decode_result(kind, value)

    def lost(self, proto: "_ClientProtocol") -> None:
        if self.proto is proto:
            self.proto = None  # the next call looks the address up again


class _ClientProtocol(_FramedProtocol):
    def __init__(self, channel: RouterChannel):
        super().__init__(FrameReader())
        self.channel = channel
        self.pending: dict[int, asyncio.Future] = {}

    def hello(self, token: bytes) -> "_ClientProtocol":
        self.transport.write(frame(token))
        return self

    def frames_received(self, frames: list) -> None:
        for call_id, kind, value in frames:
            future = self.pending.pop(call_id, None)
            if future is not None and not future.done():  # None: its caller gave up (timed out)
                future.set_result((kind, value))

    def connection_lost(self, exc) -> None:
        self.channel.lost(self)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ChannelDown(f"the router's channel closed ({exc!r})"))
        self.pending.clear()


class ChannelMethod:
    __slots__ = ("_ref", "_name")

    def __init__(self, ref, name: str):
        self._ref, self._name = ref, name

    def remote(self, *args, **kwargs):
        """An awaitable of the router's answer: over the channel when it is up, else a Ray call."""
        return self._ref.channel_call(self._name, args, kwargs)
