"""Baseline strategies for comparison (benchmarks, or `routing.strategy` in the app config):
same interface as RoutingPolicy, no cache awareness. Always remote prefill when a pool exists."""

from __future__ import annotations

import random
from typing import Sequence

from cluster.engine.kv_cache.hashing import BlockHash
from router.index import PrefixIndex
from router.policy import NoReplicaError, PolicyConfig, ReplicaLoad, RouteDecision, SessionHint, split_pools


class _Baseline:
    name = "baseline"

    def __init__(self, config: PolicyConfig = PolicyConfig(), rng: random.Random | None = None):
        self.config = config
        self.rng = rng or random.Random()

    def route(self, hashes: Sequence[BlockHash], num_prompt_tokens: int, index: PrefixIndex,
              loads: Sequence[ReplicaLoad], session: SessionHint | None = None) -> RouteDecision:
        """`session` is not used: a baseline knows nothing of caches, sessions included."""
        prefills, decodes = (sorted(pool, key=lambda r: r.replica_id) for pool in split_pools(loads))
        if not decodes:
            raise NoReplicaError("no decode replica")
        decode = self.pick("decode", decodes)
        if not prefills:
            return RouteDecision(None, decode.replica_id, "local", 0, f"{self.name}; no prefill pool",
                                 decode_deployment=decode.deployment)
        prefill = self.pick("prefill", prefills)
        blocks = index.prefix_blocks(hashes, [prefill.replica_id])[prefill.replica_id]
        cached = min(blocks * self.config.block_size, num_prompt_tokens - 1)
        dec_blocks = index.prefix_blocks(hashes, [decode.replica_id])[decode.replica_id]
        return RouteDecision(prefill.replica_id, decode.replica_id, "remote", cached, self.name,
                             decode_cached_tokens=min(dec_blocks * self.config.block_size, num_prompt_tokens - 1),
                             prefill_deployment=prefill.deployment, decode_deployment=decode.deployment)

    def pick(self, pool: str, replicas: list[ReplicaLoad]) -> ReplicaLoad:
        raise NotImplementedError


class RoundRobinPolicy(_Baseline):
    name = "round robin"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._next = {"prefill": 0, "decode": 0}

    def pick(self, pool, replicas):
        i = self._next[pool] % len(replicas)
        self._next[pool] = i + 1
        return replicas[i]


class PowerOfTwoPolicy(_Baseline):
    name = "power of two"

    def pick(self, pool, replicas):
        pair = replicas if len(replicas) <= 2 else self.rng.sample(replicas, 2)
        key = (lambda r: (r.queued_prefill_tokens, r.requests)) if pool == "prefill" else (lambda r: r.requests)
        return min(pair, key=key)
