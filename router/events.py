"""The replica side of the router's feed: one call carries everything the router learns from a
replica (its block stored/removed events since the last call, or a full snapshot, and its load),
and at most one such call is in flight per replica. While the router has not answered, what
changes accumulates here (events appended in order, the load superseded by the latest), so a slow
router gets fewer, larger calls and never a queue of stale ones.

Runs on the engine's loop thread and never blocks on the router: a call's answer is checked
without waiting, on a later turn. A refused batch (a gap, a restarted router, a new incarnation)
or a failed call makes the next call a full snapshot (at most one every `min_resync_interval_s`);
until then the load still goes out, without events."""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol

import ray

from cluster.engine.kv_cache import BlockHash
from router.policy import ReplicaLoad

log = logging.getLogger(__name__)


class BlockEventSource(Protocol):
    """What the feed reads: an LLMEngine."""

    def drain_block_events(self) -> list: ...

    def cached_block_hashes(self) -> list[BlockHash]: ...

    def tier_block_hashes(self) -> list[list[BlockHash]]: ...


@dataclass
class FeedStats:
    """The feed's counters, as `pdserve status` and the metrics read them. A call's lag: from the
    oldest change it carried (an event drained, a queue that moved) to its answer seen here; the
    router's view of this replica is at most that old."""

    calls: int = 0
    snapshots: int = 0
    refused: int = 0  # batches the router refused (a gap, a new incarnation, a restarted router)
    unavailable: int = 0  # calls that failed: the router died or could not be reached
    errors: int = 0  # calls the router raised on (a bug there)
    dropped_events: int = 0  # events a snapshot superseded (after a refusal, or past max_pending_events)
    max_events_per_call: int = 0
    lag_last_s: float = 0.0
    lag_max_s: float = 0.0


@dataclass
class _Call:
    ref: ray.ObjectRef
    changed_at: float | None  # monotonic: the oldest change it carries (None: a heartbeat)
    waiters: list[Future]


class RouterFeed:
    """`load`: the replica's ReplicaLoad now (called only when a call is sent). `router`: the router
    actor (its `feed` method). Timing, on the loop's clock: a change (events, or `queue` differing
    from the last call's) is sent at most every `min_interval_s`, at once when the queues empty (an
    idle loop may not turn again soon), and a call goes out at least every `max_interval_s` (the
    router forgets a replica silent for its stale_after_s)."""

    def __init__(self, replica_id: str, source: BlockEventSource, router, load: Callable[[float], ReplicaLoad],
                 incarnation: str | None = None, min_interval_s: float = 0.02, max_interval_s: float = 0.25,
                 min_resync_interval_s: float = 1.0, max_pending_events: int = 1 << 16):
        self.replica_id = replica_id
        self.source = source
        self.router = router
        self.load = load
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.min_resync_interval_s = min_resync_interval_s  # a dead router costs one snapshot a second
        self.max_pending_events = max_pending_events  # a router this far behind gets a snapshot instead
        self.seq = 0
        self.moves = 0  # routers this feed moved to (role flips across cells)
        self.stats = FeedStats()
        self._events: list = []
        self._changed_at: float | None = None  # the oldest change not sent yet
        self._queue: tuple = ()
        self._snapshot_due = True  # the router learns of this incarnation from a full snapshot
        self._last_snapshot = float("-inf")
        self._last_sent = float("-inf")
        self._call: _Call | None = None  # the one call in flight
        self._urgent: list[Future] = []  # push()es waiting for the next call
        self._lags: list[float] = []  # answered calls' lags since the last drain_lags()

    @property
    def in_flight(self) -> int:
        """Calls sent and not answered yet: 0 or 1."""
        return self._call is not None

    def publish(self, now: float, queue: tuple = (), idle: bool = False) -> None:
        """One loop turn: take what changed, check the call in flight, and send the next call if
        one is due. `queue`: what the router's pending-work accounting must see change (the
        queues' shape and requests received); `idle`: the queues are empty."""
        self._take_events(now)
        if queue != self._queue:
            self._queue = queue
            self._changed(now)
        if self._call is not None and not self._answered(now):
            return  # the latest wins: what changed waits for this answer
        since = now - self._last_sent
        if self._snapshot_due and now - self._last_snapshot >= self.min_resync_interval_s:
            self._send(now, snapshot=True)
        elif (self._urgent or since >= self.max_interval_s
              or (self._changed_at is not None and (since >= self.min_interval_s or idle))):
            self._send(now, snapshot=False)

    def push(self, now: float) -> Future:
        """Send the load now, off the schedule (a role flip: the router must see the pool or the
        drain at once). Loop thread only. The future completes when the router has answered the
        call that carries it (after the call in flight, if there is one); await it wrapped
        (`asyncio.wrap_future`)."""
        waiter: Future = Future()
        self._urgent.append(waiter)
        self._changed(now)
        self.publish(now, self._queue)
        return waiter

    def move(self, router) -> bool:
        """Feed `router` from now on (a role flip moved this replica to another cell: router/cells.py).
        The old router is told to forget this replica; Ray delivers that after the call in flight
        (one caller's calls to one actor run in order), so nothing re-adds it there. The new router
        gets a full snapshot with the next call. Loop thread only. False: the same router (nothing
        to do)."""
        if getattr(router, "name", router) == getattr(self.router, "name", self.router):
            return False
        old, self.router = self.router, router
        try:
            old.forget.remote(self.replica_id)
        except ray.exceptions.RayError as e:  # the old router is gone: it also forgets a silent replica
            log.debug("the old router could not be told to forget %s: %s", self.replica_id, e)
        self.moves += 1
        self._snapshot_due, self._last_snapshot = True, float("-inf")
        return True

    def drain_lags(self) -> list[float]:
        """The lags of the calls answered since the last drain (the metrics exporter's)."""
        lags, self._lags = self._lags, []
        return lags

    # ---- internals --------------------------------------------------------------------------

    def _changed(self, now: float) -> None:
        if self._changed_at is None:
            self._changed_at = now

    def _take_events(self, now: float) -> None:
        events = self.source.drain_block_events()
        if not events:
            return
        if self._snapshot_due or len(self._events) + len(events) > self.max_pending_events:
            self.stats.dropped_events += len(events) + len(self._events)
            self._events = []
            self._snapshot_due = True  # the snapshot to come supersedes them
        else:
            self._events += events
        self._changed(now)

    def _answered(self, now: float) -> bool:
        """Settle the call in flight if the router answered it; False while it has not."""
        call = self._call
        if not ray.wait([call.ref], timeout=0)[0]:
            return False
        self._call = None
        try:
            if ray.get(call.ref) is False:
                self.stats.refused += 1
                self._snapshot_due = True
        except ray.exceptions.RayActorError as e:  # the router died: its successor needs a snapshot
            log.debug("router unavailable (%s); will resync", e)
            self.stats.unavailable += 1
            self._snapshot_due = True
        except Exception as e:  # noqa: BLE001 — the router raised on our call: a bug there
            log.warning("router failed a feed call; resyncing: %r", e)
            self.stats.errors += 1
            self._snapshot_due = True
        if call.changed_at is not None:
            lag = now - call.changed_at
            self._lags.append(lag)
            self.stats.lag_last_s, self.stats.lag_max_s = lag, max(self.stats.lag_max_s, lag)
        for waiter in call.waiters:
            if not waiter.done():  # a push() whose caller gave up waiting cancelled it
                waiter.set_result(None)
        return True

    def _send(self, now: float, snapshot: bool) -> None:
        events, hashes = None, None
        if snapshot:
            self.stats.dropped_events += len(self._events) + len(self.source.drain_block_events())
            self._events, self._snapshot_due, self._last_snapshot = [], False, now
            hashes = (self.source.cached_block_hashes(), self.source.tier_block_hashes())
            self.seq += 1
            self.stats.snapshots += 1
        elif self._events and not self._snapshot_due:
            events, self._events = self._events, []
            self.seq += 1
            self.stats.max_events_per_call = max(self.stats.max_events_per_call, len(events))
        # The oldest change, as wall-clock time: the router measures its own view's staleness.
        changed_wall = None if self._changed_at is None else time.time() - (now - self._changed_at)
        waiters, self._urgent = self._urgent, []
        try:
            ref = self.router.feed.remote(self.replica_id, self.incarnation, self.seq, events, self.load(now),
                                          hashes, changed_wall)
        except ray.exceptions.RayError as e:  # routing falls back to load; try again next turn
            log.debug("router feed not sent: %s", e)
            self.stats.unavailable += 1
            self._snapshot_due, self._urgent = True, waiters
            return
        self.stats.calls += 1
        self._call = _Call(ref, self._changed_at, waiters)
        self._changed_at, self._last_sent = None, now
