"""A decode leg's outputs on a socket of their own: the decode replica writes them to the ingress
that called it; Serve's call carries everything else.

    ingress (the door's loop)                                        decode replica (Serve's loop)
    generate.remote(..., reply_to=(address, call)) ── Serve's gRPC ──▶ EngineReplica.generate
    Mailbox(call) ◀── frame per output ── Unix socket (same node) / TCP ── ReplyLinks: one per ingress
    Mailbox       ◀── end of the call (or its error) ── Serve's gRPC ──

Why: each message of Serve's stream is a gRPC message read by Serve's handle (its request router,
its result wrapper, a pickle) and a task switch through a queue at the ingress, and as much again on
the replica (docs/benchmarks.md, "Outputs on a socket of their own"). Here a message is a msgpack
frame read on the door's own loop, and a replica's frames of one turn go in one write.

**What stays Serve's.** The call is still a Serve call on the pool's handle, open until the leg
ends: the replica it goes to (the router's target_replica), `max_ongoing_requests`, the handle's
autoscaling counts, cancellation (the ingress cancels the call; the replica's generator is closed
and the engine aborts the request) and a replica's death (the call raises; the leg migrates).

**Frames.** channel.py's (a 4-byte length, then msgpack; nothing a peer sends is run). A
connection's first frame is the inbox's token (given in the call's `reply_to`); then each frame is
one output: `[call, token_ids, finished, finish_reason, num_prompt_tokens, num_output_tokens,
num_cached_tokens, error, error_kind]`. A frame for a call the inbox does not hold (its leg ended)
is dropped. Only calls without logprobs use it (legs.py `by_reference`: those go by Ray as before).

**Falling back.** A replica without a connection to the caller's inbox yet (the first call from a
new ingress: the connect runs in the background) streams the leg's outputs on Serve's call as
before. A connection that closes mid-leg (either end), a frame over the limit, or an ingress that stops
reading (MAX_BUFFERED_BYTES unsent) sends the rest of the leg on Serve's call too: first, as an
output of its own, every token the leg sent as frames (which ones arrived, the replica cannot
know), and the mailbox drops from it the tokens it already has, and every frame after it. A call
that ends on Serve's side with no final output seen (the connection closed after the replica
wrote its last frame) waits for it LATE_FRAME_S after the last frame read on any connection (at
most LATE_FRAMES_MAX_S: a backlog draining), then fails the leg as a lost replica (RepliesLost:
it migrates). A frame that names a leg but does not decode fails that leg alone; one that is not
an output at all closes its connection (its replica's legs fall back)."""

from __future__ import annotations

import asyncio
import collections
import hmac
import itertools
import logging
import os
import secrets
import shutil
import tempfile
import time
from contextlib import aclosing
from typing import AsyncIterator

from cluster.engine.outputs import FAILED, FinishReason, RequestOutput, merge_outputs
from cluster.errors import ErrorKind
from router.channel import (CONNECT_TIMEOUT_S, HEADER, HELLO_BYTES, MAX_FRAME_BYTES, MAX_RETRY_S, RETRY_S,
                            FrameReader, _FramedProtocol, frame, sweep)

log = logging.getLogger(__name__)

DIR_PREFIX = "pdserve-replies-"
DRAIN_S = 5.0  # after a leg's final output: how long its Serve call may take to end before it is cancelled
LATE_FRAME_S = 2.0  # after Serve's call ended: how long its last frame may still take to arrive
LATE_FRAMES_MAX_S = 30.0  # ... and at most this long while other frames keep arriving (a backlog draining)
MAX_BUFFERED_BYTES = 16 << 20  # frames a replica holds for an ingress that stopped reading: past this, it falls back
FIELDS = 9
_REASONS = {r.value: r for r in FinishReason}
_KINDS = {k.value: k for k in ErrorKind}
_draining: set[asyncio.Task] = set()  # calls' ends read after their legs' final outputs


class RepliesLost(ConnectionError):
    """A leg's call ended without its final output arriving (the leg is lost, as with a dead replica)."""


def encode(call: int, out: RequestOutput) -> bytes:
    reason, kind = out.finish_reason, out.error_kind
    return frame([call, out.token_ids, out.finished, None if reason is None else reason.value,
                  out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, out.error,
                  None if kind is None else kind.value])


def decode(request_id: str, f: list) -> RequestOutput:
    """An output frame as the RequestOutput it was (ValueError or KeyError for one that is not)."""
    _, ids, finished, reason, prompt, produced, cached, error, kind = f
    if not (isinstance(ids, list) and all(type(t) is int for t in ids)):
        raise ValueError("an output frame's token_ids are not a list of ints")
    return RequestOutput(request_id, ids, "", bool(finished), None if reason is None else _REASONS[reason],
                         prompt, produced, cached, error, None if kind is None else _KINDS[kind])


# ---- the ingress's side -------------------------------------------------------------------------

class Mailbox:
    """One decode leg's outputs at the ingress: the frames its replica writes, and whatever Serve's
    call streams (a replica that fell back), merged while the consumer is busy (as relay.coalesce)."""

    __slots__ = ("inbox", "call", "rid", "reply_to", "items", "got", "on_serve", "serve_done", "error",
                 "waiter", "reader", "frames", "served", "closed")

    def __init__(self, inbox: "ReplyInbox", call: int, rid: str):
        self.inbox, self.call, self.rid = inbox, call, rid
        self.reply_to = (inbox.address, call)
        self.items: collections.deque[RequestOutput] = collections.deque()
        self.got = 0  # tokens taken from frames
        self.on_serve = False  # Serve's call streamed an output: frames are dropped from then on
        self.serve_done = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.reader: asyncio.Task | None = None
        self.frames = 0  # outputs that came as frames
        self.served = 0  # outputs that came on Serve's call
        self.closed = False

    def framed(self, out: RequestOutput) -> None:
        if self.on_serve:
            return
        self.frames += 1
        self.got += len(out.token_ids)
        self._put(out)

    def streamed(self, out: RequestOutput) -> None:
        self.served += 1
        if not self.on_serve:  # the first output on Serve's call carries the leg's tokens from its start
            self.on_serve = True
            if self.got:
                out.token_ids = out.token_ids[self.got:]
                if not out.token_ids and not out.finished:
                    return  # every one of them arrived as frames
        self._put(out)

    def fail(self, error: BaseException) -> None:
        """End the leg with `error` (after the outputs before it); its frames are dropped from now on."""
        self.on_serve = True
        self.error = self.error or error
        self._wake()

    def _put(self, out: RequestOutput) -> None:
        self.items.append(out)
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _read(self, replies) -> None:
        try:
            async for out in replies:
                self.streamed(out)
            self.serve_done = True
        except BaseException as e:  # noqa: BLE001 — raised to the consumer after the outputs before it
            if self.closed and isinstance(e, asyncio.CancelledError):
                raise  # close() cancelled it
            self.error = e
        finally:
            self._wake()

    async def _wait(self, timeout: float | None) -> bool:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            if timeout is None:
                await self.waiter
                return True
            await asyncio.wait_for(self.waiter, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self.waiter = None

    async def outputs(self, replies) -> AsyncIterator[RequestOutput]:
        """The leg's outputs in order (those that queued merged), until a final one; then Serve's
        call's end is read in the background (not cancelled: it is due next). Serve's call's
        error is raised after the outputs before it; leaving early cancels the call's reading."""
        items = self.items
        self.reader = asyncio.get_running_loop().create_task(self._read(replies))
        last_final, give_up = False, 0.0
        try:
            while True:
                if items:
                    out = items.popleft()
                    while items and not out.finished and items[0].finish_reason not in FAILED:
                        out = merge_outputs(out, items.popleft())
                    last_final = out.finished
                    yield out
                    if last_final:
                        return
                    continue
                if self.error is not None:
                    raise self.error
                if self.serve_done:  # its last frame may still be on the way, behind others
                    seen, loop = self.inbox.frames_in, asyncio.get_running_loop()
                    give_up = give_up or loop.time() + LATE_FRAMES_MAX_S
                    if not await self._wait(LATE_FRAME_S) and not items and (
                            self.inbox.frames_in == seen or loop.time() > give_up):
                        raise RepliesLost(f"decode call for {self.rid} ended without its final output")
                    continue
                await self._wait(None)
        finally:
            self.close(last_final)

    def close(self, finished: bool = False) -> None:
        """Done with: its frames are dropped from now on; Serve's call's reading is cancelled, or
        left to read the call's end (`finished`: the leg's final output was taken). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.inbox.boxes.pop(self.call, None)
        reader = self.reader
        if reader is not None and not reader.done():
            if finished:  # the call's end is due next: read it (at most DRAIN_S), not cancelled
                timer = asyncio.get_running_loop().call_later(DRAIN_S, reader.cancel)
                _draining.add(reader)
                reader.add_done_callback(lambda t: (_draining.discard(t), timer.cancel()))
            else:
                reader.cancel()


class ReplyInbox:
    """The ingress's end: a Unix socket (in a fresh 0700 directory) and a TCP port on this node's
    address, served on the loop of the first leg that asks (the front door's). Legs on any other
    loop, and those before the servers are up, stream on Serve's call."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self.address: tuple | None = None  # (node id, unix path, host, port, token): a call's reply_to
        self.boxes: dict[int, Mailbox] = {}
        self.connections: set = set()
        self.legs = 0  # legs that asked for frames
        self.frames_in = 0  # frames read, on every connection
        self.refused = 0  # connections closed for a wrong token or a bad frame
        self._ids = itertools.count(1)
        self._starting: asyncio.Task | None = None
        self._dir: str | None = None
        self._servers: tuple = ()

    def open(self, rid: str) -> Mailbox | None:
        """A mailbox for one leg, or None (the leg streams on Serve's call): not started yet (this
        starts it), or asked from another loop than its own."""
        if self.address is None:
            if self.loop is None:
                self.loop = asyncio.get_running_loop()
                self._starting = self.loop.create_task(self._start_here())
            return None
        if asyncio.get_running_loop() is not self.loop:
            return None
        self.legs += 1
        call = next(self._ids)
        box = self.boxes[call] = Mailbox(self, call, rid)
        return box

    async def _start_here(self) -> None:
        try:
            import ray  # noqa: PLC0415

            if not ray.is_initialized():  # never start Ray for this
                raise RuntimeError("Ray is not initialized")
            await self.start(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        except Exception as e:  # noqa: BLE001 — every leg streams on Serve's call then
            log.warning("decode outputs: no socket of their own (%r); they stream on Serve's calls", e)

    async def start(self, node_id: str, host: str) -> None:
        """Listen, on the running loop (which it serves from then on)."""
        loop = self.loop = asyncio.get_running_loop()
        sweep(DIR_PREFIX)
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        path = os.path.join(self._dir, "replies.sock")
        unix = await loop.create_unix_server(lambda: _InboxProtocol(self), path)
        os.chmod(path, 0o600)
        tcp = await loop.create_server(lambda: _InboxProtocol(self), host, 0)
        self._servers = (unix, tcp)
        self.address = (node_id, path, host, tcp.sockets[0].getsockname()[1], secrets.token_bytes(16))

    def deliver(self, frames: list) -> None:
        """Each frame to its leg's mailbox (none: the leg ended). ValueError for a frame that is not
        an output at all (the connection closes); one that names a leg but does not decode fails
        that leg alone."""
        boxes = self.boxes
        self.frames_in += len(frames)
        for f in frames:
            if not (isinstance(f, list) and len(f) == FIELDS and type(f[0]) is int):
                raise ValueError("a frame that is not an output")
            box = boxes.get(f[0])
            if box is None:
                continue
            try:
                out = decode(box.rid, f)
            except (ValueError, KeyError, TypeError) as e:
                box.fail(RepliesLost(f"decode call for {box.rid}: an output frame that does not decode ({e!r})"))
            else:
                box.framed(out)

    def close(self) -> None:
        """Stop listening; close every connection (legs still open fall back to Serve's calls)."""
        for server in self._servers:
            server.close()
        for transport in list(self.connections):
            transport.abort()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class _InboxProtocol(_FramedProtocol):
    def __init__(self, inbox: ReplyInbox):
        super().__init__(FrameReader(first_limit=HELLO_BYTES))
        self.inbox = inbox
        self.authed = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.inbox.connections.add(transport)

    def connection_lost(self, exc) -> None:
        self.inbox.connections.discard(self.transport)

    def frames_received(self, frames: list) -> None:
        if not frames:  # a read that ended inside a frame
            return
        if not self.authed:
            token = frames[0]
            if not (isinstance(token, bytes) and hmac.compare_digest(token, self.inbox.address[4])):
                log.warning("decode outputs: a connection without the inbox's token closed")
                self.inbox.refused += 1
                self.transport.close()
                return
            self.authed = True
            frames = frames[1:]
        try:
            self.inbox.deliver(frames)
        except Exception as e:  # noqa: BLE001 — a frame that is not an output: the replica falls back
            log.warning("decode outputs: closing a replica's connection: %r", e)
            self.inbox.refused += 1
            self.transport.close()


# ---- the decode replica's side ------------------------------------------------------------------

class ReplyLinks:
    """A decode replica's connections to the ingresses that call it: one each, opened in the
    background on the first call that names it (Serve's loop: the one its calls run on). Counts
    the legs sent each way (`legs`: framed, streamed)."""

    def __init__(self, node_id: str | None = None):
        self._node_id = node_id
        self._links: dict[tuple, _Link] = {}
        # legs begun on a connection (framed) or on Serve's call (streamed); framed legs that went
        # on Serve's call when their connection closed (fell_back)
        self.legs = {"framed": 0, "streamed": 0, "fell_back": 0}

    def link(self, address: tuple) -> "_Link | None":
        """The connection to `address` (a ReplyInbox's), if it is up; else None, and a connect
        begins (at most once a RETRY_S after a failed one, doubled while they fail). A connection
        that closes is forgotten: the next call naming its inbox connects again."""
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = _Link(address, self._links)
        if link.transport is not None:
            return link
        if link.connecting is None and time.monotonic() >= link.retry_at:
            link.connecting = asyncio.get_running_loop().create_task(link.connect(self._node()))
        return None

    def _node(self) -> str:
        if self._node_id is None:
            import ray  # noqa: PLC0415

            self._node_id = ray.get_runtime_context().get_node_id()
        return self._node_id

    async def send(self, reply_to: tuple | None, outs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """`outs` as frames to the caller's inbox; what cannot go so is yielded (Serve's call
        streams it): all of them without a connection, the rest of the leg (from its first token)
        once the connection closes."""
        link = None if reply_to is None else self.link(reply_to[0])
        self.legs["streamed" if link is None else "framed"] += 1
        if link is None:
            async for out in outs:
                yield out
            return
        call, sent = reply_to[1], []
        async with aclosing(outs):  # closed with this generator: leaving early aborts the request now
            async for out in outs:
                if link is not None:
                    if link.send(call, out):
                        sent.extend(out.token_ids)
                        continue
                    link = None  # from here on Serve's call streams the leg, from its first token
                    self.legs["fell_back"] += 1
                    if sent:  # the frames' tokens again, on their own: the mailbox drops those it has
                        yield RequestOutput(out.request_id, sent, "", False, None, out.num_prompt_tokens,
                                            out.num_output_tokens - len(out.token_ids), out.num_cached_tokens)
                yield out

    def close(self) -> None:
        """Close every connection now (legs in flight go on Serve's calls)."""
        for link in list(self._links.values()):
            if link.transport is not None:
                link.transport.abort()


class _Link(asyncio.Protocol):
    def __init__(self, address: tuple, links: dict):
        self.address = address
        self._links = links  # the ReplyLinks' table, left when the connection closes
        self.transport = None
        self.connecting: asyncio.Task | None = None
        self.retry_at = 0.0
        self.retry_s = RETRY_S
        self._out: list[bytes] = []  # this turn's frames
        self._queued = 0  # their bytes
        self.congested = False  # the last send found the ingress not reading
        self._loop: asyncio.AbstractEventLoop | None = None

    async def connect(self, node_id: str) -> None:
        node, path, host, port, _ = self.address
        loop = self._loop = asyncio.get_running_loop()
        try:
            try:
                if node != node_id:
                    raise OSError("another node")
                await asyncio.wait_for(loop.create_unix_connection(lambda: self, path), CONNECT_TIMEOUT_S)
            except OSError:  # another node, or another filesystem view (a container): TCP
                await asyncio.wait_for(loop.create_connection(lambda: self, host, port), CONNECT_TIMEOUT_S)
            self.retry_s = RETRY_S
        except Exception as e:  # noqa: BLE001 — its legs stream on Serve's calls meanwhile
            if self.transport is not None:  # connected as the wait ran out
                self.transport.abort()
            self.transport = None
            self.retry_at = time.monotonic() + self.retry_s
            self.retry_s = min(2 * self.retry_s, MAX_RETRY_S)
            log.info("decode outputs to %s:%s: not connected (%r); on Serve's calls", host, port, e)
        finally:
            self.connecting = None

    def connection_made(self, transport) -> None:
        transport.write(frame(self.address[4]))  # the token first: no output frame can go before it
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        self._out.clear()
        self._queued = 0
        if self._links.get(self.address) is self:
            del self._links[self.address]

    def data_received(self, data: bytes) -> None:
        pass  # the inbox sends nothing

    def send(self, call: int, out: RequestOutput) -> bool:
        """Queue an output's frame for this turn's write; False if it cannot go: the connection
        closed, the frame too large, or the ingress not reading (MAX_BUFFERED_BYTES unsent). What
        was queued before still goes (the mailbox drops a fallen-back leg's frames)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        data = encode(call, out)
        if len(data) - HEADER.size > MAX_FRAME_BYTES:
            return False
        if transport.get_write_buffer_size() + self._queued + len(data) > MAX_BUFFERED_BYTES:
            if not self.congested:
                log.warning("decode outputs: the ingress at %s is not reading; legs go on Serve's calls",
                            self.address[2])
            self.congested = True
            return False
        self.congested = False
        if not self._out and not out.finished:
            self._loop.call_soon(self._flush)
        self._out.append(data)
        self._queued += len(data)
        if out.finished:  # a leg's last frame goes now, ahead of its Serve call's end
            self._flush()
        return True

    def _flush(self) -> None:
        transport, out = self.transport, self._out
        self._queued = 0
        if transport is None or not out:
            out.clear()
            return
        transport.write(b"".join(out) if len(out) > 1 else out[0])
        out.clear()
