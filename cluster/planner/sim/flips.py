"""The run-time planner in the simulation: asked every split.opts.interval_s of simulated time; a
replica it moves drains (no new work), then changes pool `flip_s` later (its weights stay loaded:
the flip's own cost), its measured pace reset (its old role's says nothing of the new)."""

from __future__ import annotations

from cluster.planner.sim.events import FLIPPED, PLAN
from cluster.planner.sim.state import PREFILL_BLOCKS, Replica


class Flips:
    def _plan(self) -> None:
        loads = [x.load() for x in self.prefills + self.decodes if not x.draining]
        decision = self.split.decide(loads, self.now)
        if decision.action != "hold":
            self.decisions.append((self.now, decision))
        if decision.action == "flip":
            rep = self._by_id[decision.replica_id]
            rep.draining, rep.why = True, decision.reason
            self._finish_drain(rep)
        if self._events:  # work left: keep deciding
            self._push(self.now + self.split.opts.interval_s, PLAN, None)

    def _finish_drain(self, rep: Replica) -> None:
        if rep.draining and not rep.flipping and rep.drained():
            rep.flipping = True
            self._push(self.now + self.flip_s, FLIPPED, rep)

    def _flipped(self, rep: Replica) -> None:
        if rep.pool == "prefill":
            self.prefills.remove(rep)
            self.decodes.append(rep)
            rep.pool, rep.total_blocks = "decode", self.config.decode_blocks
        else:
            self.decodes.remove(rep)
            self.prefills.append(rep)
            rep.pool, rep.total_blocks = "prefill", PREFILL_BLOCKS
        rep.free_blocks = rep.total_blocks
        rep.draining = rep.flipping = False
        rep.tokens, rep.busy_s, rep.step_s = 0, 0.0, 0.0  # its pace in the old role says nothing of the new
        self.flips.append((self.now, rep.replica_id, rep.pool, rep.why))
