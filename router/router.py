"""The router's state and entry points: a plain class (the Ray actor in router/actor.py is a
thin shell over it). Replicas feed it block events and load; the ingress asks it for decisions."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from cluster.engine.kv_cache.hashing import BlockHash
from router.baselines import PowerOfTwoPolicy, RoundRobinPolicy
from router.index import PrefixIndex
from router.policy import NoReplicaError, PolicyConfig, ReplicaLoad, RouteDecision, RoutingPolicy, SessionHint
from router.sessions import Carried, SessionTable


# A cell's answers other than a decision (Router.route with spill_at): ask the next cell.
EMPTY = "empty"  # no replica here can take the request
HOT = "hot"  # the replica chosen to compute the prompt holds spill_at requests or more

STRATEGIES = {"cost": RoutingPolicy, "round_robin": RoundRobinPolicy, "power_of_two": PowerOfTwoPolicy}


@dataclass(frozen=True)
class RouterStats:
    replicas: int
    tracked_blocks: int
    decisions: int
    resyncs_requested: int
    sessions: int
    spilled: int = 0  # decisions answered HOT (a cell's router: the ingress asked the next cell)


@dataclass(frozen=True)
class FeedView:
    """How fresh this router's view of one replica is. `staleness_s`: when its last feed call
    arrived, the age of the oldest change that call carried (wall clocks: across nodes, as good
    as their sync); `heard_s_ago`: since that call arrived."""

    replica_id: str
    calls: int
    staleness_s: float
    max_staleness_s: float
    heard_s_ago: float


class Router:
    def __init__(self, policy: RoutingPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 stale_after_s: float = 3.0):
        self.index = PrefixIndex()
        self.policy = policy or RoutingPolicy(PolicyConfig())
        self.clock = clock
        self.stale_after_s = stale_after_s
        self._loads: dict[str, tuple[float, ReplicaLoad]] = {}
        # Work this router sent to a replica since that replica's last load report: without it,
        # every decision between two reports sees the same stale queues and piles onto one replica.
        self._pending_tokens: dict[str, int] = {}
        self._pending_requests: dict[str, int] = {}
        self._decisions = 0
        self._resyncs = 0
        self._spilled = 0
        self._feeds: dict[str, list] = {}  # replica -> [calls, last staleness, max staleness, arrived at]
        self.sessions = self._session_table(self.policy.config)
        # The last decisions with the loads they saw (pending work included): why a prompt went where.
        self._recent: deque[tuple[RouteDecision, tuple[ReplicaLoad, ...]]] = deque(maxlen=32)

    def configure(self, config: PolicyConfig, strategy: str = "cost") -> None:
        """Set the policy (the ingress does, from the app config). Idempotent: the same
        arguments again give the same policy."""
        if strategy not in STRATEGIES:
            raise ValueError(f"routing strategy {strategy!r} is unknown (choose from {sorted(STRATEGIES)})")
        self.policy = STRATEGIES[strategy](config, self.policy.rng)
        if (config.max_sessions, config.session_ttl_s) != (self.sessions.max_sessions, self.sessions.ttl_s):
            self.sessions = self._session_table(config)

    @staticmethod
    def _session_table(config: PolicyConfig) -> SessionTable:
        return SessionTable(config.max_sessions, config.session_ttl_s)

    def policy_settings(self) -> tuple[PolicyConfig, str]:
        """(config, strategy) of the policy in use."""
        return self.policy.config, next(k for k, cls in STRATEGIES.items() if type(self.policy) is cls)

    def events(self, replica_id: str, incarnation: str, seq: int,
               events: Sequence[tuple[str, BlockHash]]) -> bool:
        """One ordered batch of a replica's block events. False: send a full snapshot (resync)."""
        ok = self.index.apply(replica_id, incarnation, seq, events)
        self._resyncs += not ok
        return ok

    def resync(self, replica_id: str, incarnation: str, seq: int, hashes: Sequence[BlockHash],
               tiers: Sequence[Sequence[BlockHash]] = ()) -> None:
        """A replica's full snapshot: its device pool's hashes and each lower tier's (host, disk)."""
        self.index.resync(replica_id, incarnation, seq, hashes, tiers)

    def feed(self, replica_id: str, incarnation: str, seq: int, events: Sequence[tuple[str, BlockHash]] | None,
             load: ReplicaLoad, snapshot: tuple[Sequence[BlockHash], Sequence[Sequence[BlockHash]]] | None = None,
             changed_at: float | None = None) -> bool:
        """A replica's one call per interval (router/events.py): its block events since its last
        call (None: none) or a full `snapshot` (device hashes, each lower tier's), and its load.
        `changed_at`: wall-clock time of the oldest change the call carries (None: a heartbeat).
        False: the events were refused; send a snapshot (the load is taken either way)."""
        ok = True
        if snapshot is not None:
            self.resync(replica_id, incarnation, seq, *snapshot)
        elif events:
            ok = self.events(replica_id, incarnation, seq, events)
        self.report_load(load)
        view = self._feeds.setdefault(replica_id, [0, 0.0, 0.0, 0.0])
        view[0] += 1
        view[3] = self.clock()
        if changed_at is not None:
            view[1] = max(time.time() - changed_at, 0.0)
            view[2] = max(view[2], view[1])
        return ok

    def feed_views(self) -> list[FeedView]:
        """Each fed replica's view freshness (`pdserve status`, the router's metrics)."""
        now = self.clock()
        return [FeedView(rid, v[0], v[1], v[2], now - v[3]) for rid, v in sorted(self._feeds.items())]

    def report_load(self, load: ReplicaLoad) -> None:
        self._loads[load.replica_id] = (self.clock(), load)
        self._pending_tokens.pop(load.replica_id, None)  # the report now counts that work
        self._pending_requests.pop(load.replica_id, None)

    def forget(self, replica_id: str) -> None:
        """A replica is gone: no more decisions name it."""
        self.index.forget(replica_id)
        self._feeds.pop(replica_id, None)
        self._loads.pop(replica_id, None)
        self._pending_tokens.pop(replica_id, None)
        self._pending_requests.pop(replica_id, None)

    def live_loads(self) -> list[ReplicaLoad]:
        now = self.clock()
        for rid, (t, _) in list(self._loads.items()):
            if now - t > self.stale_after_s:  # silent for too long: treat as dead
                self.forget(rid)
        return self._fresh_loads(now)

    def _fresh_loads(self, now: float) -> list[ReplicaLoad]:
        """The loads reported within stale_after_s of `now`, forgetting nothing (what `live_loads`
        returns once it has forgotten the others)."""
        return [load for t, load in self._loads.values() if now - t <= self.stale_after_s]

    def route(self, hashes: Sequence[BlockHash], num_prompt_tokens: int, session: str | None = None,
              group: str | None = None, spill_at: int | None = None,
              carried: Carried | None = None) -> RouteDecision | str:
        """`session`: the request's session key (tenant-scoped by the ingress), if it has one: the
        replicas that served the session last are preferred while their load allows. `carried`:
        the replicas the ingress last saw chosen for the session; a router with no entry for it
        (restarted) adopts them (router/sessions.py, `_adoptable`). `group`: the
        model version the request was assigned (None: every replica): both of its replicas are
        chosen among that version's, so prefill and decode never run on two versions.

        `spill_at` (a cell's router, asked first: router/cells.py): HOT instead of a decision when
        the replica chosen to compute the prompt holds at least this many requests (pending ones
        included), EMPTY when this router knows no replica that can take the request; either way
        nothing is recorded and the ingress asks the next cell. Without it, no replica raises NoReplicaError."""
        self._decisions += 1
        now = self.clock()
        loads = self._loads_now(group)
        hint = adopted = None
        if session is not None:
            hint = self.sessions.get(session, now)
            if hint is None and carried is not None:
                hint = adopted = self._adoptable(carried, loads)
        try:
            d = self.policy.route(hashes, num_prompt_tokens, self.index, loads, hint)
        except NoReplicaError:
            if spill_at is None:
                raise
            return EMPTY
        if spill_at is not None and self._hot(d, loads, spill_at):
            self._spilled += 1
            return HOT
        if session is not None:
            if adopted is not None:  # what a local-prefill turn keeps of it: its prefill replica
                self.sessions.adopt(session, adopted, now)
            self.sessions.record(session, d, now)
        self._recent.append((d, tuple(loads)))
        computed_at = d.prefill if d.mode == "remote" else d.decode
        self._pending_tokens[computed_at] = (self._pending_tokens.get(computed_at, 0)
                                             + num_prompt_tokens - d.predicted_cached_tokens)
        for rid in {computed_at, d.decode}:
            self._pending_requests[rid] = self._pending_requests.get(rid, 0) + 1
        return d

    def price(self, hashes: Sequence[BlockHash], num_prompt_tokens: int, session: str | None = None,
              group: str | None = None, carried: Carried | None = None) -> float | None:
        """What `route` with these arguments would decide the prompt costs on the replica it
        computes it on, without its pool's backlog charge (RouteDecision.prompt_cost, in tokens);
        None where `route` would find no replica (EMPTY). Changes nothing: no decision is recorded
        or counted, no work pending, no session touched, no replica forgotten, and the policy's
        tie-breaking draws are put back, so a `route` right after picks the replicas priced. The
        ingress prices a request in its first two cells and sends it to the cheaper (router/cells.py)."""
        now = self.clock()
        loads = self._loads_now(group, self._fresh_loads(now))
        hint = self.sessions.peek(session, now) if session is not None else None
        if hint is None and session is not None and carried is not None:
            hint = self._adoptable(carried, loads)  # priced as route would decide it, adopted nowhere
        rng = self.policy.rng
        state = rng.getstate()
        try:
            return self.policy.route(hashes, num_prompt_tokens, self.index, loads, hint).prompt_cost
        except NoReplicaError:
            return None
        finally:
            rng.setstate(state)

    def _adoptable(self, carried: Carried, loads: Sequence[ReplicaLoad]) -> SessionHint | None:
        """The part of an ingress's `carried` hint this router may take as a session's entry: the
        replicas it has live (of the request's group) in the role named, and none at all when the
        hint is as old as the table's ttl_s (the session would have been forgotten). Runs only
        for a session this router has no entry for: one pass over the loads."""
        prefill, decode, age_s = carried
        if not age_s < self.sessions.ttl_s:
            return None
        live = {load.replica_id: load.role for load in loads if load.replica_id in (prefill, decode)}
        prefill = prefill if live.get(prefill) == "prefill" else None
        decode = decode if live.get(decode) == "decode" else None
        return None if prefill is None and decode is None else SessionHint(prefill, decode)

    def _loads_now(self, group: str | None, live: Sequence[ReplicaLoad] | None = None) -> list[ReplicaLoad]:
        """The live replicas' loads (of `group`), with the work sent to each since its last report.
        Only the replicas sent work since their last report get a copy with it added (a copy per
        replica per decision was 29% of a decision at 128 replicas). `live`: the loads to use
        (default: live_loads(), which forgets the replicas silent too long)."""
        pending_tokens, pending_requests = self._pending_tokens, self._pending_requests
        return [load if load.replica_id not in pending_requests else
                replace(load, queued_prefill_tokens=load.queued_prefill_tokens + pending_tokens.get(load.replica_id, 0),
                        waiting=load.waiting + pending_requests[load.replica_id])
                for load in (self.live_loads() if live is None else live) if group is None or load.group == group]

    @staticmethod
    def _hot(d: RouteDecision, loads: Sequence[ReplicaLoad], spill_at: int) -> bool:
        """The replica that would compute the prompt holds at least `spill_at` prompts: the prefix
        is hotter than this cell (the policy chose the cheapest, so the rest are as loaded or
        more). A prefill replica's requests (running and waiting) are all prompts; a decode
        replica prefilling locally (colocated, or a short miss) counts only its waiting ones: its
        running requests are mostly streams, which say nothing of the prefix (counted, a busy
        colocated replica of 32 streams spilled every request at the default bound). A remote
        prefill's decode replica is not asked, for the same reason: with its streams counted a
        cell whose prefill replicas were swamped never spilled while its decode replicas held
        fewer streams than the bound (cluster/tools/bench/cell_quality.py found it)."""
        if d.prefill is not None:
            return any(load.requests >= spill_at for load in loads if load.replica_id == d.prefill)
        return any(load.waiting >= spill_at for load in loads if load.replica_id == d.decode)

    def recent_decisions(self) -> list[tuple[RouteDecision, tuple[ReplicaLoad, ...]]]:
        """The last decisions, oldest first, each with the replica loads it was made on."""
        return list(self._recent)

    def pending_requests(self) -> int:
        """Requests sent to replicas since their last load report (0 once every replica reported)."""
        return sum(self._pending_requests.values())

    def hashes(self, replica_id: str) -> set[BlockHash]:
        return self.index.hashes(replica_id)

    def stats(self) -> RouterStats:
        return RouterStats(len(self.index.replicas()), sum(self.index.num_blocks(r) for r in self.index.replicas()),
                           self._decisions, self._resyncs, len(self.sessions), self._spilled)
