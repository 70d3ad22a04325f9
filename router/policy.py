"""The routing policy: one cost per candidate replica, in tokens of work; lowest wins.

    prefill cost(r) = uncached prompt tokens on r + r's queued prefill tokens
    decode cost(r)  = decode_request_cost * requests on r + decode_block_cost * blocks in use on r

Adjustments, each visible in the decision's reason:
- a replica whose recent step time is >= slow_factor x the median of the rest of its pool is
  deprioritised (its cost is multiplied by slow_penalty, plus one token so it loses ties at zero);
- a replica already at hot_load_cap requests gets no credit for its cache, so a hot prefix
  spreads to a second replica instead of piling onto one;
- local prefill: when the chosen decode replica lacks fewer than local_prefill_threshold prompt
  tokens (or there is no prefill pool), the decode replica prefills them itself.
- colocated (no prefill pool): every decode replica would compute the prompt, so its cost adds the
  prefill cost: uncached prompt tokens on it + its queued prefill tokens (prefix-aware routing).
Ties are broken at random (an injected RNG). Plain Python: no Ray, no clock of its own.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Literal, Sequence

from cluster.engine.kv_cache.hashing import BlockHash
from router.index import PrefixIndex


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    pool: Literal["prefill", "decode"]
    free_blocks: int
    total_blocks: int
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    step_time_s: float = 0.0  # smoothed over recent steps (the slow-replica signal)
    tokens_per_s: float = 0.0  # recent throughput while busy (0: not measured yet)
    failing: bool = False  # its last engine step failed: chosen only when every replica of its pool is

    def queue_wait_s(self) -> float:
        """Predicted wait before a new prompt starts here: its queued prompt tokens at its pace."""
        return self.queued_prefill_tokens / self.tokens_per_s if self.tokens_per_s > 0 else 0.0

    @property
    def requests(self) -> int:
        return self.running + self.waiting

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


@dataclass(frozen=True)
class PolicyConfig:
    block_size: int = 16
    local_prefill_threshold: int = 64  # tokens: below this, decode prefills the rest itself
    decode_request_cost: float = 32.0  # tokens of work one running request costs a decode replica
    decode_block_cost: float = 1.0
    slow_factor: float = 2.0
    slow_penalty: float = 4.0
    hot_load_cap: int = 32  # requests on a replica past which its cache earns no credit


@dataclass(frozen=True)
class RouteDecision:
    prefill: str | None  # None: local prefill on the decode replica
    decode: str
    mode: Literal["remote", "local"]
    predicted_cached_tokens: int
    reason: str
    queue_wait_s: float = 0.0  # predicted wait before the prompt starts on the replica computing it


class NoReplicaError(RuntimeError):
    pass


class RoutingPolicy:
    def __init__(self, config: PolicyConfig = PolicyConfig(), rng: random.Random | None = None):
        self.config = config
        self.rng = rng or random.Random()

    def route(
        self,
        hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        index: PrefixIndex,
        loads: Sequence[ReplicaLoad],
    ) -> RouteDecision:
        cfg = self.config
        decodes = [r for r in loads if r.pool == "decode"]
        prefills = [r for r in loads if r.pool == "prefill"]
        if not decodes:
            raise NoReplicaError("no decode replica")
        slow = self._slow(decodes) | self._slow(prefills)

        dec_cached = index.prefix_blocks(hashes, [r.replica_id for r in decodes])

        def decode_cost(r: ReplicaLoad) -> float:
            cost = cfg.decode_request_cost * r.requests + cfg.decode_block_cost * r.used_blocks
            if not prefills:  # colocated: the decode replica computes the prompt too
                cost += (num_prompt_tokens - self._cached_tokens(dec_cached[r.replica_id], r, num_prompt_tokens)
                         + r.queued_prefill_tokens)
            return cost

        decode, reasons = self._pick(decodes, decode_cost, slow)
        cached_on_decode = self._cached_tokens(dec_cached[decode.replica_id], decode, num_prompt_tokens)
        missing = num_prompt_tokens - cached_on_decode
        if not prefills or missing < cfg.local_prefill_threshold:
            why = "no prefill pool" if not prefills else f"local prefill: {missing} uncached tokens"
            return RouteDecision(None, decode.replica_id, "local", cached_on_decode, "; ".join([why, *reasons]),
                                 decode.queue_wait_s())

        pre_cached = index.prefix_blocks(hashes, [r.replica_id for r in prefills])
        hot = set()

        def prefill_cost(r: ReplicaLoad) -> float:
            cached = self._cached_tokens(pre_cached[r.replica_id], r, num_prompt_tokens)
            if cached and r.requests >= cfg.hot_load_cap:
                hot.add(r.replica_id)
                cached = 0
            return num_prompt_tokens - cached + r.queued_prefill_tokens

        prefill, p_reasons = self._pick(prefills, prefill_cost, slow)
        cached = self._cached_tokens(pre_cached[prefill.replica_id], prefill, num_prompt_tokens)
        if prefill.replica_id in hot:
            cached = 0
        why = ["cache" if cached else "load"]
        if hot:
            why.append(f"hot prefix spread past cap on {sorted(hot)}")
        return RouteDecision(prefill.replica_id, decode.replica_id, "remote", cached,
                             "; ".join([*why, *p_reasons, *reasons]), prefill.queue_wait_s())

    def _cached_tokens(self, blocks: int, replica: ReplicaLoad, num_prompt_tokens: int) -> int:
        # An engine always computes at least the last prompt token itself.
        return min(blocks * self.config.block_size, num_prompt_tokens - 1)

    def _slow(self, pool: Sequence[ReplicaLoad]) -> set[str]:
        """Replicas stepping >= slow_factor x the median of the others (leave-one-out: with a
        pool median that includes the replica itself, one slow replica of two is never found)."""
        measured = [r for r in pool if r.step_time_s > 0]
        if len(measured) < 2:
            return set()
        slow = set()
        for r in measured:
            others = statistics.median(o.step_time_s for o in measured if o is not r)
            if r.step_time_s >= self.config.slow_factor * others:
                slow.add(r.replica_id)
        return slow

    def _pick(self, pool: Sequence[ReplicaLoad], cost, slow: set[str]) -> tuple[ReplicaLoad, list[str]]:
        working = [r for r in pool if not r.failing]
        failing = sorted(r.replica_id for r in pool if r.failing)
        if working and failing:  # an idle replica whose steps fail would otherwise look cheapest
            choice, reasons = self._pick(working, cost, slow)
            return choice, [*reasons, f"failing replica avoided: {', '.join(failing)}"]
        raw = {r.replica_id: cost(r) for r in pool}
        costs = {rid: c * self.config.slow_penalty + 1.0 if rid in slow else c for rid, c in raw.items()}
        choice = self._argmin(costs)
        unpenalised = min(raw, key=lambda rid: (raw[rid], rid))
        reasons = []
        if unpenalised in slow and raw[unpenalised] < raw[choice]:
            reasons.append(f"slow replica avoided: {unpenalised}")
        return next(r for r in pool if r.replica_id == choice), reasons

    def _argmin(self, costs: dict[str, float]) -> str:
        best = min(costs.values())
        tied = sorted(rid for rid, c in costs.items() if c == best)
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)
