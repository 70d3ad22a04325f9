"""The replica side of the index feed: drains an engine's block stored/removed events and sends
them to the router with a sequence number; when the router refuses a batch (a gap, a restarted
router, a new incarnation), sends a full snapshot instead. Runs on the engine's loop thread;
never blocks on the router (fire-and-forget, acknowledgements checked without waiting)."""

from __future__ import annotations

import logging
import time
import uuid

import ray

from typing import Protocol

from cluster.engine.kv_cache import BlockHash

log = logging.getLogger(__name__)


class BlockEventSource(Protocol):
    """What the feed reads: an LLMEngine."""

    def drain_block_events(self) -> list: ...

    def cached_block_hashes(self) -> list[BlockHash]: ...

    def tier_block_hashes(self) -> list[list[BlockHash]]: ...


class KVEventPublisher:
    def __init__(self, replica_id: str, source: BlockEventSource, router, incarnation: str | None = None,
                 min_resync_interval_s: float = 1.0):
        self.replica_id = replica_id
        self.min_resync_interval_s = min_resync_interval_s  # a dead router costs one snapshot a second
        self._last_snapshot = float("-inf")
        self.source = source
        self.router = router
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.seq = 0
        self._acks: list = []  # refs of batches not yet acknowledged
        self._resync_due = False
        self.resyncs = 0
        self.failures = {"unavailable": 0, "error": 0}  # router calls that failed, by reason
        self._send_snapshot()  # the router learns of this incarnation from a full snapshot

    def publish(self) -> None:
        """Send what changed since the last call (if anything) and act on refused batches."""
        if self._resync_due or self._refused():
            self._resync_due = True
            if time.monotonic() - self._last_snapshot >= self.min_resync_interval_s:
                self._send_snapshot()
            return
        events = self.source.drain_block_events()
        if not events:
            return
        self.seq += 1
        self._acks.append(self.router.events.remote(self.replica_id, self.incarnation, self.seq, events))

    def _refused(self) -> bool:
        if not self._acks:
            return False
        done, pending = ray.wait(self._acks, num_returns=len(self._acks), timeout=0)
        refused = False
        for ref in done:
            try:
                refused |= not ray.get(ref)
            except ray.exceptions.RayActorError as e:  # the router died: its successor needs a snapshot
                log.debug("router unavailable (%s); will resync", e)
                self.failures["unavailable"] += 1
                refused = True
            except ray.exceptions.RayTaskError as e:  # the router raised on our batch: a bug there
                log.warning("router refused a batch with an error; resyncing: %s", e)
                self.failures["error"] += 1
                refused = True
        self._acks = pending
        return refused

    def _send_snapshot(self) -> None:
        self.source.drain_block_events()  # the snapshot supersedes anything queued
        self.seq += 1
        self.resyncs += 1
        self._acks = []
        self._resync_due = False
        self._last_snapshot = time.monotonic()
        try:
            self.router.resync.remote(self.replica_id, self.incarnation, self.seq, self.source.cached_block_hashes(),
                                      self.source.tier_block_hashes())
        except ray.exceptions.RayError as e:  # routing falls back to load; try again next turn
            log.debug("router resync not sent: %s", e)
            self.failures["unavailable"] += 1
