"""The run-time planner's decision: move one replica between the pools when one pool is over its
bound and the other could lose a replica and stay well under its own.

It reads only what every replica already reports to the router (`router.policy.ReplicaLoad`), so
the same code decides on a live cluster (`RuntimePlanner`, cluster/planner/runtime_actor.py) and
in the simulator (`Simulator(..., split=SplitPolicy(...))`), and the simulator's answer to "does a
dynamic split pay on this trace" is the planner's own.

Each pool's pressure is its measured load over its bound (1.0 = at the bound):
- prefill: the prompt tokens queued on the prefill pool over its measured tokens a second (the
  wait a new prompt sees) against `ttft_share` of the SLO's TTFT;
- decode: the larger of the KV in use against `kv_high` of the pool's blocks, and the median
  decode step (a token's interval) against the SLO's TPOT.

A replica moves from pool A to pool B when B's pressure is >= `high` and A, one replica smaller
(its pressure x n/(n-1)), would be <= `low`, for `patience` decisions in a row and not within
`cooldown_s` of the last move. Both pools over their bounds is a capacity problem, not a split
problem: it is reported (`Decision.action == "scale"`) and nothing moves. The replica chosen to
move is the one with the least work (it drains first). A pool never goes below one replica.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal, Sequence

from router.policy import ReplicaLoad

from cluster.planner.config import SLO


@dataclass(frozen=True)
class SplitOptions:
    interval_s: float = 5.0  # between decisions
    patience: int = 3  # decisions in a row that must agree before a replica moves
    cooldown_s: float = 30.0  # after a move, before the next
    high: float = 1.0  # a pool at this pressure asks for a replica
    low: float = 0.6  # the other pool gives one only if it stays at or under this without it
    ttft_share: float = 0.5  # of the SLO's TTFT, the prefill queue's bound
    kv_high: float = 0.9  # of the decode pool's blocks, its KV bound


@dataclass(frozen=True)
class Pressure:
    pool: Literal["prefill", "decode"]
    replicas: int
    value: float  # measured / bound; 0 with nothing measured
    binding: str  # what sets it: "prefill queue", "decode KV", "decode step time", "idle"
    detail: str  # the measurement, for the log line

    def without_one(self) -> float:
        return float("inf") if self.replicas <= 1 else self.value * self.replicas / (self.replicas - 1)


@dataclass(frozen=True)
class Decision:
    action: Literal["hold", "flip", "scale"]
    reason: str
    prefill: Pressure
    decode: Pressure
    replica_id: str | None = None  # the replica to flip
    to: Literal["prefill", "decode"] | None = None

    def log_line(self) -> str:
        head = {"hold": "hold", "scale": "both pools over their bounds",
                "flip": f"flip {self.replica_id} to {self.to}"}[self.action]
        return (f"planner: {head}: {self.reason} | prefill x{self.prefill.replicas} {self.prefill.value:.2f} "
                f"({self.prefill.detail}); decode x{self.decode.replicas} {self.decode.value:.2f} "
                f"({self.decode.detail})")


def prefill_pressure(loads: Sequence[ReplicaLoad], slo: SLO, opts: SplitOptions) -> Pressure:
    queued = sum(r.queued_prefill_tokens for r in loads)
    rate = sum(r.tokens_per_s for r in loads)
    bound = opts.ttft_share * slo.ttft_s
    if queued == 0 or rate <= 0:  # nothing queued, or no pace measured yet: no evidence of pressure
        return Pressure("prefill", len(loads), 0.0, "idle", f"{queued} tokens queued")
    wait = queued / rate
    return Pressure("prefill", len(loads), wait / bound, "prefill queue",
                    f"{queued} tokens queued at {rate:.0f}/s: {wait * 1e3:.0f} ms against {bound * 1e3:.0f} ms")


def decode_pressure(loads: Sequence[ReplicaLoad], slo: SLO, opts: SplitOptions) -> Pressure:
    total = sum(r.total_blocks for r in loads)
    kv = sum(r.used_blocks for r in loads) / total if total else 0.0
    steps = [r.step_time_s for r in loads if r.step_time_s > 0 and r.running > 0]
    step = statistics.median(steps) if steps else 0.0
    by_kv, by_step = kv / opts.kv_high, step / slo.tpot_s
    detail = f"KV {kv:.0%} of {total} blocks, step {step * 1e3:.0f} ms against {slo.tpot_s * 1e3:.0f} ms"
    if by_kv == 0 and by_step == 0:
        return Pressure("decode", len(loads), 0.0, "idle", detail)
    if by_kv >= by_step:
        return Pressure("decode", len(loads), by_kv, "decode KV", detail)
    return Pressure("decode", len(loads), by_step, "decode step time", detail)


@dataclass
class SplitPolicy:
    """Stateful over decisions (patience, cooldown); `decide` is called every `interval_s` with the
    live loads of one serving group (draining replicas left out by the caller)."""

    slo: SLO
    opts: SplitOptions = SplitOptions()
    _streak: tuple[str, int] = ("", 0)  # the move asked for and how many decisions in a row
    _last_move_s: float = field(default=float("-inf"))

    def decide(self, loads: Sequence[ReplicaLoad], now: float) -> Decision:
        prefills = [r for r in loads if r.pool == "prefill"]
        decodes = [r for r in loads if r.pool == "decode"]
        p = prefill_pressure(prefills, self.slo, self.opts)
        d = decode_pressure(decodes, self.slo, self.opts)
        o = self.opts
        if not prefills:  # colocated, or every prefill replica draining: nothing to balance
            return self._reset(Decision("hold", "no prefill pool", p, d))
        if p.value >= o.high and d.value >= o.high:
            return self._reset(Decision("scale", f"{p.binding} and {d.binding} both at or over {o.high:g}x", p, d))
        want = None
        if p.value >= o.high and d.without_one() <= o.low:
            want = ("prefill", decodes, p, d)
        elif d.value >= o.high and p.without_one() <= o.low:
            want = ("decode", prefills, d, p)
        if want is None:
            return self._reset(Decision("hold", "within bounds" if max(p.value, d.value) < o.high
                                        else "the other pool cannot spare a replica", p, d))
        to, donors, short, donor = want
        key, n = self._streak
        self._streak = (to, n + 1 if key == to else 1)
        if self._streak[1] < o.patience:
            return Decision("hold", f"{short.binding} over for {self._streak[1]} of {o.patience} decisions", p, d)
        if now - self._last_move_s < o.cooldown_s:
            return Decision("hold", f"cooling down ({now - self._last_move_s:.0f} of {o.cooldown_s:g} s)", p, d)
        victim = min(donors, key=lambda r: (r.requests, r.queued_prefill_tokens, r.used_blocks, r.replica_id))
        self._streak = ("", 0)
        self._last_move_s = now
        reason = (f"{short.binding} at {short.value:.2f}x; the {donor.pool} pool one smaller would be at "
                  f"{donor.without_one():.2f}x")
        return Decision("flip", reason, p, d, victim.replica_id, to)

    def _reset(self, decision: Decision) -> Decision:
        self._streak = ("", 0)
        return decision
