"""The engine's verbs for each side of a disaggregated request, mixed into LLMEngine: the prefill
role's (a finished prompt's blocks held for a peer, served from the device or the host tier, and
kept out of the pool while a transfer may still touch them) and the decode role's (a prompt's KV
imported from a peer, or computed here after tokens produced elsewhere). A role calls these verbs
and never reaches into the engine's scheduler or cache (docs/architecture.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Sequence

import torch

from cluster.engine.kv_cache import BlockHash
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import Request

if TYPE_CHECKING:
    from cluster.engine.kv_cache import KVCacheManager
    from cluster.engine.output_processor import OutputProcessor
    from cluster.engine.outputs import EngineStats
    from cluster.engine.scheduler import Scheduler


class PrefillVerbs:
    """Blocks held for a peer. Mixed into LLMEngine (its kv, scheduler, config, block_size)."""

    kv: KVCacheManager
    scheduler: Scheduler
    block_size: int

    def held(self, request_id: str) -> Request | None:
        """A finished request whose blocks are held (added with hold_kv), or None."""
        return self.scheduler.leased.get(request_id)

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (its transfer is done, or its lease ended)."""
        return self.scheduler.release(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.block_ids(request_id)

    def host_arena(self) -> torch.Tensor | None:
        """The host tier's arena when leases are served from it (kv_tiers.lease_from_host): what
        the transport registers for peers to read."""
        host = self.kv.host
        return host.copier.host if host is not None and self.config.kv_tiers.lease_from_host else None

    def lease_from_host(self, req: Request) -> tuple[list[int], list[BlockHash]] | None:
        """Serve a held request's full prompt blocks from the host tier: each is written there
        unless already held, all are pinned, and their device blocks go back to the pool now.
        Returns (the handle's block ids: num_blocks + slot for those, then the device ids of the
        rest; the pinned hashes, for `unpin_host` when the lease ends), or None when the tier could
        not take them all (every slot pinned): the lease stays on the device."""
        host, ids = self.kv.host, self.kv.block_ids(req.request_id)
        hashes = self.full_block_hashes(req)
        if host is None or not hashes:
            return None
        host.write_through(list(zip(ids, hashes)))
        if not all(h in host for h in hashes):  # a store was dropped, or pushed an earlier one down
            return None
        host.pin(hashes)
        served = [self.kv.num_blocks + host.slot_of(h) for h in hashes]
        self.kv.free_leading(req.request_id, len(hashes))
        return served + ids[len(hashes):], hashes

    def unpin_host(self, hashes: Sequence[BlockHash]) -> None:
        """A lease served from the host tier ended (and its grace, if any): its slots may go."""
        self.kv.host.unpin(hashes)

    # ---- quarantine: blocks an unsettled transfer may still write or read ----------------------

    def quarantine(self, request_id: str, block_ids: Collection[int] | None = None) -> int:
        """Keep the request's blocks in `block_ids` (all when None) out of the pool until
        `release_quarantine(token)`, whatever happens to the request. Call it just before ending
        the request (abort, requeue, release), which frees its other blocks. Token 0: none moved."""
        return self.kv.quarantine(request_id, block_ids)

    def release_quarantine(self, token: int) -> int:
        """The transfer settled (done, failed, cancelled or past its grace): the blocks go back."""
        return self.kv.release_quarantine(token)

    def full_block_hashes(self, req: Request) -> list[BlockHash]:
        """The chained hashes of a request's full prompt blocks (what a peer may already cache)."""
        return self.kv.update_hashes(req)[: req.num_prompt_tokens // self.block_size]


class DecodeVerbs:
    """A prompt's KV imported from a peer, or computed here. Mixed into LLMEngine (its kv,
    scheduler, stats, output_processor and `add`)."""

    kv: KVCacheManager
    scheduler: Scheduler
    stats: EngineStats
    output_processor: OutputProcessor

    def import_request(self, req: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                       first_token: int) -> int | None:
        """Admit a request whose first `num_tokens` tokens' KV arrives from a peer, after which
        it continues from `first_token` (sampled there). Takes this engine's cached prefix and
        allocates the rest: returns how many leading blocks were cached here, or None when the
        pool has no room (then nothing changed). Its prompt's logprobs came with the first token."""
        req.prompt_logprobs = None
        reused = self.scheduler.add_importing(req, block_hashes, num_tokens)
        if reused is not None:
            self.stats.requests_received += 1
            self.output_processor.add(req, list(req.prompt_token_ids) + [first_token])
        return reused

    def import_loading(self, request_id: str) -> bool:
        """An importing request's prefix from this engine's own tiers is still copying in."""
        return self.kv.is_loading(request_id)

    def import_load_failed(self, request_id: str) -> bool:
        """An importing request's own tier copy failed: its prompt must be recomputed (requeue)."""
        return request_id in self.scheduler.failed_import_loads

    def activate(self, request_id: str, num_tokens: int, first_token: int) -> RequestOutput | None:
        """The imported KV has arrived: the request joins continuous batching after its first
        token. Returns its terminal output if that token already ends it (max_tokens 1, a stop)."""
        req = self.scheduler.activate_imported(request_id, num_tokens, first_token)
        return self.output_processor.final_output(req, [], "") if req.status.finished else None

    def requeue(self, request_id: str, first_token: int) -> None:
        """The import failed: compute the prompt here instead, keeping the first token."""
        self.scheduler.requeue_imported(request_id, first_token)

    def add_after_first_token(self, req: Request, first_token: int) -> None:
        """Queue a request whose first token was sampled elsewhere: its prompt is computed here
        and it continues after that token (decode without room to import)."""
        self.add_after_tokens(req, [first_token])

    def add_after_tokens(self, req: Request, generated: Sequence[int]) -> None:
        """Queue a request whose first output tokens were produced elsewhere (a first token from
        prefill, or a migrated request's tokens already sent): prompt and those tokens are
        computed here, and it continues after them. They count as its output: max_tokens,
        min_tokens and the penalties see them as the request's own. The prompt's logprobs, if
        asked, went out with those tokens."""
        req.prompt_logprobs = None
        for t in generated:
            req.append_token(t)
        self.add(req)
        self.output_processor.add(req, list(req.prompt_token_ids) + list(generated))
