"""Relaying a stream one hop on: a chunk carries everything ready when its consumer asks.

The decode replica already merges the outputs that queued while its caller was busy; this is the
same at the ingress, between the replica's stream and the client's. A pump task reads the source
as fast as it produces, and the consumer takes whatever accumulated since it last asked, merged
into one item: when the client's side (detokenizing, the API's encoding, the send) is slower than
the tokens arrive, it pays once per chunk instead of once per token; when it keeps up, every
item passes alone, in order, with no wait added.

A consumer that leaves after a final item (a finished request's last output) does not cancel the
source: its end is due next, and the pump reads it in the background (bounded by `DRAIN_S`).
Cancelling a call whose answer is complete resets its stream (a gRPC call's cancel on both ends:
~0.04 ms of the ingress's CPU a request, and the replica's handling of it) for nothing.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, TypeVar

T = TypeVar("T")

_END = object()
DRAIN_S = 5.0  # how long a source may take to end after its final item before it is cancelled
_draining: set[asyncio.Task] = set()  # pumps reading their source's end after the consumer left


async def coalesce(source: AsyncIterator[T], merge: Callable[[T, T], T],
                   final: Callable[[T], bool] = lambda _: False,
                   alone: Callable[[T], bool] = lambda _: False) -> AsyncIterator[T]:
    """`source`'s items, with those that arrived while the consumer was busy merged (`merge(a, b)`,
    in order). An item for which `final` is true is never merged into by a later one; one for
    which `alone` is true is never merged into an earlier one (a failure: the items before it
    reach the consumer as they would have unmerged). The source's exception is raised to the
    consumer after the items before it; leaving early cancels the pump, unless the last item the
    consumer took was final: then the pump reads the source's end (at most DRAIN_S)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
            queue.put_nowait(_END)
        except BaseException as e:  # noqa: BLE001 — handed to the consumer, raised there
            queue.put_nowait(e)

    task = asyncio.create_task(pump())
    finished = False  # the last item the consumer took was final
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            while not (finished := final(item)) and not queue.empty():
                nxt = queue._queue[0]  # peek: an end, an error or an item alone stays queued for the next turn
                if nxt is _END or isinstance(nxt, BaseException) or alone(nxt):
                    break
                item = merge(item, queue.get_nowait())
            yield item
    finally:
        if not task.done() and finished:
            _drain(task)
        elif not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 — the pump's own cancellation
                pass


def _drain(task: asyncio.Task) -> None:
    """Leave `task` to read its source's end; cancel it if that takes past DRAIN_S."""
    timer = asyncio.get_running_loop().call_later(DRAIN_S, task.cancel)
    _draining.add(task)

    def done(t: asyncio.Task) -> None:
        _draining.discard(t)
        timer.cancel()

    task.add_done_callback(done)
