"""A tier below the device pool (host memory, disk): N block slots keyed by the same chained
salted block hashes. Bookkeeping only (no torch, no files): the bytes move through a `BlockCopier`.

Rules:
- A block enters when the tier above evicts it: the device pool from its prefix cache (its bytes
  are still intact then: eviction happens at allocation, before any step writes the block), the
  host tier from its LRU (handed down before the slot is reused). A hash already here is only
  refreshed (same hash, same bytes).
- A slot is free or used (holds one hash): free + used == total. The used slots are an LRU;
  a store into a full tier takes the least recently used slot that is not pinned (handing its
  (slot, hash) to `on_evict`, the tier below, first), or is dropped when every slot is pinned.
- A load copies slots into freshly allocated device blocks; the slots stay here (inclusive
  tier: a block evicted again costs no copy). It has three parts so that the copy itself can run
  on another thread (kv_cache/loads.py): `begin_load` pins the slots (the allocation that takes
  the device blocks evicts into this tier and must not take them, nor may a store while the copy
  runs), `copy` moves the bytes (thread-safe: it touches no bookkeeping), `end_load` unpins them
  and counts the copy; a failed copy `discard`s the hashes (their bytes are not trusted).
- A save only keeps an evicted block for later, so a failed one (a full disk, a dead file system)
  is skipped: the slot goes back free, the hash is not held, nothing raises into the allocation
  that evicted the block (whose device blocks its request still gets). It is counted
  (`stats.save_failed`); the engine counts a step with failed saves as a step error, so a tier
  that keeps failing trips the replica's health.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Protocol, Sequence

from cluster.engine.kv_cache.hashing import BlockHash

log = logging.getLogger(__name__)

class BlockCopier(Protocol):
    """Moves whole blocks (all layers, K and V) into a tier and from it into the device pool."""

    def save(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(source, slot) pairs: the tier above's block (a device block id, a host slot) -> this slot."""

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(slot, device block id) pairs: this tier -> the device pool."""


@dataclass
class TierStats:
    """Plain counters; the telemetry layer turns them into metrics."""

    stored: int = 0  # blocks copied in (the tier above's evictions)
    refreshed: int = 0  # evicted blocks that were already here (no copy)
    dropped: int = 0  # evictions not kept: every slot pinned
    evicted: int = 0  # hashes forgotten to make room (LRU)
    loaded: int = 0  # blocks copied back into the device pool
    load_failed: int = 0  # blocks whose copy back failed (discarded; the request recomputes them)
    written_through: int = 0  # blocks stored before any eviction (reused store_threshold times)
    save_failed: int = 0  # blocks whose copy in failed (skipped: not held, slot free again)
    load_s: float = 0.0  # time the copies back took (on the loader thread when loads are async)
    save_s: float = 0.0  # time spent in saves (synchronous, inside scheduling)

    @property
    def load_s_per_block(self) -> float | None:
        """Measured cost of bringing one block back from this tier; None before the first load."""
        return self.load_s / self.loaded if self.loaded else None


@dataclass(frozen=True)
class TierUsage:
    """One tier's occupancy and counters, for load reports and `pdserve status`."""

    name: str
    used: int
    total: int
    stats: TierStats


EvictHook = Callable[[Sequence[tuple[int, BlockHash]]], None]


class BlockTier:
    def __init__(self, name: str, num_blocks: int, copier: BlockCopier, on_evict: EvictHook | None = None):
        if num_blocks < 1:
            raise ValueError(f"{name} tier num_blocks must be >= 1, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.copier = copier
        self.on_evict = on_evict
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: slot 0 is taken first
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> slot, least recent first
        self._pins: dict[BlockHash, int] = {}
        self.stats = TierStats()
        self._events: list[tuple[str, BlockHash]] = []  # held ("+") / forgotten ("-"), for the router's index
        self._failing = False  # the last save failed (its warning is logged once per run)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._lru)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def hashes(self) -> list[BlockHash]:
        """Held hashes, least recently used (next evicted) first."""
        return list(self._lru)

    def usage(self) -> TierUsage:
        return TierUsage(self.name, self.num_used, self.num_blocks, replace(self.stats))

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._lru.get(block_hash)

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        """Keep these hashes from being evicted until `unpin` (pins count)."""
        for h in hashes:
            if h not in self._lru:
                raise KeyError(f"cannot pin a hash the {self.name} tier does not hold: {h.hex()}")
        for h in hashes:
            self._pins[h] = self._pins.get(h, 0) + 1

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            if self._pins[h] == 1:
                del self._pins[h]
            else:
                self._pins[h] -= 1

    @contextmanager
    def pinned(self, hashes: Sequence[BlockHash]) -> Iterator[None]:
        """Keep these hashes from being evicted inside the block."""
        self.pin(hashes)
        try:
            yield
        finally:
            self.unpin(hashes)

    def store(self, evicted: Iterable[tuple[int, BlockHash]]) -> None:
        """Keep blocks the tier above evicts: (its block id or slot, hash). Each is copied before the
        next slot is taken: a victim handed down may be a block stored earlier in this same call."""
        for block_id, h in evicted:
            if h in self._lru:
                self._lru.move_to_end(h)
                self.stats.refreshed += 1
                continue
            slot = self._take_slot()
            if slot is None:
                self.stats.dropped += 1
                continue
            t0 = time.perf_counter()
            try:
                self.copier.save([(block_id, slot)])
            except Exception as e:  # noqa: BLE001 — a save is an optimisation: skip it, count it
                self._free.append(slot)
                self._save_failed(e)
                continue
            finally:
                self.stats.save_s += time.perf_counter() - t0
            self._lru[h] = slot
            self._events.append(("+", h))
            self.stats.stored += 1
            self._failing = False

    def _save_failed(self, error: Exception) -> None:
        self.stats.save_failed += 1
        if not self._failing:  # once per run of failures: a full disk fails every eviction
            log.warning("KV %s tier: saving a block failed (%s: %s); evicted blocks are not kept here "
                        "until a save succeeds", self.name, type(error).__name__, error)
        self._failing = True

    def write_through(self, blocks: Iterable[tuple[int, BlockHash]]) -> int:
        """Store blocks the tier above still holds (hot prompt blocks, before any eviction), so
        that their eviction later costs no copy. Returns how many were copied."""
        fresh = [(b, h) for b, h in blocks if h not in self._lru]
        before = self.stats.stored
        self.store(fresh)
        self.stats.written_through += self.stats.stored - before
        return self.stats.stored - before

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Copy these held hashes into these device blocks (the caller allocated them), here and now."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        pairs = list(zip(self.begin_load(hashes), block_ids))
        try:
            seconds = self.copy(pairs)
        except BaseException:
            self.end_load(hashes, 0.0, ok=False)
            raise
        self.end_load(hashes, seconds, ok=True)

    def begin_load(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pin these held hashes for a copy out (refreshing them); their slots, in order."""
        self.pin(hashes)
        for h in hashes:
            self._lru.move_to_end(h)
        return [self._lru[h] for h in hashes]

    def copy(self, pairs: Sequence[tuple[int, int]]) -> float:
        """Move the bytes of a begun load; any thread. Returns the seconds it took."""
        t0 = time.perf_counter()
        if pairs:
            self.copier.load(pairs)
        return time.perf_counter() - t0

    def end_load(self, hashes: Sequence[BlockHash], seconds: float, ok: bool) -> None:
        """The copy of a begun load is over: unpin; a failed one forgets the hashes."""
        self.unpin(hashes)
        if ok:
            self.stats.load_s += seconds
            self.stats.loaded += len(hashes)
        else:
            self.stats.load_failed += len(hashes)
            self.discard(hashes)

    def discard(self, hashes: Iterable[BlockHash]) -> int:
        """Forget these hashes (unpinned ones; their slots go free). Returns how many."""
        gone = [h for h in hashes if h in self._lru and h not in self._pins]
        for h in gone:
            self._free.append(self._lru.pop(h))
            self._events.append(("-", h))
        return len(gone)

    def reset(self) -> int:
        """Forget every unpinned hash. Returns how many."""
        return self.discard(list(self._lru))

    def drain_events(self) -> list[tuple[str, BlockHash]]:
        """Hashes this tier began ("+") and stopped ("-") holding since the last call, in order."""
        events, self._events = self._events, []
        return events

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h in self._lru:  # least recent first; pinned ones are skipped
            if h not in self._pins:
                self.stats.evicted += 1
                slot = self._lru.pop(h)
                self._events.append(("-", h))
                if self.on_evict is not None:
                    self.on_evict([(slot, h)])  # the tier below copies it before the slot is reused
                return slot
        return None

    def check_invariants(self) -> None:
        slots = list(self._lru.values())
        if len(set(slots)) != len(slots):
            raise AssertionError(f"{self.name} tier: two hashes share a slot")
        if set(slots) & set(self._free):
            raise AssertionError(f"{self.name} tier: a slot is both free and used")
        if len(set(self._free)) != len(self._free):
            raise AssertionError(f"{self.name} tier: a slot is free twice")
        if len(self._free) + len(self._lru) != self.num_blocks:
            raise AssertionError(
                f"{self.name} tier: used {len(self._lru)} + free {len(self._free)} != total {self.num_blocks}")
        if not all(0 <= s < self.num_blocks for s in [*slots, *self._free]):
            raise AssertionError(f"{self.name} tier: a slot is out of range")
        if not set(self._pins) <= set(self._lru):
            raise AssertionError(f"{self.name} tier: a pinned hash is not held")
