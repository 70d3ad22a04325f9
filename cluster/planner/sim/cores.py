"""Replicas sharing one machine's cores (`ClusterConfig.cores`).

While n steps run at once, each advances at 1 / profile.slowdown(n) of its profiled pace (the
profile times each step alone; `pdserve profile --sharing N` measures the slowdown of n engines
stepping at once; without it, ideal processor sharing, n / cores). A step's end moves whenever
another step starts or ends: `_sharing` holds, per replica mid-step, [profiled seconds left, start,
work, the id of its latest end event (earlier ones are stale)].

The serving processes take their share too (profile.serving.message_cpu_s: their CPU per relayed
token): each step's sampled tokens add that much work to one more participant, RELAY, which runs
while it has work beside the steps, slowing them as another process would.
"""

from __future__ import annotations

import heapq

from cluster.planner.sim.events import STEP
from cluster.planner.sim.state import Replica


RELAY = "relay"  # the serving processes' participant in the share (not a replica)


class SharedCores:
    def _relay(self, seconds: float) -> None:
        """Work for the serving processes (tokens relayed): it shares the cores until done."""
        self._advance_shared()
        entry = self._sharing.get(RELAY)
        if entry is None:
            self._sharing[RELAY] = [seconds, self.now, None, 0]
        else:
            entry[0] += seconds
        self._reschedule_shared()

    def _end_relay(self, event: int) -> None:
        entry = self._sharing.get(RELAY)
        if entry is not None and entry[3] == event:
            self._advance_shared()
            del self._sharing[RELAY]
            self._reschedule_shared()

    def _start_shared(self, rep: Replica, work, seconds: float) -> None:
        self._advance_shared()
        self._sharing[rep] = [seconds, self.now, work, 0]
        self._reschedule_shared()

    def _end_shared(self, rep: Replica, work, event: int) -> bool:
        """A shared step's end event: False when a later one replaced it; else the step is over."""
        entry = self._sharing.get(rep)
        if entry is None or entry[3] != event:
            return False
        self._advance_shared()
        del self._sharing[rep]
        self._account(rep, work, self.now - entry[1])
        self._reschedule_shared()
        return True

    def _advance_shared(self) -> None:
        """The steps under way progress from the last change to now at the slowdown they had."""
        elapsed = self.now - self._shared_at
        if elapsed > 0:
            for entry in self._sharing.values():
                entry[0] -= elapsed / self._slowdown
        self._shared_at = self.now

    def _reschedule_shared(self) -> None:
        """The number of steps under way changed: each one's end moves to its new pace."""
        self._slowdown = self.profile.slowdown(len(self._sharing), self.config.cores)
        for rep, entry in self._sharing.items():
            self._seq += 1
            entry[3] = self._seq
            heapq.heappush(self._events, (self.now + max(entry[0], 0.0) * self._slowdown, self._seq, STEP,
                                          (rep, entry[2], self._seq)))
