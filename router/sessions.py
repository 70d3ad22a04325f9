"""Which replicas served each session last: the router's memory for session affinity.

A plain class with an injected clock. Bounded: at most `max_sessions` entries (the least recently
used goes first) and an entry idle for `ttl_s` is forgotten. The policy turns a hint into a soft
preference (router/policy.py); a hint naming a replica that is gone is simply never matched.
"""

from __future__ import annotations

from collections import OrderedDict

from router.policy import RouteDecision, SessionHint


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
        prefill = decision.prefill if decision.mode == "remote" else (old[1].prefill if old else None)
        self._entries[key] = (now, SessionHint(prefill, decision.decode))
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._entries:
            seen, _ = next(iter(self._entries.values()))
            if now - seen < self.ttl_s:
                return
            self._entries.popitem(last=False)
