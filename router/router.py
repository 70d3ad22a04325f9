"""The router's state and entry points: a plain class (the Ray actor in router/actor.py is a
thin shell over it). Replicas feed it block events and load; the ingress asks it for decisions."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from cluster.kv_cache.hashing import BlockHash
from router.index import PrefixIndex
from router.policy import PolicyConfig, ReplicaLoad, RouteDecision, RoutingPolicy


@dataclass(frozen=True)
class RouterStats:
    replicas: int
    tracked_blocks: int
    decisions: int
    resyncs_requested: int


class Router:
    def __init__(self, policy: RoutingPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 stale_after_s: float = 10.0):
        self.index = PrefixIndex()
        self.policy = policy or RoutingPolicy(PolicyConfig())
        self.clock = clock
        self.stale_after_s = stale_after_s
        self._loads: dict[str, tuple[float, ReplicaLoad]] = {}
        self._decisions = 0
        self._resyncs = 0

    def configure(self, config: PolicyConfig) -> None:
        self.policy.config = config

    def events(self, replica_id: str, incarnation: str, seq: int,
               events: Sequence[tuple[str, BlockHash]]) -> bool:
        """One ordered batch of a replica's block events. False: send a full snapshot (resync)."""
        ok = self.index.apply(replica_id, incarnation, seq, events)
        self._resyncs += not ok
        return ok

    def resync(self, replica_id: str, incarnation: str, seq: int, hashes: Sequence[BlockHash]) -> None:
        self.index.resync(replica_id, incarnation, seq, hashes)

    def report_load(self, load: ReplicaLoad) -> None:
        self._loads[load.replica_id] = (self.clock(), load)

    def forget(self, replica_id: str) -> None:
        """A replica is gone: no more decisions name it."""
        self.index.forget(replica_id)
        self._loads.pop(replica_id, None)

    def live_loads(self) -> list[ReplicaLoad]:
        now = self.clock()
        for rid, (t, _) in list(self._loads.items()):
            if now - t > self.stale_after_s:  # silent for too long: treat as dead
                self.forget(rid)
        return [load for _, load in self._loads.values()]

    def route(self, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> RouteDecision:
        self._decisions += 1
        return self.policy.route(hashes, num_prompt_tokens, self.index, self.live_loads())

    def hashes(self, replica_id: str) -> set[BlockHash]:
        return self.index.hashes(replica_id)

    def stats(self) -> RouterStats:
        return RouterStats(len(self.index.replicas()), sum(self.index.num_blocks(r) for r in self.index.replicas()),
                           self._decisions, self._resyncs)
