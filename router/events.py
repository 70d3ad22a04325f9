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
    """At most `max_unacked` calls (batches and snapshots) wait on the router at a time: a router
    that stops answering (stuck, or its mailbox behind) holds that many, not one per engine step.
    Past that, what changes is dropped and a snapshot is sent once the router catches up."""

    def __init__(self, replica_id: str, source: BlockEventSource, router, incarnation: str | None = None,
                 min_resync_interval_s: float = 1.0, max_unacked: int = 64):
        self.replica_id = replica_id
        self.min_resync_interval_s = min_resync_interval_s  # a dead router costs one snapshot a second
        self.max_unacked = max_unacked
        self._last_snapshot = float("-inf")
        self.source = source
        self.router = router
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.seq = 0
        self._snapshot_seq = 0  # the last snapshot's: an answer to an older call no longer matters
        self._acks: dict = {}  # ref of a call the router has not answered yet -> its seq
        self._resync_due = False
        self.resyncs = 0
        self.failures = {"unavailable": 0, "error": 0}  # router calls that failed, by reason
        self._send_snapshot()  # the router learns of this incarnation from a full snapshot

    @property
    def unacknowledged(self) -> int:
        """Calls sent to the router and not answered yet (at most max_unacked)."""
        return len(self._acks)

    def publish(self) -> None:
        """Send what changed since the last call (if anything) and act on refused batches."""
        if self._refused() or self._resync_due or len(self._acks) >= self.max_unacked:
            self._resync_due = True
            self.source.drain_block_events()  # the snapshot to come supersedes them
            if (len(self._acks) < self.max_unacked
                    and time.monotonic() - self._last_snapshot >= self.min_resync_interval_s):
                self._send_snapshot()
            return
        events = self.source.drain_block_events()
        if not events:
            return
        self.seq += 1
        self._acks[self.router.events.remote(self.replica_id, self.incarnation, self.seq, events)] = self.seq

    def _refused(self) -> bool:
        """Forget the calls the router answered; True when one since the last snapshot (the
        snapshot included) was refused or failed."""
        if not self._acks:
            return False
        done, _ = ray.wait(list(self._acks), num_returns=len(self._acks), timeout=0)
        refused = False
        for ref in done:
            current = self._acks.pop(ref) >= self._snapshot_seq
            try:
                refused |= current and ray.get(ref) is False  # a snapshot answers None
            except ray.exceptions.RayActorError as e:  # the router died: its successor needs a snapshot
                log.debug("router unavailable (%s); will resync", e)
                self.failures["unavailable"] += 1
                refused |= current
            except ray.exceptions.RayTaskError as e:  # the router raised on our call: a bug there
                log.warning("router refused a batch with an error; resyncing: %s", e)
                self.failures["error"] += 1
                refused |= current
        return refused

    def _send_snapshot(self) -> None:
        self.source.drain_block_events()  # the snapshot supersedes anything queued
        self.seq += 1
        self._snapshot_seq = self.seq
        self.resyncs += 1
        self._resync_due = False
        self._last_snapshot = time.monotonic()
        try:
            ref = self.router.resync.remote(self.replica_id, self.incarnation, self.seq,
                                            self.source.cached_block_hashes(), self.source.tier_block_hashes())
        except ray.exceptions.RayError as e:  # routing falls back to load; try again next turn
            log.debug("router resync not sent: %s", e)
            self.failures["unavailable"] += 1
            self._resync_due = True
            return
        self._acks[ref] = self.seq
