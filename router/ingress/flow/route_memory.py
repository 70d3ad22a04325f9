"""What the ingress remembers of its router's decisions, for when the router cannot answer.

While a router restarts (killed, its node lost: about a second on this machine), Serve's own
choice sends a prefix to a replica that lacks it; on a capacity-bound pool those misses evict
prefixes the router sends there next, and the hit rate takes seconds more to come back than the
router does (docs/benchmarks.md, "A router killed under load"). The ingress already knew where each
prefix went: the last decision made for a request with the same first block (or the same session
key) names the replicas that hold it. During the outage those replicas are asked again.

A remembered decision is only a replica choice, never a prediction: its queue wait and queue
length are zeroed (admission must not refuse on a stale reading), and it is labelled
`remembered`. A replica that left since is no harm: Serve's request router falls back to its own
choice when the target is gone (router/serve_router.py), and a replica whose role flipped refuses
before starting (the legs then reroute)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Hashable, Sequence

from router.policy import RouteDecision

REMEMBERED = "remembered"  # the reason a recalled decision carries (its route_decisions label)


class RouteMemory:
    """The last decision per first block hash and per session key, least recently used out."""

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._last: OrderedDict[Hashable, RouteDecision] = OrderedDict()

    @staticmethod
    def _keys(hashes: Sequence[bytes], session: str | None) -> list[Hashable]:
        keys: list[Hashable] = []
        if session is not None:
            keys.append(("session", session))
        if hashes:  # a prompt shorter than a block has none: nothing to keep it near
            keys.append(hashes[0])
        return keys

    def remember(self, hashes: Sequence[bytes], session: str | None, decision: RouteDecision) -> None:
        for key in self._keys(hashes, session):
            self._last[key] = decision
            self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def recall(self, hashes: Sequence[bytes], session: str | None) -> RouteDecision | None:
        """The decision last made for this session, else for this first block; None: neither seen."""
        for key in self._keys(hashes, session):
            decision = self._last.get(key)
            if decision is not None:
                self._last.move_to_end(key)
                return dataclasses.replace(decision, reason=f"{REMEMBERED} ({decision.reason})", queue_wait_s=0.0,
                                           queue_ahead=0)
        return None

    def __len__(self) -> int:
        return len(self._last)
