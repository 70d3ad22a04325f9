"""The plan: the cheapest P:D split, chunk size and skip-prefill threshold that meet an SLO.

Every configuration of the grid (P prefill + D decode replicas, P + D <= budget, P = 0 being
colocated; each chunk size; each skip-prefill threshold, irrelevant without a prefill pool) is
simulated on the same requests. A configuration meets the SLO when at least `attain` of the
requests have TTFT <= slo.ttft and TPOT <= slo.tpot, and it keeps up with the trace (its
latency does not grow through it: outcome.Trend; a short trace can end before a growing queue
pushes 10% of requests past the SLO, and a longer run of the same load would miss it). The
cheapest is the one with the fewest replicas, then the most goodput, then the fewest prefill
replicas. The Pareto front is, for each replica count, the best goodput, kept where it beats
every cheaper count.

The binding constraint is found by what-if: the configuration that would save a replica (the
best with one replica fewer than the plan) is simulated again with one resource relaxed at a time
(prefill steps twice as fast, decode steps twice as fast, twice the KV blocks, free transfers); the
relaxation that raises attainment most is what binds. Before simulating, the workload is checked
against the profile's calibrated range: out of range, the plan refuses (`OutOfRange`).

The speed band: the pick simulated again with every step SPEED_BAND slower and faster. A machine's
speed moves between runs (this 2-core VM's: a near-saturation trace's TTFT p50 read 1.43-2.05 s
over runs of one config), and near saturation a small change in speed is a large one in latency:
5% slower steps took that trace's TPOT p50 from 95 to 126 ms, 5% faster to 73. The band says how
far the pick's figures can be trusted before any run.

One run's spread: the pick simulated SPREAD_DRAWS times more, each with its own noise: the run's
speed (every step x a log-normal factor, sigma RUN_JITTER) and each step's (another, sigma
STEP_JITTER), and the 10th-90th percentile of each figure over the draws. The plan's figures are
one deterministic order of events; a real run's differ from it by which steps happen to meet (a
stream's last tokens just before or just after the next prompt's chunk): on a short trace a few
such requests move a percentile across a gap between two groups of requests (issue 54's long
trace on an Intel Xeon: TPOT p50 read 57-97 ms over three runs of one config, each request's own
TPOT within 10% of the simulation's but for the two or three that met a chunk in one and not in
the other). The spread is an 80% band figure by figure: where a correct model's run lands 8 times
in 10 on each figure (so over four figures a run is often outside on one); a run outside it on the
same side in every run is the model's error, not the run's luck. The sigmas are a choice, not a
fit: RUN_JITTER from the runs of one validation on the Intel Xeon VM of issue 54 (their speeds, read
from their TTFT by `plan_runs.run_speed`, within about ±4% of one another), STEP_JITTER a
step-to-step noise of the same order (it mostly averages out over a stream's steps; what it moves
is which steps meet).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Sequence

from cluster.planner.profile import OutOfRange, Profile, Transfer
from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.outcome import SimResult, percentile
from cluster.planner.simulator import simulate
from cluster.planner.validation import METRICS, Metrics
from cluster.planner.workload import RequestSpec


@dataclass(frozen=True)
class Relaxation:
    constraint: str  # "prefill compute", "decode compute", "KV capacity", "transfer"
    attainment: float
    goodput: float


SPEED_BAND = 0.05  # the speed band: every step this much slower, and faster
SPREAD_DRAWS = 24  # one run's spread: simulations of the pick, each with its own noise
RUN_JITTER = 0.04  # ... the run's speed: every step x a log-normal factor of this sigma
STEP_JITTER = 0.05  # ... and each step's own factor


@dataclass(frozen=True)
class Spread:
    """One run's spread: the 10th and 90th percentiles of each figure over `draws` noisy simulations."""

    low: Metrics
    high: Metrics
    draws: int

    def holds(self, metric: str, value: float) -> bool:
        return getattr(self.low, metric) <= value <= getattr(self.high, metric)


@dataclass(frozen=True)
class Plan:
    best: SimResult | None  # None: nothing within the budget meets the SLO
    front: tuple[SimResult, ...]
    evaluated: int
    probed: SimResult | None  # the configuration the relaxations were run on
    relaxations: tuple[Relaxation, ...]  # best first
    attain: float = 0.9
    band: tuple[SimResult, ...] = ()  # the best with every step SPEED_BAND slower, and faster (none: no best)
    spread: Spread | None = None  # one run's spread of the best (none: no best)

    @property
    def binding(self) -> tuple[str, ...]:
        """The constraints each of whose relaxation alone makes the probed configuration meet the
        SLO; else the one that raises its attainment most; () when none changes it."""
        if not self.relaxations or self.probed is None:
            return ()
        enough = tuple(r.constraint for r in self.relaxations if r.attainment >= self.attain)
        if enough:
            return enough
        top = self.relaxations[0]
        return (top.constraint,) if top.attainment - self.probed.attainment >= 0.005 else ()


def check_range(profile: Profile, specs: Sequence[RequestSpec], chunks: Sequence[int], max_num_seqs: int) -> None:
    """Raise OutOfRange when the workload or the grid needs step times beyond the calibration."""
    p, d = profile.prefill, profile.decode
    problems = []
    longest_prompt = max(s.prompt_tokens for s in specs)
    longest = max(s.prompt_tokens + s.output_tokens for s in specs)
    if max(chunks) > p.xs[-1]:
        problems.append(f"chunk {max(chunks)} tokens > calibrated prefill step of {p.xs[-1]:g} tokens")
    if longest_prompt - 1 > p.ys[-1]:  # a chunk (on decode, mixed with decodes) may start at any token of it
        problems.append(f"a {longest_prompt}-token prompt's chunks start up to {longest_prompt - 1} tokens in > "
                        f"calibrated prefill context {p.ys[-1]:g}")
    if longest > d.ys[-1]:
        problems.append(f"a {longest}-token context > calibrated decode context {d.ys[-1]:g}")
    if max_num_seqs > d.xs[-1]:
        problems.append(f"max_num_seqs {max_num_seqs} > calibrated decode batch {d.xs[-1]:g}")
    if problems:
        raise OutOfRange("the workload is outside the profile's calibrated range: " + "; ".join(problems)
                         + f" (calibrated: {profile.range_text()})")


def configurations(budget: int, chunks: Sequence[int], thresholds: Sequence[int], decode_blocks: int,
                   max_num_seqs: int, cores: float | None = None) -> list[ClusterConfig]:
    out = []
    for n in range(1, budget + 1):
        for p in range(0, n):
            for chunk in chunks:
                for thr in (thresholds if p else thresholds[:1]):
                    out.append(ClusterConfig(p, n - p, chunk, thr, decode_blocks, max_num_seqs, cores))
    return out


def _rank(r: SimResult) -> tuple:
    return (r.config.replicas, -r.goodput, r.config.prefill_replicas, r.config.chunk_tokens,
            r.config.skip_prefill_tokens)


def search(profile: Profile, specs: Sequence[RequestSpec], slo: SLO, budget: int, chunks: Sequence[int],
           thresholds: Sequence[int], decode_blocks: int, max_num_seqs: int, attain: float = 0.9,
           transfer: Transfer | None = None, seed: int = 0, cores: float | None = None) -> Plan:
    """`cores`: the replicas share that many cores (one machine, ClusterConfig.cores); None: a
    device each."""
    check_range(profile, specs, chunks, max_num_seqs)
    results = [simulate(profile, c, list(specs), slo, seed, transfer)
               for c in configurations(budget, chunks, thresholds, decode_blocks, max_num_seqs, cores)]
    meeting = sorted((r for r in results if r.attainment >= attain and r.keeps_up), key=_rank)
    best = meeting[0] if meeting else None
    front, top = [], -1.0
    for n in range(1, budget + 1):
        at_n = [r for r in results if r.config.replicas == n]
        if at_n:
            r = min(at_n, key=lambda r: (-r.goodput, *_rank(r)))
            if r.goodput > top:
                front.append(r)
                top = r.goodput
    probe = _probe_target(results, best)
    relax = relaxations(profile, probe.config, specs, slo, transfer, seed) if probe is not None else ()
    band = speed_band(profile, best.config, specs, slo, transfer, seed) if best is not None else ()
    spread = run_spread(profile, best.config, specs, slo, transfer, seed) if best is not None else None
    return Plan(best, tuple(front), len(results), probe, relax, attain, band, spread)


def at_speed(profile: Profile, factor: float, config: ClusterConfig, specs: Sequence[RequestSpec], slo: SLO,
             transfer: Transfer | None = None, seed: int = 0, step_jitter: float = 0.0,
             jitter_seed: int = 0) -> SimResult:
    """`config` simulated with every prefill and decode step `factor` times as long (and, with
    `step_jitter`, each step times its own noise: Simulator)."""
    return simulate(profile.scaled(prefill=factor, decode=factor), config, list(specs), slo, seed, transfer,
                    step_jitter=step_jitter, jitter_seed=jitter_seed)


def run_spread(profile: Profile, config: ClusterConfig, specs: Sequence[RequestSpec], slo: SLO,
               transfer: Transfer | None = None, seed: int = 0, draws: int = SPREAD_DRAWS,
               run_jitter: float = RUN_JITTER, step_jitter: float = STEP_JITTER) -> Spread:
    """`config` simulated `draws` times, draw k's run speed and its steps' noise seeded from stream
    k (two independent streams); the 10th and 90th percentiles of each figure. Deterministic."""
    runs = []
    for k in range(draws):
        rng = random.Random(k)
        factor = rng.lognormvariate(0.0, run_jitter) if run_jitter else 1.0
        runs.append(Metrics.of_sim(at_speed(profile, factor, config, specs, slo, transfer, seed, step_jitter,
                                            rng.getrandbits(64))))

    def at(q: float) -> Metrics:
        return Metrics(*(percentile(sorted(getattr(m, name) for m in runs), q) for name in METRICS))
    return Spread(at(10), at(90), draws)


def speed_band(profile: Profile, config: ClusterConfig, specs: Sequence[RequestSpec], slo: SLO,
               transfer: Transfer | None = None, seed: int = 0) -> tuple[SimResult, SimResult]:
    """(slower, faster): `config` with every step SPEED_BAND slower, and faster."""
    return tuple(at_speed(profile, f, config, specs, slo, transfer, seed)
                 for f in (1 + SPEED_BAND, 1 / (1 + SPEED_BAND)))


def _probe_target(results: list[SimResult], best: SimResult | None) -> SimResult | None:
    """The best configuration with one replica fewer than the plan (what stops the saving), or,
    with no plan or a one-replica plan, the best-attaining configuration."""
    if best is not None and best.config.replicas > 1:
        fewer = [r for r in results if r.config.replicas == best.config.replicas - 1]
        return min(fewer, key=lambda r: (-r.attainment, *_rank(r)))
    return best or min(results, key=lambda r: (-r.attainment, *_rank(r)), default=None)


def relaxations(profile: Profile, config: ClusterConfig, specs: Sequence[RequestSpec], slo: SLO,
                transfer: Transfer | None, seed: int = 0) -> tuple[Relaxation, ...]:
    t = transfer or profile.transfer
    arms = [("prefill compute", profile.scaled(prefill=0.5), config, t),
            ("decode compute", profile.scaled(decode=0.5), config, t),
            ("KV capacity", profile, replace(config, decode_blocks=2 * config.decode_blocks), t)]
    if t is not None:
        arms.append(("transfer", profile, config, Transfer(0.0, float("inf"), t.measured)))
    out = []
    for name, prof, cfg, tr in arms:
        try:
            r = simulate(prof, cfg, list(specs), slo, seed, tr)
        except OutOfRange:
            continue
        out.append(Relaxation(name, r.attainment, r.goodput))
    return tuple(sorted(out, key=lambda x: (-x.attainment, -x.goodput, x.constraint)))
