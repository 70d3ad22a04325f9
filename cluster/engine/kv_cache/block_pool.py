"""The block pool: ref counts, a free queue in eviction order, and the prefix cache index.

Rules:
- A block is either referenced (ref_cnt > 0) or in the free queue, never both.
- A free block may still be cached (it keeps its hash) until it is reused: the free queue is the
  LRU of evictable cached blocks. Allocation takes from the head and evicts that block's hash.
- Freed blocks go to the tail, in the order the caller gives (callers free a request's blocks
  tail-first, so the end of a prompt is evicted before its shared prefix).
- `on_evict`, when set, receives the (block id, hash) pairs an allocation evicts, before it
  returns: their bytes are intact until a step writes them (a lower tier copies them then). If
  it raises, the allocation raises with every block it took back in the free queue.
  `reset_cache` drops hashes without it.
- A quarantined block is held by an unsettled transfer (a NIXL READ that may still write it, or a
  peer that may still read it): the quarantine keeps the reference its request had, so the block
  cannot be allocated until `unquarantine`. A block is free, used (referenced by a request) or
  quarantined (referenced only by quarantines): free + used + quarantined == total.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from cluster.engine.kv_cache.hashing import BlockHash


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass
class PoolStats:
    """Plain counters; the telemetry layer turns them into metrics."""

    allocated: int = 0
    evicted: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    # ("+", hash) when a block is cached, ("-", hash) when evicted; in order, since the last drain
    events: list[tuple[str, BlockHash]] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[Sequence[tuple[int, BlockHash]]], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._quarantine: dict[int, int] = {}  # block id -> references held by unsettled transfers
        self.stats = PoolStats()
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, whether or not still cached)."""
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        """Blocks referenced only by quarantines: neither free nor used by a request."""
        return sum(1 for b, n in self._quarantine.items() if self.blocks[b].ref_cnt == n)

    def quarantined_block_ids(self) -> list[int]:
        return sorted(self._quarantine)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next evicted) first."""
        return list(self._free)

    def lookup(self, block_hash: BlockHash) -> Block | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def match_prefix(self, hashes: Iterable[BlockHash]) -> list[Block]:
        """The longest run of leading hashes that are cached. Does not take references."""
        hits = []
        for h in hashes:
            block = self.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        evicted = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append((block_id, block.block_hash))
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.on_evict is not None:
            try:
                self.on_evict(evicted)
            except BaseException:  # the allocation fails without taking a block (their hashes are gone)
                self.free_unused(reversed(out))
                raise
        self.stats.allocated += n
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; unreferenced blocks join the free queue's tail."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def free_unused(self, blocks: Iterable[Block]) -> None:
        """Give back blocks that were allocated and hold nothing worth keeping (speculative slots
        rolled back): to the free queue's head, so they are reused before any cached block is
        evicted. Each must be uncached and referenced only by its caller."""
        for block in blocks:
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise RuntimeError(f"block {block.block_id} is shared or cached: it cannot be rolled back")
            block.ref_cnt = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)

    def quarantine(self, blocks: Iterable[Block]) -> None:
        """Hand one reference of each block (its caller's) to a quarantine: the block stays out of
        the free queue until `unquarantine` drops that reference."""
        for block in blocks:
            if block.ref_cnt <= self._quarantine.get(block.block_id, 0):
                raise RuntimeError(f"block {block.block_id} has no reference to quarantine")
            self._quarantine[block.block_id] = self._quarantine.get(block.block_id, 0) + 1

    def unquarantine(self, blocks: Iterable[Block]) -> None:
        """The transfer settled: drop the quarantine's reference (the block may become free)."""
        blocks = list(blocks)
        for block in blocks:
            n = self._quarantine.get(block.block_id, 0)
            if n <= 0:
                raise RuntimeError(f"block {block.block_id} is not quarantined")
            if n == 1:
                del self._quarantine[block.block_id]
            else:
                self._quarantine[block.block_id] = n - 1
        self.free(blocks)

    def cache(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a full block under its hash. False if another block already holds it."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block.block_id
        self.stats.events.append(("+", block_hash))
        return True

    def reset_cache(self) -> int:
        """Forget every unreferenced cached block. Returns how many were dropped."""
        n = 0
        for block_id in list(self._free):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
                n += 1
        return n

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash this pool can serve from its prefix cache now."""
        return list(self._cached)

    def drain_events(self) -> list[tuple[str, BlockHash]]:
        """The cache's stored ("+") and removed ("-") events since the last call, in order."""
        events, self.stats.events = self.stats.events, []
        return events

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        self.stats.events.append(("-", block.block_hash))
        self.stats.evicted += 1
        block.block_hash = None

    def check_invariants(self) -> None:
        referenced = 0
        for block_id, n in self._quarantine.items():
            if not 0 < n <= self.blocks[block_id].ref_cnt:
                raise AssertionError(f"block {block_id}: {n} quarantine refs, ref_cnt {self.blocks[block_id].ref_cnt}")
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            in_free = block.block_id in self._free
            if (block.ref_cnt == 0) != in_free:
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt={block.ref_cnt} but in_free_queue={in_free}"
                )
            referenced += block.ref_cnt > 0
            if block.block_hash is not None and self._cached.get(block.block_hash) != block.block_id:
                raise AssertionError(f"block {block.block_id} hash not indexed")
        quarantined = self.num_quarantined
        used = referenced - quarantined
        if used + quarantined + len(self._free) != self.num_blocks:
            raise AssertionError(
                f"used {used} + quarantined {quarantined} + free {len(self._free)} != total {self.num_blocks}"
            )
        for h, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(f"index entry for block {block_id} is stale")
