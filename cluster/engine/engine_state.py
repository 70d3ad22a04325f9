"""The engine's state as others read it, mixed into LLMEngine: load reports (the router weighs a
replica's queue against a cache hit), the router's feed of block events and snapshots, the tiers'
occupancy for telemetry. Read from the loop thread between steps; nothing here changes a request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.engine.kv_cache import BlockHash, TierUsage
from cluster.engine.outputs import EngineLoad

if TYPE_CHECKING:
    from cluster.engine.kv_cache import KVCacheManager
    from cluster.engine.scheduler import Scheduler

QUEUE_CACHE_LOOKUPS = 32  # waiting requests whose cached prefix a load report looks up


class EngineState:
    """Mixed into LLMEngine (its kv and scheduler)."""

    kv: KVCacheManager
    scheduler: Scheduler

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(
            free_blocks=self.kv.num_free_blocks, total_blocks=self.kv.num_blocks,
            running=len(s.running), waiting=len(s.waiting), importing=len(s.importing) + len(s.loading),
            held=len(s.leased),
            queued_prefill_tokens=self._queued_prompt_tokens(),
            running_prompt_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in s.running),
            quarantined_blocks=self.kv.num_quarantined_blocks,
        )

    def _queued_prompt_tokens(self) -> int:
        """Prompt tokens the waiting requests will compute. The router weighs a replica's queue
        against a cache hit, so a waiting request counts only what its cached prefix does not
        cover (else one queued hit reads as a miss). Loads are reported up to 50 times a second
        from the loop thread: only the first QUEUE_CACHE_LOOKUPS requests are looked up (~70
        dict lookups each); the rest count in full."""
        total = 0
        for i, r in enumerate(self.scheduler.waiting):
            covered = self.kv.cached_prefix_tokens(r) if i < QUEUE_CACHE_LOOKUPS else 0
            total += r.num_tokens - max(r.num_computed_tokens, covered)
        return total

    def queue_shape(self) -> tuple[int, int, int]:
        """(waiting, running, importing): cheap, for noticing that the queues changed."""
        s = self.scheduler
        return len(s.waiting), len(s.running), len(s.importing) + len(s.loading)

    def tier_usage(self) -> list[TierUsage]:
        """The KV tiers below the pool (host, then disk): occupancy and counters."""
        return [t.usage() for t in self.kv.tiers]

    def drain_block_events(self) -> list:
        """Block stored/removed events since the last call, in order (the router's feed): the
        device pool's ("+" / "-", hash), then each lower tier's, its level appended to the kind
        ("+1" / "-1": host, "+2" / "-2": disk)."""
        events = self.kv.pool.drain_events()
        for level, tier in enumerate(self.kv.tiers, start=1):
            events += [(f"{kind}{level}", h) for kind, h in tier.drain_events()]
        return events

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.kv.pool.cached_hashes()

    def tier_block_hashes(self) -> list[list[BlockHash]]:
        """Each lower tier's held hashes, top down (host, disk): with the pool's, a full snapshot."""
        return [tier.hashes() for tier in self.kv.tiers]

    def reset_prefix_cache(self) -> None:
        self.kv.reset_cache()
