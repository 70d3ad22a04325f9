"""Per-request block tables on top of the block pool (and the tiers below it, when set: host,
then disk).

The scheduler talks to this class only; it never sees blocks' internals. Two-phase admission:
`find_cached_prefix` has no side effects, `allocate_slots` commits (or fails without a trace).

A prefix found in a lower tier is loaded back: `allocate_slots` takes device blocks for it and
copies them in. A copy expected to take less than `inline_load_s` (the tier's measured seconds
per block x the blocks; the engine sets the budget to a fraction of its step time) runs there and
then, so the request computes in this very step; a longer one, or one not measured yet, runs on
the loader thread (kv_cache/loads.py) while the engine steps, and `poll_loads` finishes it,
caching the blocks in the pool under their hashes. Until then the request must not compute
(`is_loading`), its blocks are not in the index, and a second request needing one of those
hashes waits (`loads_conflict`): two device blocks never hold one hash. A request that ends
during its copy leaves the blocks quarantined until the copy is over (never reused under a
write), then cached. A failed copy (inline or not) leaves the request loading until the next
poll, which reports it: the caller recomputes.

Write-through (`store_threshold` > 0): a prompt block hit that many times is copied to the host
tier while the pool still holds it (vLLM's store_threshold), so its eviction later costs no copy
on the allocation path and it survives the pool's LRU.
"""

from __future__ import annotations

import itertools
import concurrent.futures as cf
import logging
from dataclasses import dataclass
from typing import Collection, Protocol, Sequence

from cluster.engine.kv_cache.block_pool import Block, BlockPool
from cluster.engine.kv_cache.hashing import BlockHash, extend_salt, hash_request_blocks
from cluster.engine.kv_cache.loads import LoadJob, TierLoader
from cluster.engine.kv_cache.tier import BlockTier

log = logging.getLogger(__name__)

SEEN_PER_HOST_BLOCK = 4  # hashes whose hit counts write-through remembers, per host tier block


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
                 tiers: Sequence[BlockTier] = (), loader: TierLoader | None = None, store_threshold: int = 0):
        """`tiers`: below the pool, top down (host, then disk); each takes the evictions of the one
        above. `loader`: runs their copies back (default: at submit, on this thread).
        `store_threshold`: hits after which a cached block is written through to the host tier (0: off)."""
        if tiers and not enable_caching:
            raise ValueError("KV tiers need prefix caching: they hold blocks by hash")
        if store_threshold < 0:
            raise ValueError(f"store_threshold must be >= 0, got {store_threshold}")
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
        self.loader = loader or TierLoader(threaded=False)
        self._jobs: dict[str, LoadJob] = {}  # request id -> its copy from the tiers, not yet polled
        self._orphans: list[LoadJob] = []  # copies whose request ended: quarantined until they finish
        self._in_flight: set[BlockHash] = set()  # hashes being copied in (not yet in the pool's index)
        self.inline_load_s = 0.0  # a copy expected to take at most this runs at admission (see the docstring)
        self.loads_inline = self.loads_async = 0  # copies (one per admitted request) by where they ran
        self.store_threshold = store_threshold
        self._seen: dict[BlockHash, int] = {}  # hit counts for write-through (insertion order: oldest first)
        self._max_seen = SEEN_PER_HOST_BLOCK * (self.tiers[0].num_blocks if self.tiers else 0)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def save_failures(self) -> int:
        """Blocks the tiers failed to save since start (each skipped; see kv_cache/tier.py)."""
        return sum(t.stats.save_failed for t in self.tiers)

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
        if self.store_threshold and self.tiers and prefix.blocks:
            self._count_hits(prefix.blocks)
        return prefix

    def _count_hits(self, blocks: Sequence[Block]) -> None:
        """Write-through: blocks hit `store_threshold` times go to the host tier now."""
        hot = []
        for b in blocks:
            h = b.block_hash
            n = self._seen.pop(h, 0) + 1
            self._seen[h] = n  # most recent last
            if n >= self.store_threshold and h not in self.tiers[0]:
                hot.append((b.block_id, h))
        while len(self._seen) > self._max_seen:
            del self._seen[next(iter(self._seen))]
        if hot:
            self.tiers[0].write_through(hot)

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
        loads start here: fresh blocks, copied in now when `load_inline(cached)` (cached in the
        pool before this returns), else cached when `poll_loads` sees the copy done; until then
        `is_loading(req.request_id)` and nothing may compute.
        """
        if not cached:  # the common case, a running request's next tokens: room in its last block?
            have = self._blocks.get(req.request_id)
            if have is not None and req.num_computed_tokens + num_new_tokens <= len(have) * self.block_size:
                return True
        new, revived = self._blocks_needed(req, num_new_tokens, cached)
        if new + len(cached.loads) + revived > self.pool.num_free:
            return False
        blocks = self._blocks.setdefault(req.request_id, [])
        if cached:
            assert not blocks, "cached prefix is only taken at admission"
            self.pool.touch(cached.blocks)  # first: the allocation below must not evict them
            blocks.extend(cached.blocks)
            self._num_cached[req.request_id] = len(cached.blocks)
            if cached.loads:
                blocks.extend(self._start_load(req.request_id, cached))
        if new:
            blocks.extend(self.pool.allocate(new))
        return True

    def load_inline(self, cached: CachedPrefix) -> bool:
        """Will `allocate_slots` copy these loads in at once? Yes without a loader thread, or
        when the tiers' measured cost per block says the copy fits `inline_load_s`."""
        if not self.loader.threaded:
            return True
        estimate = 0.0
        for t, _ in cached.loads:
            per_block = self.tiers[t].stats.load_s_per_block
            if per_block is None:  # never measured: off the engine's thread
                return False
            estimate += per_block
        return estimate <= self.inline_load_s

    def _start_load(self, request_id: str, cached: CachedPrefix) -> list[Block]:
        """Fresh blocks for the prefix's tier loads, their copies started (pins held until the
        copy ends), or done and cached when the copy runs inline."""
        loads = cached.loads
        per_tier = [[h for t, h in loads if t == i] for i in range(len(self.tiers))]
        # pinned first: this allocation evicts into the tiers and must not take these slots
        slots = [tier.begin_load(hashes) for tier, hashes in zip(self.tiers, per_tier)]
        blocks = self.pool.allocate(len(loads))
        pairs = [list(zip(s, [b.block_id for (t, _), b in zip(loads, blocks) if t == i]))
                 for i, s in enumerate(slots)]
        tiers = self.tiers
        job = LoadJob(request_id, loads, blocks, len(cached))

        def copy() -> list[float]:  # bytes only: it may run on the loader thread
            return [t.copy(p) for t, p in zip(tiers, pairs)]

        inline = self.load_inline(cached)
        job.future = TierLoader.run_here(copy) if inline else self.loader.submit(copy)
        if inline:
            self.loads_inline += 1
        else:
            self.loads_async += 1
        self._in_flight.update(h for _, h in loads)
        if inline and job.future.exception() is None:  # copied here and fine: cached now
            self._end_load(job)
            self._num_cached[request_id] = job.num_prefix
        else:  # on the loader thread, or an inline copy that failed: reported by the next poll
            self._jobs[request_id] = job
        return blocks

    def is_loading(self, request_id: str) -> bool:
        """Its tier copy started and has not been polled yet: it must not compute."""
        return request_id in self._jobs

    @property
    def num_loading(self) -> int:
        return len(self._jobs) + len(self._orphans)

    def loads_conflict(self, cached: CachedPrefix) -> bool:
        """Some of these loads are being copied in for another request: wait for that copy."""
        return bool(self._in_flight) and any(h in self._in_flight for _, h in cached.loads)

    def wait_loads(self, timeout: float) -> None:
        """Block until a copy finishes or `timeout` passes (an engine with nothing else to do)."""
        futures = [j.future for j in [*self._jobs.values(), *self._orphans]]
        if futures:
            cf.wait(futures, timeout, return_when=cf.FIRST_COMPLETED)

    def poll_loads(self) -> list[tuple[str, bool]]:
        """Finish the copies that are over: (request id, ok) for each live request's. A finished
        copy's blocks are cached under their hashes; a failed copy's hashes leave their tier and
        its blocks stay uncached (the caller frees them and recomputes)."""
        done = []
        for job in [j for j in self._jobs.values() if j.future.done()]:
            del self._jobs[job.request_id]
            ok = self._end_load(job)
            if ok:
                self._num_cached[job.request_id] = job.num_prefix
            done.append((job.request_id, ok))
        for job in [j for j in self._orphans if j.future.done()]:
            self._orphans.remove(job)
            self._end_load(job)
            self.release_quarantine(job.quarantine)
        return done

    def _end_load(self, job: LoadJob) -> bool:
        error = job.future.exception()
        seconds = job.future.result() if error is None else [0.0] * len(self.tiers)
        for i, tier in enumerate(self.tiers):
            tier.end_load([h for t, h in job.loads if t == i], seconds[i], ok=error is None)
        self._in_flight.difference_update(h for _, h in job.loads)
        if error is not None:
            log.warning("KV tier load for %s failed (%s: %s); its prefix is recomputed",
                        job.request_id, type(error).__name__, error)
            return False
        for b, (_, h) in zip(job.blocks, job.loads):
            self.pool.cache(b, h)  # False if another request computed it meanwhile: stays uncached
        return True

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
        # Most calls (a decode step's) fill no block: one dict read, no table read.
        start = self._num_cached.get(req.request_id, 0)
        if num_computed_tokens // self.block_size <= start:
            return
        blocks = self._blocks.get(req.request_id)
        if not blocks:
            return
        end = min(num_computed_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        hashes = self.update_hashes(req)
        for i in range(start, end):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached[req.request_id] = end

    def free_leading(self, request_id: str, n: int) -> int:
        """Give the first `n` blocks of a request's table back to the pool (cached ones stay
        cached): a lease now served from the host tier keeps only its tail. Returns how many."""
        blocks = self._blocks.get(request_id, [])
        head, self._blocks[request_id] = blocks[:n], blocks[n:]
        self._num_cached[request_id] = 0  # the table no longer starts with its cached run
        self.pool.free(reversed(head))
        return len(head)

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
        """Release a request's blocks, tail first (a prompt's end is evicted before its prefix).
        Blocks a tier copy is still writing are quarantined until it finishes."""
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job.quarantine = self.quarantine(request_id, {b.block_id for b in job.blocks})
            self._orphans.append(job)
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
        """Cached blocks at the start of a prompt whose KV comes from elsewhere (no compute cap):
        the device pool's, then the tiers' (loaded here instead of pulled). Loads another request
        is copying in end the run (those blocks are pulled)."""
        if not self.pool.enable_caching:
            return NO_PREFIX
        prefix = self._match(hashes)
        if self.loads_conflict(prefix):
            loads = prefix.loads
            n = next(i for i, (_, h) in enumerate(loads) if h in self._in_flight)
            prefix = CachedPrefix(prefix.blocks, loads[:n])
        return prefix

    def close(self) -> None:
        """Stop the loader thread (after its copy in progress)."""
        self.loader.close()

    def reset_cache(self) -> int:
        """Forget every unreferenced cached block, in the pool and every tier. Returns how many."""
        return self.pool.reset_cache() + sum(t.reset() for t in self.tiers)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        for tier in self.tiers:
            tier.check_invariants()
        if not self._in_flight == {h for j in [*self._jobs.values(), *self._orphans] for _, h in j.loads}:
            raise AssertionError("hashes in flight do not match the copies in progress")
        refs: dict[int, int] = {}
        for blocks in [*self._blocks.values(), *self._quarantines.values()]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if refs.get(block.block_id, 0) != block.ref_cnt:
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} holders"
                )
