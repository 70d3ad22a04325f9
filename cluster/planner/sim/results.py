"""What a run answers: the client's TTFT (the serving path's share added), TPOT, goodput against
the SLO, each pool's utilisation, the latency's trend through the trace (whether the configuration
keeps up: outcome.Trend); and the invariants a test checks after a run."""

from __future__ import annotations

from cluster.planner.outcome import Dist, SimResult, Trend
from cluster.planner.sim.state import SimRequest


class Results:
    def _result(self, reqs: list[SimRequest], clamped: int) -> SimResult:
        done = [r for r in reqs if r.done_s >= 0]
        sv = self.profile.serving

        def ttft_of(r: SimRequest) -> float:  # as the client sees it: the serving path's share added
            path = 0.0 if sv is None else sv.ttft_remote_s if r.remote else sv.ttft_local_s
            return r.first_token_s - r.spec.arrival_s + path

        ttft = [ttft_of(r) for r in done]
        tpot = [(r.done_s - r.first_token_s) / (r.generated - 1) for r in done if r.generated > 1]
        met = sum(1 for r in done if ttft_of(r) <= self.slo.ttft_s
                  and (r.generated == 1 or (r.done_s - r.first_token_s) / (r.generated - 1) <= self.slo.tpot_s))
        start = min((r.spec.arrival_s for r in reqs), default=0.0)
        duration = max((r.done_s for r in done), default=start) - start
        util = {}
        for pool, reps in (("prefill", self.prefills), ("decode", self.decodes)):
            if reps:
                util[pool] = sum(x.busy_s for x in reps) / (len(reps) * duration) if duration > 0 else 0.0
        return SimResult(self.config, len(reqs), len(done), duration, Dist.of(ttft), Dist.of(tpot),
                         Dist.of(self.itl), met, self.preemptions, self.remote, self.local, util,
                         self.transfer_s, clamped, tuple(self.flips),
                         Trend.of([r.spec.arrival_s for r in reqs],
                                  [r.done_s - r.spec.arrival_s if r.done_s >= 0 else None for r in reqs]))

    def check_invariants(self) -> None:
        """Blocks: free + held == total on every decode replica; prompt tokens left == the sum
        over the replica's requests still computing a prompt."""
        for rep in self.prefills + self.decodes:
            reqs = list(rep.waiting) + rep.running
            assert rep.prompt_tokens_left == sum(r.known - r.computed for r in reqs if r.in_prompt), rep.replica_id
            if rep.pool == "decode":
                assert rep.free_blocks + sum(r.blocks for r in reqs) == rep.total_blocks, rep.replica_id
