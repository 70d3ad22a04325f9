"""The event core: the clock and its heap, arrivals and routing, a replica's step started and ended.

Events at one instant are all handled before any replica starts a step (requests that arrive
together are scheduled together). A step's content is fixed when it starts; its price comes from
the prefill or decode part, its duration from the cores part when the replicas share a machine.
"""

from __future__ import annotations

import heapq

from cluster.planner.outcome import SimResult
from cluster.planner.sim.state import Replica, SimRequest
from cluster.planner.workload import RequestSpec

ARRIVE, STEP, TRANSFERRED, PLAN, FLIPPED = 0, 1, 2, 3, 4


class EventCore:
    """The loop the other parts plug into (cluster/planner/simulator.py assembles them)."""

    def _push(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def run(self, specs: list[RequestSpec]) -> SimResult:
        reqs = self.requests = [SimRequest(s, s.prompt_tokens) for s in specs]
        for r in reqs:
            self._push(r.spec.arrival_s, ARRIVE, r)
        if self.split is not None and reqs:
            self._push(min(r.spec.arrival_s for r in reqs) + self.split.opts.interval_s, PLAN, None)
        clamped0 = self.profile.prefill.clamped_low + self.profile.decode.clamped_low
        while self._events:
            self.now, _, kind, obj = heapq.heappop(self._events)
            if kind == ARRIVE:
                self._arrive(obj)
            elif kind == STEP:
                self._step_end(*obj)
            elif kind == TRANSFERRED:
                self._enqueue_decode(obj)
            elif kind == PLAN:
                self._plan()
            else:
                self._flipped(obj)
            if not self._events or self._events[0][0] > self.now:  # every event of this instant is in
                dirty, self._dirty = self._dirty, []
                for rep in dirty:
                    rep.kicked = False
                    self._kick(rep)
        clamped = self.profile.prefill.clamped_low + self.profile.decode.clamped_low - clamped0
        return self._result(reqs, clamped)

    def _arrive(self, r: SimRequest) -> None:
        loads = [x.load() for x in self.prefills + self.decodes if not x.draining]
        d = self.policy.route([], r.spec.prompt_tokens, self.index, loads)
        r.decode = self._by_id[d.decode]
        r.decode.assigned += 1
        if d.mode == "local":
            self.local += 1
            self._enqueue_decode(r)
        else:
            self.remote += 1
            r.remote = True
            p = self._by_id[d.prefill]
            p.queue(r)
            self._wake(p)

    def _enqueue_decode(self, r: SimRequest) -> None:
        r.decode.queue(r)
        self._wake(r.decode)

    def _wake(self, rep: Replica) -> None:
        """Start rep's next step once every event at this instant is handled."""
        if not rep.busy and not rep.kicked:
            rep.kicked = True
            self._dirty.append(rep)

    def _kick(self, rep: Replica) -> None:
        if rep.busy:
            return
        plan = self._schedule_prefill(rep) if rep.pool == "prefill" else self._schedule_decode(rep)
        if plan is None:
            return
        seconds, work = plan
        if self.step_jitter:
            seconds *= self._jitter.lognormvariate(0.0, self.step_jitter)
        self.busy += 1
        rep.busy = True
        rep.steps += 1
        if rep.pool == "prefill":
            rep.tokens += sum(take for _, take in work)
        else:
            decodes, chunks = work
            rep.tokens += len(decodes) + sum(take for _, take in chunks)
        if self.config.cores is None:  # a device each: the step takes its profiled time
            self._account(rep, work, seconds)
            self._push(self.now + seconds, STEP, (rep, work, 0))
        else:
            self._start_shared(rep, work, seconds)

    def _account(self, rep: Replica, work, seconds: float) -> None:
        """A step's time, as the replica measures it (its busy time; a decode step's smoothed time,
        which the router reads)."""
        rep.busy_s += seconds
        if rep.pool == "decode" and work[0]:
            rep.step_s = seconds if rep.step_s == 0 else 0.7 * rep.step_s + 0.3 * seconds

    def _step_end(self, rep: Replica, work, event: int) -> None:
        if work is None:  # the serving processes' relay work (sim/cores.py) is done
            self._end_relay(event)
            return
        if event and not self._end_shared(rep, work, event):  # a stale end of a shared step
            return
        rep.busy = False
        self.busy -= 1
        if rep.pool == "prefill":
            sampled = self._prefill_done(rep, work)
        else:
            sampled = self._decode_done(rep, work)
        if self.relay_cpu_s and sampled:
            self._relay(sampled * self.relay_cpu_s)
        if rep.draining:
            self._finish_drain(rep)
        self._wake(rep)
