"""The ingress's metrics, recorded in Ray off the front door's event loop.

A request made 6-8 counter increments (requests, streams, three token counts, the routing decision,
its prompt tokens, predicted cached tokens) and 2-4 histogram values (TTFT, time per output token,
end-to-end latency, the router's latency) through Ray's metrics: each a tag check and a merge in
Python, then a call into Ray's C++ that releases the GIL. In a process where other threads want the
GIL (gRPC's poller, its transport loop with ingress_event_loops 2, Ray's threads), every release can hand it to one of them: a
histogram value measured 2.6 µs with the process otherwise idle and 11 µs of the caller's CPU, 0.7
ms of its wall time, beside one busy Python thread (issue 50, item 5). On the front door's loop
that stalled every request behind it.

Here the loop only appends what it records to a deque (atomic; the GIL is kept), and a thread of
the batch's own records it `FLUSH_S` later: counters summed by counter and tag set (one `inc` for
all the requests of that while), histograms value by value (a bucket needs each one). Ray exports
its metrics every few seconds, so a scrape sees them no later than it did."""

from __future__ import annotations

import logging
import threading
from collections import deque

log = logging.getLogger(__name__)

FLUSH_S = 0.25  # how long a value waits to be recorded (a scrape sees it a few seconds later anyway)
_INC, _OBSERVE = 0, 1


class MetricBatch:
    """`inc(counter, value, tags)` and `observe(histogram, value, tags)` from any thread, recorded by
    the batch's thread (started at the first value) within FLUSH_S; `flush()` records them now, on
    the calling thread. A value that fails is logged; the thread and the others go on."""

    def __init__(self, flush_s: float = FLUSH_S):
        self.flush_s = flush_s
        self._pending: deque = deque()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self._closed = threading.Event()

    def inc(self, counter, value: float, tags: dict | None = None) -> None:
        self._pending.append((_INC, counter, value, tags))
        if self._thread is None:
            self._start_thread()

    def observe(self, histogram, value: float, tags: dict | None = None) -> None:
        self._pending.append((_OBSERVE, histogram, value, tags))
        if self._thread is None:
            self._start_thread()

    def _start_thread(self) -> None:
        with self._start:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="pdserve-metrics", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self.flush_s):
            self.flush()

    def close(self) -> None:
        """Stop the thread and record what is left (values appended later wait for a flush())."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    def flush(self) -> None:
        """Record everything appended so far (on the calling thread)."""
        sums: dict[tuple[object, tuple], float] = {}
        pending = self._pending
        for _ in range(len(pending)):  # what is there now; later values wait for the next flush
            try:
                kind, metric, value, tags = pending.popleft()
            except IndexError:  # another thread's flush took the rest
                break
            try:
                if kind == _INC:
                    key = (metric, tuple(tags.items()) if tags else ())
                    sums[key] = sums.get(key, 0) + value
                else:
                    metric.observe(value, tags)
            except Exception:  # noqa: BLE001 — a bad value or tag set (a bug): logged, the others still go
                log.exception("recording a metric failed")
        for (counter, tags), value in sums.items():
            try:
                counter.inc(value, dict(tags) if tags else None)
            except Exception:  # noqa: BLE001
                log.exception("recording a metric failed")
