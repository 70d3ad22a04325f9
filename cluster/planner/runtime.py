"""The run-time planner's decision: move one replica between the pools when one pool is over its
bound and the other could lose a replica and stay well under its own.

It reads only what every replica already reports to the router (`router.policy.ReplicaLoad`), so
the same code decides on a live cluster (`RuntimePlanner`, cluster/planner/runtime_actor.py) and
in the simulator (`Simulator(..., split=SplitPolicy(...))`), and the simulator's answer to "does a
dynamic split pay on this trace" is the planner's own.

Each pool's pressure is its measured load over its bound (1.0 = at the bound), read through the
load model (router/load_model.py) as the router and the ingress read it:
- prefill: the pool's queue wait (prompt tokens ahead, running prompts' uncomputed part included,
  over its measured tokens a second) against `ttft_share` of the SLO's TTFT; work ahead with no
  rate measured anywhere in the pool is "unmeasured": it asks for nothing and gives nothing;
- decode: the larger of the KV in use against `kv_high` of the pool's blocks, and the median
  decode step (a token's interval) against the SLO's TPOT.

A replica moves from pool A to pool B when B's pressure is >= `high` and A, one replica smaller
(the larger of its pressure and its busy fraction, x n/(n-1)), would be <= `low`, for `patience`
decisions in a row and not within `cooldown_s` of the last move, nor within `hysteresis_s` of a
move the other way (a flip is not undone by the next burst). Both pools over their bounds is a
capacity problem, not a split problem: it is reported (`Decision.action == "scale"`) and nothing
moves. The replica chosen to move is the least busy, then the one with the least work (it drains
first). A pool never goes below one replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from router import load_model
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
    hysteresis_s: float = 300.0  # after a move, before a move the other way


@dataclass(frozen=True)
class Pressure:
    pool: Literal["prefill", "decode"]
    replicas: int
    value: float  # measured / bound; 0 with nothing measured
    binding: str  # what sets it: "prefill queue", "decode KV", "decode step time", "idle", "unmeasured"
    detail: str  # the measurement, for the log line
    busy: float = 0.0  # the pool's mean busy fraction, where its replicas report one

    def without_one(self) -> float:
        """The pool's load one replica smaller: its pressure or its busy fraction, whichever is
        higher (a pool busy all the time with no queue is not idle), over one replica fewer."""
        if self.replicas <= 1 or self.binding == "unmeasured":
            return float("inf")
        return max(self.value, self.busy) * self.replicas / (self.replicas - 1)


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


def reported_busy(loads: Sequence[ReplicaLoad]) -> float:
    """The pool's mean busy fraction over the replicas that report one (0: none does)."""
    shares = [r.busy_fraction for r in loads if r.busy_fraction is not None]
    return sum(shares) / len(loads) if shares else 0.0


def prefill_pressure(loads: Sequence[ReplicaLoad], slo: SLO, opts: SplitOptions) -> Pressure:
    wait, ahead, rate = load_model.pool_queue_wait(loads)
    bound = opts.ttft_share * slo.ttft_s
    busy = reported_busy(loads)
    if wait is None:  # work ahead, no pace measured anywhere in the pool: neither idle nor over
        return Pressure("prefill", len(loads), 0.0, "unmeasured", f"{ahead} tokens ahead, no rate yet", busy)
    if ahead == 0:
        return Pressure("prefill", len(loads), 0.0, "idle", f"{ahead} tokens queued", busy)
    return Pressure("prefill", len(loads), wait / bound, "prefill queue",
                    f"{ahead} tokens queued at {rate:.0f}/s: {wait * 1e3:.0f} ms against {bound * 1e3:.0f} ms", busy)


def decode_pressure(loads: Sequence[ReplicaLoad], slo: SLO, opts: SplitOptions) -> Pressure:
    total = sum(r.total_blocks for r in loads)
    kv = 1.0 - load_model.kv_headroom(loads) if total else 0.0
    step = load_model.decode_step_s(loads)
    by_kv, by_step = kv / opts.kv_high, step / slo.tpot_s
    detail = f"KV {kv:.0%} of {total} blocks, step {step * 1e3:.0f} ms against {slo.tpot_s * 1e3:.0f} ms"
    busy = reported_busy(loads)
    if by_kv == 0 and by_step == 0:
        return Pressure("decode", len(loads), 0.0, "idle", detail, busy)
    if by_kv >= by_step:
        return Pressure("decode", len(loads), by_kv, "decode KV", detail, busy)
    return Pressure("decode", len(loads), by_step, "decode step time", detail, busy)


@dataclass
class SplitPolicy:
    """Stateful over decisions (patience, cooldown); `decide` is called every `interval_s` with the
    live loads of one serving group (draining replicas left out by the caller)."""

    slo: SLO
    opts: SplitOptions = SplitOptions()
    _streak: tuple[str, int] = ("", 0)  # the move asked for and how many decisions in a row
    _last_move_s: float = field(default=float("-inf"))
    _last_to: str | None = None  # the role the last move went to
    _before_to: str | None = None  # ... and the one before it (restored when a move does not happen)

    def decide(self, loads: Sequence[ReplicaLoad], now: float) -> Decision:
        prefills = [r for r in loads if r.role == "prefill"]
        decodes = [r for r in loads if r.role == "decode"]
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
        if self._last_to not in (None, to) and now - self._last_move_s < o.hysteresis_s:
            return Decision("hold", f"would undo the move to {self._last_to} {now - self._last_move_s:.0f} s ago "
                            f"(hysteresis {o.hysteresis_s:g} s)", p, d)
        victim = min(donors, key=lambda r: (load_model.busy_fraction(r), r.requests, load_model.tokens_ahead(r),
                                            r.used_blocks, r.replica_id))
        self._streak = ("", 0)
        self._last_move_s, self._before_to, self._last_to = now, self._last_to, to
        reason = (f"{short.binding} at {short.value:.2f}x; the {donor.pool} pool one smaller would be at "
                  f"{donor.without_one():.2f}x")
        return Decision("flip", reason, p, d, victim.replica_id, to)

    def not_moved(self) -> None:
        """The last flip decided did not happen (called off, failed, timed out): it counts for the
        cooldown, not for the hysteresis (there is no move to undo)."""
        self._last_to = self._before_to

    def _reset(self, decision: Decision) -> Decision:
        self._streak = ("", 0)
        return decision
