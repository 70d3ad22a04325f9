"""Per-request block tables on top of the block pool (and the tiers below it, when set: host,
then disk).

The scheduler talks to this class only; it never sees blocks' internals. Two-phase admission:
`find_cached_prefix` has no side effects, `allocate_slots` commits (or fails without a trace).
A prefix found in a lower tier is loaded back in `allocate_slots`, synchronously: its blocks
are allocated, copied in and cached in the pool before it returns, so they count as computed.
"""

from __future__ import annotations

import itertools
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Collection, Protocol, Sequence

from cluster.engine.kv_cache.block_pool import Block, BlockPool
from cluster.engine.kv_cache.hashing import BlockHash, extend_salt, hash_request_blocks
from cluster.engine.kv_cache.tier import BlockTier


class NoFreeBlocksError(RuntimeError):
    pass


class KVRequest(Protocol):
    """What the manager needs to know about a request."""

    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]
    cache_salt: str  # per-request part of the hash salt (a tenant's); "" for none

    @property
    def all_token_ids(self) -> Sequence[int]: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CachedPrefix:
    """A request's leading blocks that need no compute: `blocks` cached in the device pool, then
    `loads`, (tier index, hash) of the next blocks, held by a lower tier (copied in at allocation)."""

    blocks: tuple[Block, ...] = ()
    loads: tuple[tuple[int, BlockHash], ...] = ()

    def __len__(self) -> int:
        return len(self.blocks) + len(self.loads)


NO_PREFIX = CachedPrefix()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, salt: bytes = b"",
                 tiers: Sequence[BlockTier] = ()):
        """`tiers`: below the pool, top down (host, then disk); each takes the evictions of the one above."""
        if tiers and not enable_caching:
            raise ValueError("KV tiers need prefix caching: they hold blocks by hash")
        self.block_size = block_size
        self.salt = salt
        self._salts: dict[str, bytes] = {"": salt}  # per-request cache_salt -> full salt
        self.tiers = list(tiers)
        self.pool = BlockPool(num_blocks, enable_caching, on_evict=tiers[0].store if tiers else None)
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            upper.on_evict = lower.store
        self._blocks: dict[str, list[Block]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of the request already in the index
        self._quarantines: dict[int, list[Block]] = {}  # token -> blocks an unsettled transfer holds
        self._tokens = itertools.count(1)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def host(self) -> BlockTier | None:
        """The first tier below the pool, if any."""
        return self.tiers[0] if self.tiers else None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def update_hashes(self, req: KVRequest) -> list[BlockHash]:
        """Extend the request's chained hashes over its full blocks of known tokens."""
        tokens = req.all_token_ids
        if len(req.block_hashes) < len(tokens) // self.block_size:
            salt = self._salts.get(req.cache_salt)
            if salt is None:
                salt = self._salts[req.cache_salt] = extend_salt(self.salt, req.cache_salt)
            req.block_hashes = hash_request_blocks(tokens, self.block_size, salt, req.block_hashes)
        return req.block_hashes

    def find_cached_prefix(self, req: KVRequest) -> CachedPrefix:
        """Cached blocks at the start of a new request's tokens (device pool, then the tiers below); at
        least one token stays to compute."""
        if not self.pool.enable_caching:
            return NO_PREFIX
        hashes = self.update_hashes(req)
        max_blocks = (len(req.all_token_ids) - 1) // self.block_size
        self.pool.stats.queried_blocks += min(len(hashes), max_blocks)
        prefix = self._match(hashes[:max_blocks])
        self.pool.stats.hit_blocks += len(prefix.blocks)
        return prefix

    def _match(self, hashes: Sequence[BlockHash]) -> CachedPrefix:
        hits = self.pool.match_prefix(hashes)
        loads: list[tuple[int, BlockHash]] = []
        for h in hashes[len(hits):] if self.tiers else ():
            # a hash the pool also holds (a later block outlived an earlier one) ends the run:
            # loading it would leave two device blocks with one hash
            tier = next((i for i, t in enumerate(self.tiers) if h in t), None)
            if tier is None or self.pool.lookup(h) is not None:
                break
            loads.append((tier, h))
        return CachedPrefix(tuple(hits), tuple(loads))

    def cached_prefix_tokens(self, req: KVRequest) -> int:
        """Tokens of a waiting request that its cached prefix would cover if it were scheduled now
        (no references taken, no stats counted): what its queued prompt work leaves out."""
        if not self.pool.enable_caching:
            return 0
        max_blocks = (len(req.all_token_ids) - 1) // self.block_size
        return len(self._match(self.update_hashes(req)[:max_blocks])) * self.block_size

    def allocate_slots(self, req: KVRequest, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX) -> bool:
        """Make room for `num_new_tokens` after the computed ones. False = no room, nothing changed.

        `cached` (from find_cached_prefix) is passed once, when the request is admitted; its tokens
        are counted in req.num_computed_tokens by the caller after this returns True. Its tier
        loads are copied into fresh blocks, cached in the pool, before this returns.
        """
        new, revived = self._blocks_needed(req, num_new_tokens, cached)
        if new + len(cached.loads) + revived > self.pool.num_free:
            return False
        blocks = self._blocks.setdefault(req.request_id, [])
        if cached:
            assert not blocks, "cached prefix is only taken at admission"
            self.pool.touch(cached.blocks)  # first: the allocation below must not evict them
            blocks.extend(cached.blocks)
            if cached.loads:
                blocks.extend(self._load(cached.loads))
            self._num_cached[req.request_id] = len(cached)
        if new:
            blocks.extend(self.pool.allocate(new))
        return True

    def _load(self, loads: Sequence[tuple[int, BlockHash]]) -> list[Block]:
        """Fresh blocks holding these tiers' blocks, cached in the pool under their hashes."""
        with ExitStack() as stack:  # this allocation's evictions store into the tiers: pin the loads
            for i, tier in enumerate(self.tiers):
                stack.enter_context(tier.pinned([h for t, h in loads if t == i]))
            blocks = self.pool.allocate(len(loads))
            for i, tier in enumerate(self.tiers):
                mine = [(h, b.block_id) for (t, h), b in zip(loads, blocks) if t == i]
                if mine:
                    tier.load([h for h, _ in mine], [b for _, b in mine])
        for b, (_, h) in zip(blocks, loads):
            self.pool.cache(b, h)
        return blocks

    def _blocks_needed(self, req: KVRequest, num_new_tokens: int, cached: CachedPrefix) -> tuple[int, int]:
        """(fresh blocks to allocate besides tier loads, cached blocks that leave the free queue
        when touched)."""
        have = self._blocks.get(req.request_id, ())
        num_tokens = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        new = max(0, cdiv(num_tokens, self.block_size) - len(have) - len(cached))
        revived = sum(1 for b in cached.blocks if b.ref_cnt == 0)
        return new, revived

    def cache_blocks(self, req: KVRequest, num_computed_tokens: int) -> None:
        """Index the request's blocks that are now full of computed tokens."""
        if not self.pool.enable_caching:
            return
        blocks = self._blocks.get(req.request_id)
        if not blocks:
            return
        start = self._num_cached.get(req.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        hashes = self.update_hashes(req)
        for i in range(start, end):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached[req.request_id] = end

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Keep only the blocks the first `num_tokens` tokens need: the slots of rejected draft
        tokens are rolled back (those blocks were allocated this step and never cached).
        Returns how many blocks went back."""
        blocks = self._blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free_unused(reversed(extra))
        return len(extra)

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first (a prompt's end is evicted before its prefix)."""
        blocks = self._blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def quarantine(self, request_id: str, block_ids: Collection[int] | None = None) -> int:
        """Move the request's blocks in `block_ids` (all of them when None) out of its table into a
        quarantine, with the reference the request had: no allocation can take them until
        `release_quarantine(token)`. Call it just before the request ends (abort, requeue,
        release), which frees its other blocks. Returns the token (0: nothing was moved)."""
        blocks = self._blocks.get(request_id, [])
        moved = [b for b in blocks if block_ids is None or b.block_id in block_ids]
        if not moved:
            return 0
        moved_ids = {b.block_id for b in moved}
        self._blocks[request_id] = [b for b in blocks if b.block_id not in moved_ids]
        self._num_cached.pop(request_id, None)  # the table no longer starts with its cached run
        self.pool.quarantine(moved)
        token = next(self._tokens)
        self._quarantines[token] = moved
        return token

    def release_quarantine(self, token: int) -> int:
        """The transfer settled: the quarantined blocks drop their reference. Returns how many."""
        blocks = self._quarantines.pop(token, None)
        if not blocks:
            return 0
        self.pool.unquarantine(reversed(blocks))
        return len(blocks)

    @property
    def num_quarantined_blocks(self) -> int:
        return self.pool.num_quarantined

    def num_requests(self) -> int:
        return len(self._blocks)

    def holders(self) -> set[str]:
        return set(self._blocks)

    def find_imported_prefix(self, hashes: Sequence[BlockHash]) -> CachedPrefix:
        """Cached blocks at the start of a prompt whose KV comes from elsewhere (no compute cap).
        Device pool only: the lower tiers are not consulted for imports (yet)."""
        return CachedPrefix(tuple(self.pool.match_prefix(hashes))) if self.pool.enable_caching else NO_PREFIX

    def reset_cache(self) -> int:
        """Forget every unreferenced cached block, in the pool and every tier. Returns how many."""
        return self.pool.reset_cache() + sum(t.reset() for t in self.tiers)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        for tier in self.tiers:
            tier.check_invariants()
        refs: dict[int, int] = {}
        for blocks in [*self._blocks.values(), *self._quarantines.values()]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if refs.get(block.block_id, 0) != block.ref_cnt:
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} holders"
                )
