"""Which event loop reads gRPC's completion events in the ingress process (issue 50, item 5).

gRPC's asyncio stack (grpcio 1.85's `PollerCompletionQueue`) has one poller thread a process. For
each completion (a message read or sent, a call accepted) it queues the event and writes one byte on
one socket, and every event loop that has used gRPC asyncio in the process watches that socket. The
ingress has three: Ray's actor loop (Serve's replica runs its own inter-deployment server there),
the front door's (Serve's handles stream from the pools over gRPC) and the transport's (our server,
api/grpc_server.py). Every byte woke all three; the one that read it ran its own loop's events and
handed each other one to its loop (`call_soon_threadsafe`: one more wake-up), and the others found
nothing (a `BlockingIOError`, which Serve's exception handler silences). Measured on the served
front-door bench: ~13 context switches of the ingress's threads a relayed message.

`read_only_on(loop)` leaves the socket to the gRPC server's loop alone: its own events (a new call,
a response sent) run there at once. With `ingress_event_loops` 1 (the default) that loop is the
front door's, which then also runs its Serve handles' events at once, and Ray's actor loop (Serve's
inter-deployment server) gets its events from it, a turn of the front door's loop later. With 2 it
is the transport's loop, whose events never wait for a turn of the front door's loop (issue 15's
property); the front door's and Ray's are handed to their loops from there, one wake-up each. A gRPC whose poller has no such shared socket (newer ones give each loop its own)
is left as it is."""

from __future__ import annotations

import asyncio
import gc
import logging

log = logging.getLogger(__name__)

BOUND_LOOP_TYPE = ("grpc._cython.cygrpc", "_BoundEventLoop")  # a loop's hook on the poller's socket


def bind_this_loop() -> None:
    """Hook the running loop on gRPC's poller now (as gRPC does at a loop's first channel or
    server), so that its hook exists before `read_only_on` takes it off: gRPC never hooks a loop
    twice. Holds one reference on gRPC's asyncio state for the process's life."""
    from grpc._cython import cygrpc  # noqa: PLC0415

    cygrpc.init_grpc_aio()


def bound_loops() -> list[tuple[asyncio.AbstractEventLoop, object]]:
    """(loop, the socket it watches) of every loop hooked on gRPC's poller; [] where gRPC's poller
    has no shared socket. A walk of the collector's objects: call once, at start-up."""
    found = []
    for o in gc.get_objects():
        t = type(o)
        if (t.__module__, t.__name__) == BOUND_LOOP_TYPE:
            sock = getattr(o, "read_socket", None)
            if sock is not None:
                found.append((o.loop, sock))
    return found


def read_only_on(loop: asyncio.AbstractEventLoop) -> int:
    """On `loop`'s thread: every other loop hooked on gRPC's poller stops watching its socket
    (a running loop on its own thread, through `call_soon_threadsafe`); returns how many. Nothing
    changes unless `loop` itself watches the socket (else no loop would read it)."""
    bound = bound_loops()
    ours = [sock for other, sock in bound if other is loop]
    if not ours:
        log.info("gRPC's poller has no shared wake-up socket on this loop: left as it is")
        return 0
    taken = 0
    for other, sock in bound:
        if other is loop or sock is not ours[0] or other.is_closed():
            continue
        if other.is_running():
            other.call_soon_threadsafe(other.remove_reader, sock)
        else:
            other.remove_reader(sock)
        taken += 1
    return taken
