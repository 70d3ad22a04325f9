"""Which replicas served each session last: the router's memory for session affinity.

A plain class with an injected clock. Bounded: at most `max_sessions` entries (the least recently
used goes first) and an entry idle for `ttl_s` is forgotten. The policy turns a hint into a soft
preference (router/policy.py); a hint naming a replica that is gone is simply never matched.

**After a restart** (Ray re-runs the router's `__init__`: the table is empty) a session's replicas
come back from the ingress, which remembers them anyway for routing while the router is away
(router/ingress/flow/route_memory.py): every `route` of a session carries the ingress's `Carried`
(the replicas it last saw chosen for the session and how long ago), and a router with no entry
for the session adopts it: only the replicas it has live in that role, only if younger than
`ttl_s`, into this table with its bounds (Router.route). No extra call and no store to keep in
step: the carried tuple is ~50 bytes of a call the ingress makes anyway (< 1 us a request),
and it rebuilds the table entry by entry as sessions come back, never all at once. Chosen over
the alternatives: the router writing its table somewhere that outlives it costs it a write per
decision (or loses the last interval's); the replicas reporting the sessions they served in
their resync snapshot would need the session key carried into every engine call and a merge of
one session's prefill and decode from two replicas' snapshots. What it leaves out: an ingress
that never routed the session (several ingress replicas behind a proxy that is not
session-sticky) carries nothing, and one that routed an older turn carries that turn's replicas;
the router takes the first carried hint it gets and its own decisions from then on, so at worst
the session goes by its cached prefix as before, or to replicas that served it a turn earlier.
"""

from __future__ import annotations

from collections import OrderedDict

from router.policy import RouteDecision, SessionHint

# What the caller of `route` remembers of a session (the ingress's RouteMemory.carried):
# (prefill replica or None, decode replica, seconds since that decision). A plain tuple: it rides
# on every session's route call, and a dataclass pickles ~5 us slower there.
Carried = tuple[str | None, str, float]


def session_prefill(decision: RouteDecision, before: str | None) -> str | None:
    """The prefill replica a session keeps after `decision`: the one it chose, or, with local
    prefill (the prompt computed on the decode replica), the one it had `before`."""
    return decision.prefill if decision.mode == "remote" else before


class SessionTable:
    def __init__(self, max_sessions: int, ttl_s: float):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, SessionHint]] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float) -> SessionHint | None:
        self._expire(now)
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def peek(self, key: str, now: float) -> SessionHint | None:
        """As `get`, changing nothing (an entry past its time-to-live is not there)."""
        entry = self._entries.get(key)
        return None if entry is None or now - entry[0] >= self.ttl_s else entry[1]

    def record(self, key: str, decision: RouteDecision, now: float) -> None:
        """The replicas a session's request was just sent to. With local prefill the prompt was
        computed on the decode replica, so the prefill hint stays what it was."""
        old = self._entries.pop(key, None)
        prefill = session_prefill(decision, old[1].prefill if old else None)
        self._entries[key] = (now, SessionHint(prefill, decision.decode))
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)
        self._expire(now)

    def adopt(self, key: str, hint: SessionHint, now: float) -> None:
        """Take `hint` as the session's entry if it has none (a restarted router learning a
        session from the ingress: the module docstring); an entry it has is never replaced."""
        if key not in self._entries:
            self._entries[key] = (now, hint)
            while len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)

    def _expire(self, now: float) -> None:
        while self._entries:
            seen, _ = next(iter(self._entries.values()))
            if now - seen < self.ttl_s:
                return
            self._entries.popitem(last=False)
