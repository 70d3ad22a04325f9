"""Counter increments summed in the ingress and recorded once per tag set a short while later.

A request made 6-8 counter increments through Ray's metrics (requests, streams, three token counts,
the routing decision, its prompt tokens, predicted cached tokens), each a tag check and a merge in
Python and a call into Ray's C++: ~0.05 ms of the front door's CPU a request, a quarter of its own
admission work (issue 50, item 5). Here an increment adds to a sum on the event loop; the sums go to
Ray after `FLUSH_S` (one `inc` per counter and tag set for all the requests of that while). Ray
exports its metrics every few seconds, so a scrape sees them no later than it did. Histograms are
recorded as they come (a bucket needs each value). Off an event loop an increment goes at once."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

FLUSH_S = 0.25  # how long increments wait to be summed (a scrape sees them a few seconds later anyway)


class CounterBatch:
    """Sums of `inc(counter, value, tags)` by counter and tag set, recorded on the loop FLUSH_S after
    the first of them. Used from one event loop's thread."""

    def __init__(self, flush_s: float = FLUSH_S):
        self.flush_s = flush_s
        self._sums: dict[tuple[object, tuple], float] = {}
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop its flush is scheduled on

    def inc(self, counter, value: float, tags: dict | None = None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: nothing would flush it
            counter.inc(value, tags)
            return
        if loop is not self._loop:  # first use, or another loop: the last one may never run its flush
            self.flush()
            self._loop = loop
        key = (counter, tuple(tags.items()) if tags else ())
        self._sums[key] = self._sums.get(key, 0) + value
        if not self._scheduled:
            self._scheduled = True
            loop.call_later(self.flush_s, self.flush)

    def flush(self) -> None:
        """Record every sum now."""
        self._scheduled = False
        sums, self._sums = self._sums, {}
        for (counter, tags), value in sums.items():
            try:
                counter.inc(value, dict(tags) if tags else None)
            except Exception:  # noqa: BLE001 — a bad tag set (a bug): logged, the other sums still go
                log.exception("recording a summed counter failed")
