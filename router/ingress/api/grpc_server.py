"""The ingress replica's own gRPC server: `pdserve.v1.Generation` and `grpc.health.v1.Health`.

Why not Serve's gRPC proxy (docs/architecture.md, "The gRPC server"):
- it binds every interface whatever the app's `host` says, so a loopback `pdserve up` without keys
  served unauthenticated Generate to the network;
- every request crossed it (parse, pickle, an actor call, a stream of Ray objects back): it passed
  ~80-100 requests/s here, so a burst queued in the proxy for seconds before the ingress could
  refuse any of it, and a 5 MB message was parsed twice before the ingress saw its size;
- its cap on a message is read from its process's environment only.

This server binds the app's `host` and `grpc_port` (SO_REUSEPORT: several ingress replicas on a node
share the port, and a replacement binds while its predecessor drains) and refuses a message over
`ingress_limits.grpc_max_receive_bytes` once read (TRANSPORT_CAP_FACTOR). A client's gRPC deadline bounds its request
like the `x-pdserve-timeout-s` header (the earlier wins). A client that stops reading a stream is
cut off past MAX_UNREAD_RESPONSES waiting responses, its request cancelled (`relay`).

**One event loop, or two** (`ingress_event_loops`). By default (1) the server runs on the front
door's loop, where Serve's handles to the pools run too: a call's work is a task on the loop that
took it, and its responses go to gRPC without crossing threads. The bad-key and shedding refusals
are the first things a call does there, and wait for the loop's turn like everything else. Since
gRPC's pollers replaced its EventEngine (cluster/app/builder.py) this costs 0.87x the ingress's CPU
a 64-token request (0.84x a further message) with 0.6-0.7x its context switches, and refuses a
burst as fast (docs/benchmarks.md, "One loop again").

With 2, the transport runs on a loop of its own, in its own thread (`pdserve-grpc`). gRPC's
asyncio server takes one new call per turn of its loop (or two: the completion, then the next
request for a call); when the front door's turns were long (~10 ms: a hundred streams' deltas,
Ray's callbacks), new calls were taken at ~50 a second and a burst waited in gRPC's queue for
seconds before anything could refuse it (issue 15). On its own loop, where a turn is short, the
transport also refuses while the door's loop is stopped outright. Each call's work (authentication,
the front door, converting deltas) then runs on the front door's loop (`app_loop`), and its
responses come back through a queue (`Handoff`). From the transport's thread the front door is only
read, by one question: is it shedding all work now (`FrontDoor.shedding`: every version's capacity
would refuse any request)? Then the call is refused at once, without waiting for a turn of the front
door's loop. The calls it let through that have not reached the front door's loop yet (`Transit`)
are ahead of the new one, so they count in that question: under a burst the queue model refuses
here what it would refuse on the front door's loop a turn or a hundred milliseconds later.
Serve's handles stay on the loop they were made on (the front door's) either way."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import AppConfig
from cluster.errors import InvalidRequestError
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.ingress.api import grpc_api, grpc_events, probes
from router.ingress.api.grpc_guard import KeyFirst, Meter, Oversized, generation_handler
from router.ingress.gateway.front_door import FrontDoor
from router.ingress.status import Code, ServingError

log = logging.getLogger(__name__)

HEALTH_SERVICES = ("", "pdserve.v1.Generation")
_END = object()  # the end of a call's responses
_UNREAD = object()  # a call ended over MAX_UNREAD_RESPONSES
# Responses of one call made by the front door and not yet taken by gRPC. gRPC first sends what
# the client's HTTP/2 window takes (64 KiB to a few MiB), so only a client that stops reading
# gets here: a response is one or a few tokens, a few seconds of one stream's tokens.
MAX_UNREAD_RESPONSES = 256
# The transport reads a message up to this many times ingress_limits.grpc_max_receive_bytes; the
# front door refuses one over the limit itself (INVALID_ARGUMENT naming the limit, as soon as it is
# read). gRPC's own refusal of a message over its cap is slow: ~110 ms for 4.3 MB against a 4 MiB cap
# on this machine, ten times what reading the whole 5 MB and refusing it takes (~10 ms). Past this
# factor the transport refuses (RESOURCE_EXHAUSTED), which bounds what one call may hold in memory.
TRANSPORT_CAP_FACTOR = 4


class Transit:
    """The Generate calls the server let through whose work has not started on the front door's
    loop (with one loop: whose task has not run yet). The server's loop enters a call; either
    thread may end its transit (the work starting, or the call ending first), once."""

    def __init__(self):
        self._lock = threading.Lock()
        self.calls = 0

    def enter(self) -> Callable[[], None]:
        """Count one call; returns its `leave` (idempotent)."""
        with self._lock:
            self.calls += 1
        left = False

        def leave() -> None:
            nonlocal left
            with self._lock:
                if not left:
                    left = True
                    self.calls -= 1
        return leave


def to_loop(loop: asyncio.AbstractEventLoop) -> Callable[..., object]:
    """`loop.call_soon_threadsafe` from another thread; `call_soon` on the loop's own (one loop)."""
    try:
        same = asyncio.get_running_loop() is loop
    except RuntimeError:
        same = False
    return loop.call_soon if same else loop.call_soon_threadsafe


class Generation(pb_grpc.GenerationServicer):
    """Runs on the server's loop (the front door's with ingress_event_loops 1, the transport's with
    2), where it is made; each method's work runs on `app_loop`, the front door's."""

    def __init__(self, door: FrontDoor, config: AppConfig, app_loop: asyncio.AbstractEventLoop):
        self.door, self.config, self.app_loop = door, config, app_loop
        self.to_door = to_loop(app_loop)
        self.transit = Transit()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext  # noqa: N802
                       ) -> AsyncIterator[pb.GenerateResponse]:
        metadata, remaining = dict(context.invocation_metadata()), context.time_remaining()
        shed = self.door.shedding(metadata.get("authorization"), self.transit.calls)
        if shed is not None:  # overloaded: refused here
            tenant, refusal = shed
            self.to_door(self.door.count_refused, refusal, tenant)
            await abort(context, refusal)
        leave = self.transit.enter()
        try:
            async for response in relay(self.app_loop, context,
                                        lambda put: self._generate(request, metadata, remaining, put, leave)):
                yield response
        finally:
            leave()

    async def _generate(self, request: pb.GenerateRequest, metadata: dict, remaining: float | None,
                        put: Callable[[object], None], arrived: Callable[[], None] = lambda: None) -> None:
        """On the front door's loop: every response, in order, through `put`; `arrived()` first
        (its transit ended: from here on the front door counts it)."""
        arrived()
        if isinstance(request, Oversized):  # refused by its length, unparsed (grpc_guard.sized)
            tenant = self.door.authorize(metadata.get("authorization"), None)
            error = InvalidRequestError("request", f"message of {request.size} bytes exceeds grpc_max_receive_bytes "
                                                   f"{self.config.ingress_limits.grpc_max_receive_bytes}")
            self.door.audit_refusal(error, tenant)
            raise error
        tenant = self.door.authorize(metadata.get("authorization"), request.model)
        try:
            client_request = grpc_api.request_from_proto(request, metadata, tenant, self.config)
        except InvalidRequestError as e:
            self.door.audit_refusal(e, tenant, request.model or None, request.request_id or None)
            raise
        if remaining is not None:  # the client's gRPC deadline
            deadline = time.time() + remaining
            if client_request.deadline is None or deadline < client_request.deadline:
                client_request = replace(client_request, deadline=deadline)
        reply = await self.door.serve(client_request)
        async for response in grpc_api.responses(reply):
            put(response)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext  # noqa: N802
                         ) -> pb.ListModelsResponse:
        header = dict(context.invocation_metadata()).get("authorization")

        async def models(put):
            tenant = self.door.authorize(header, None)
            put(pb.ListModelsResponse(models=[pb.ModelInfo(**m) for m in self.door.model_info(tenant)]))

        return await unary(self.app_loop, context, models)


class Health(health_pb2_grpc.HealthServicer):
    """SERVING for the server ("") and pdserve.v1.Generation while `liveness` says so (one probe
    at a time, its answer kept ~1 s: probes.Liveness), NOT_SERVING otherwise; NOT_FOUND for any
    other service, as the protocol says. No key needed (the interceptor lets it through)."""

    def __init__(self, liveness: probes.Liveness, app_loop: asyncio.AbstractEventLoop):
        self.liveness, self.app_loop = liveness, app_loop

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext  # noqa: N802
                    ) -> health_pb2.HealthCheckResponse:
        if request.service not in HEALTH_SERVICES:
            await abort(context, ServingError(Code.NOT_FOUND, f"unknown service {request.service!r}"))

        async def check(put):
            live = await self.liveness.live()
            put(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING if live
                                               else health_pb2.HealthCheckResponse.NOT_SERVING))

        return await unary(self.app_loop, context, check)


class Handoff:
    """Items put on one thread for any of the calls, delivered in order on `loop`: one wake-up of
    that loop for all that arrives before it runs, whichever calls it is for (a call_soon_threadsafe
    per response woke it once per response and once more for the end; one a call, once per call
    whose responses a turn of the front door's loop made). `sender(deliver)`: one call's `put`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[Callable[[object], None], object]] = []
        self._lock = threading.Lock()

    def sender(self, deliver: Callable[[object], None]) -> Callable[[object], None]:
        return lambda item: self._put(deliver, item)

    def _put(self, deliver: Callable[[object], None], item: object) -> None:
        with self._lock:
            self._items.append((deliver, item))
            if len(self._items) > 1:
                return  # its wake-up is on its way
        self.loop.call_soon_threadsafe(self._take)

    def _take(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for deliver, item in items:
            try:
                deliver(item)
            except Exception:  # noqa: BLE001 — a bug in one call's delivery: the others' still go
                log.exception("delivering a gRPC call's response failed")


_HANDOFFS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Handoff]" = weakref.WeakKeyDictionary()


def handoff_to(loop: asyncio.AbstractEventLoop) -> Handoff:
    """The one Handoff of every call relayed to `loop` (the transport's; made on its first call)."""
    handoff = _HANDOFFS.get(loop)
    if handoff is None:
        handoff = _HANDOFFS[loop] = Handoff(loop)
    return handoff


async def relay(app_loop: asyncio.AbstractEventLoop, context: grpc.aio.ServicerContext,
                work: Callable[[Callable[[object], None]], Awaitable[None]],
                max_unread: int = MAX_UNREAD_RESPONSES) -> AsyncIterator:
    """Run `work(put)` on `app_loop` and yield what it puts, here, in order; its refusal or failure
    ends the call with that status (an unexpected exception: INTERNAL, logged). The call ending
    first (the client cancelled, its deadline passed) cancels the work.

    A client that stops reading: gRPC sends what its HTTP/2 window takes, then the responses wait
    here; past `max_unread` the work is cancelled (both legs, as a cancel is) and the call ends
    RESOURCE_EXHAUSTED naming the limit, read after what the window holds: no engine generates
    for no one, and a call holds at most that many responses here."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue = asyncio.Queue()
    sent_one = over = False  # gRPC took a response; the call went over max_unread
    refusal: asyncio.Task | None = None

    def deliver(item: object) -> None:
        nonlocal over, refusal
        if over:
            return  # what the cancelled work still puts is dropped
        if out.qsize() < max_unread:
            out.put_nowait(item)
            return
        over = True
        job.cancel()
        while not out.empty():
            out.get_nowait()
        out.put_nowait(_UNREAD)
        # The call's task may be stuck in a send only the client can finish: abort beside it, but
        # not before its first send completed: that one carries the initial metadata, an abort
        # beside it sends them too, gRPC refuses the second (seen: the call hung to its deadline)
        if sent_one:
            refusal = loop.create_task(_abort_unread(context, max_unread))

    same_loop = app_loop is loop  # ingress_event_loops 1: no hand-off between threads
    put = deliver if same_loop else handoff_to(loop).sender(deliver)

    async def run() -> None:
        try:
            await work(put)
            put(_END)
        except (InvalidRequestError, ServingError) as e:
            put(e)
        except Exception:  # noqa: BLE001 — a bug: logged here, INTERNAL to the client
            log.exception("a gRPC call failed")
            put(ServingError(Code.INTERNAL, "internal error"))

    job = loop.create_task(run()) if same_loop else asyncio.run_coroutine_threadsafe(run(), app_loop)
    try:
        while (item := await out.get()) is not _END:
            if item is _UNREAD:
                await (refusal or _abort_unread(context, max_unread))
                return
            if isinstance(item, (InvalidRequestError, ServingError)):
                await abort(context, item)
            yield item
            sent_one = True
    finally:
        job.cancel()  # a no-op once it ended; else its task is cancelled on app_loop


async def _abort_unread(context: grpc.aio.ServicerContext, max_unread: int) -> None:
    error = ServingError(Code.RESOURCE_EXHAUSTED, f"the client left {max_unread} responses unread "
                                                  f"(MAX_UNREAD_RESPONSES {max_unread}): the request was cancelled")
    try:
        await abort(context, error)
    except grpc.aio.AbortError:  # raised by every abort, once the status is on its way
        pass
    except Exception as e:  # noqa: BLE001 — the call ended meanwhile (the client left): nothing to tell
        log.debug("the unread-responses abort found the call ended: %r", e)


async def unary(app_loop: asyncio.AbstractEventLoop, context: grpc.aio.ServicerContext,
                work: Callable[[Callable[[object], None]], Awaitable[None]]):
    """`relay` for a call with one response."""
    async for response in relay(app_loop, context, work):
        return response
    raise RuntimeError("the call's work ended without a response")


async def abort(context: grpc.aio.ServicerContext, error: InvalidRequestError | ServingError) -> None:
    """End the call with the error's status; a retry-after also goes in the trailing metadata
    (`retry-after`, whole seconds as HTTP's header), besides the details."""
    status = grpc_api.status_of(error)
    if status.retry_after is not None:
        context.set_trailing_metadata((("retry-after", str(status.retry_after)),))
    await context.abort(status.code, status.details)


class GrpcServer:
    """One ingress replica's server: its transport on a thread and event loop of its own (see the
    module's docstring), its calls' work on the loop that starts it; with ingress_event_loops 1,
    all of it on the loop that starts it. `liveness`: what health calls answer from (default: the
    door's own probe, cached)."""

    def __init__(self, door: FrontDoor, config: AppConfig, liveness: probes.Liveness | None = None):
        self.door, self.config = door, config
        self.liveness = liveness or probes.door_liveness(door)
        self.meter = Meter()  # request bytes the transport read
        self.address = f"{_bracketed(config.host)}:{config.grpc_port}"
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's: the door's (1 loop) or the transport's (2)
        self.server: grpc.aio.Server | None = None
        self.generation: Generation | None = None
        self.handed_off_loops = 0  # the loops that stopped watching gRPC's poller (grpc_events.py)

    async def start(self) -> None:
        """Bind and serve; a port that cannot be bound raises here (and fails the replica)."""
        app_loop = asyncio.get_running_loop()
        grpc_events.bind_this_loop()  # before the transport takes gRPC's wake-ups (grpc_events.py)
        if self.config.ingress_event_loops == 1:  # the server on this loop: no thread of its own
            self.loop = app_loop
            await self._serve(app_loop)
            return
        started: concurrent.futures.Future = concurrent.futures.Future()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, args=(app_loop, started), name="pdserve-grpc", daemon=True).start()
        await asyncio.wrap_future(started)

    def _run(self, app_loop: asyncio.AbstractEventLoop, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve(app_loop))
        except BaseException as e:  # noqa: BLE001 — the starter raises it
            started.set_exception(e)
            return
        started.set_result(None)
        # kept running after stop(): gRPC's process-wide completion queue delivers its events
        # through the loop it was made on, which may be this one, for every gRPC user in the process
        self.loop.run_forever()

    async def _serve(self, app_loop: asyncio.AbstractEventLoop) -> None:
        limits = self.config.ingress_limits
        door = self.door

        def check(authorization: str | None) -> ServingError | None:  # only reads (the transport's thread)
            try:
                door.admission.authenticate(authorization)
            except ServingError as e:
                return e
            return None

        to_door = to_loop(app_loop)

        def refused(error: ServingError) -> None:  # counted and audited on the door's loop
            to_door(door.refused, error)

        self.server = grpc.aio.server(
            interceptors=[KeyFirst(check, refused)],
            options=[("grpc.max_receive_message_length", TRANSPORT_CAP_FACTOR * limits.grpc_max_receive_bytes),
                     ("grpc.so_reuseport", 1)],
            maximum_concurrent_rpcs=limits.grpc_max_concurrent_rpcs)
        self.generation = Generation(self.door, self.config, app_loop)
        self.server.add_generic_rpc_handlers((generation_handler(self.generation, limits.grpc_max_receive_bytes,
                                                                 self.meter),))
        health_pb2_grpc.add_HealthServicer_to_server(Health(self.liveness, app_loop), self.server)
        try:
            self.server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise RuntimeError(f"the gRPC server could not bind {self.address} (grpc_port; another "
                               f"process holds it without SO_REUSEPORT?): {e}") from None
        await self.server.start()
        # gRPC's completions wake this loop alone; the other loops' are handed to them from here
        self.handed_off_loops = grpc_events.read_only_on(self.loop)

    async def stop(self, grace_s: float) -> None:
        """Stop taking calls; the calls in flight get `grace_s` to finish."""
        if self.server is None:
            return
        if self.loop is asyncio.get_running_loop():  # ingress_event_loops 1
            await self.server.stop(grace_s)
        else:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self.loop))


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
