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
before starting (the legs then reroute).

The same memory brings a session back to a restarted router: every route call of a session carries
`carried(session, now)`, the replicas last chosen for it (a local-prefill turn keeps the prefill
replica before it, as the router's table does) and their age, and a router with no entry for the
session adopts them (router/sessions.py says why this and not a store)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Hashable, Sequence

from router.policy import RouteDecision
from router.sessions import Carried, session_prefill

REMEMBERED = "remembered"  # the reason a recalled decision carries (its route_decisions label)


class RouteMemory:
    """The last decision per first block hash and, apart, per session key (with the session's
    prefill replica and when), each least recently used out past `capacity`."""

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, RouteDecision] = OrderedDict()
        # session key -> (its last decision, its prefill replica (kept over a local turn), when: monotonic)
        self._sessions: OrderedDict[str, tuple[RouteDecision, str | None, float]] = OrderedDict()

    def remember(self, hashes: Sequence[bytes], session: str | None, decision: RouteDecision, now: float) -> None:
        """A decision the router made; `now`: monotonic (the age `carried` reports)."""
        if hashes:  # a prompt shorter than a block has none: nothing to keep it near
            self._put(self._blocks, hashes[0], decision)
        if session is not None:
            old = self._sessions.get(session)
            prefill = session_prefill(decision, old[1] if old else None)
            self._put(self._sessions, session, (decision, prefill, now))

    def _put(self, entries: OrderedDict, key: Hashable, value) -> None:
        entries[key] = value
        entries.move_to_end(key)
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def recall(self, hashes: Sequence[bytes], session: str | None) -> RouteDecision | None:
        """The decision last made for this session, else for this first block; None: neither seen."""
        decision = None
        if session is not None and session in self._sessions:
            self._sessions.move_to_end(session)
            decision = self._sessions[session][0]
        elif hashes and hashes[0] in self._blocks:
            self._blocks.move_to_end(hashes[0])
            decision = self._blocks[hashes[0]]
        if decision is None:
            return None
        return dataclasses.replace(decision, reason=f"{REMEMBERED} ({decision.reason})", queue_wait_s=0.0,
                                   queue_ahead=0)

    def carried(self, session: str | None, now: float) -> Carried | None:
        """What a session's route call carries (router/sessions.py Carried): the replicas last chosen
        for it and the seconds since; None without a session or for one never routed here."""
        entry = None if session is None else self._sessions.get(session)
        return None if entry is None else (entry[1], entry[0].decode, now - entry[2])

    def __len__(self) -> int:
        return len(self._blocks) + len(self._sessions)
