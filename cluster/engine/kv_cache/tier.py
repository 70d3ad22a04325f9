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
- A load copies slots into freshly allocated device blocks, synchronously, inside the
  allocation that admits the request; the slots stay here (inclusive tier: a block evicted
  again costs no copy). Slots about to be loaded are pinned across that allocation, whose own
  evictions store into this tier and must not take them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Protocol, Sequence

from cluster.engine.kv_cache.hashing import BlockHash


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
    load_s: float = 0.0  # time spent in loads (synchronous, inside scheduling)
    save_s: float = 0.0  # time spent in saves (synchronous, inside scheduling)


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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def hashes(self) -> list[BlockHash]:
        """Held hashes, least recently used (next evicted) first."""
        return list(self._lru)

    def usage(self) -> TierUsage:
        return TierUsage(self.name, self.num_used, self.num_blocks, replace(self.stats))

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._lru.get(block_hash)

    @contextmanager
    def pinned(self, hashes: Sequence[BlockHash]) -> Iterator[None]:
        """Keep these hashes from being evicted inside the block."""
        for h in hashes:
            if h not in self._lru:
                raise KeyError(f"cannot pin a hash the {self.name} tier does not hold: {h.hex()}")
            self._pins[h] = self._pins.get(h, 0) + 1
        try:
            yield
        finally:
            for h in hashes:
                if self._pins[h] == 1:
                    del self._pins[h]
                else:
                    self._pins[h] -= 1

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
            self._lru[h] = slot
            self._events.append(("+", h))
            t0 = time.perf_counter()
            self.copier.save([(block_id, slot)])
            self.stats.save_s += time.perf_counter() - t0
            self.stats.stored += 1

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Copy these held hashes into these device blocks (the caller allocated them)."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        pairs = []
        for h, block_id in zip(hashes, block_ids):
            pairs.append((self._lru[h], block_id))
            self._lru.move_to_end(h)
        if pairs:
            t0 = time.perf_counter()
            self.copier.load(pairs)
            self.stats.load_s += time.perf_counter() - t0
            self.stats.loaded += len(pairs)

    def reset(self) -> int:
        """Forget every unpinned hash. Returns how many."""
        gone = [h for h in self._lru if h not in self._pins]
        for h in gone:
            self._free.append(self._lru.pop(h))
            self._events.append(("-", h))
        return len(gone)

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
