"""A discrete-event simulator of the P/D path, priced by a profile (cluster/planner/profile.py).

    arrival -> router (router.policy.RoutingPolicy, the real code, fed the simulated loads)
      remote: prefill replica (FIFO, chunked: <= chunk_tokens per step) -> first token
              -> KV transfer (prompt bytes) -> decode replica's queue
      local:  decode replica's queue (it prefills the prompt itself, in chunks beside its decodes)
    decode replica: continuous batching as the engine schedules a step (every decoding request one
    token, then prompts part-way, then the queue in order, while blocks and max_num_seqs allow);
    KV capacity in blocks; when a decode needs a block and none is free, the most recently
    admitted request not yet scheduled in the step is preempted by recompute (blocks freed, back
    to the queue's head, its prompt + output recomputed later).

A replica steps back to back while it has work; a step's content is fixed when it starts (what
arrives meanwhile waits for the next). TTFT ends when the first token is sampled (pdserve streams
it from the prefill replica at once, so the transfer is not in TTFT: it is in the first gap).

With `ClusterConfig.cores` set, the replicas share one machine's cores: while n steps run at once,
each advances at 1 / profile.slowdown(n) of its profiled pace (the profile times each step alone;
`pdserve profile --sharing N` measures the slowdown of n engines stepping at once; without it, ideal
processor sharing, n / cores). A step's end moves whenever another step starts or ends.

What it does not model yet (each is a known gap, not validated against real runs): prefix caching
(every prompt is computed in full; trace hash ids are ignored), the prefill pool's KV capacity and
leases, the router seeing loads up to a second old (it sees the exact simulated loads), ingress
cost, admission control and queue limits, speculative decoding, host/disk KV tiers.
Deterministic: the same inputs and seed give the same result. With `step_jitter` (sigma > 0) each
step's time is its profiled time times a log-normal factor (median 1) drawn from `jitter_seed`'s
stream: one real run's step-to-step noise, for the plan's one-run spread (planner/plan.py).

The parts, one concept a module, are in cluster/planner/sim/ (the event core; the shared cores;
prefill; decode and transfer; flips; results); this module assembles them.
"""

from __future__ import annotations

import random

from router.index import PrefixIndex
from router.policy import PolicyConfig, RoutingPolicy

from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.outcome import SimResult
from cluster.planner.profile import Profile, Transfer
from cluster.planner.runtime import SplitPolicy
from cluster.planner.sim.cores import SharedCores
from cluster.planner.sim.decode import DecodeSteps
from cluster.planner.sim.events import EventCore
from cluster.planner.sim.flips import Flips
from cluster.planner.sim.prefill import PrefillSteps
from cluster.planner.sim.results import Results
from cluster.planner.sim.state import PREFILL_BLOCKS, Replica, SimRequest
from cluster.planner.workload import RequestSpec

__all__ = ["PREFILL_BLOCKS", "Replica", "SimRequest", "Simulator", "simulate"]


class Simulator(EventCore, SharedCores, PrefillSteps, DecodeSteps, Flips, Results):
    def __init__(self, profile: Profile, config: ClusterConfig, slo: SLO, seed: int = 0,
                 transfer: Transfer | None = None, split: SplitPolicy | None = None, flip_s: float = 0.5,
                 step_jitter: float = 0.0, jitter_seed: int = 0):
        """`split`: the run-time planner's policy, asked every split.opts.interval_s of simulated
        time; a replica it moves drains (no new work), then changes pool `flip_s` later (its
        weights stay loaded: the flip's own cost). `step_jitter`: the sigma of every step's
        log-normal noise factor (0: none, the profiled times exactly)."""
        if config.decode_replicas < 1:
            raise ValueError("a cluster needs at least one decode replica")
        if config.max_num_seqs > config.chunk_tokens:
            raise ValueError("chunk_tokens must be >= max_num_seqs (every decode gets its token each step)")
        self.profile, self.config, self.slo = profile, config, slo
        self.transfer = transfer or profile.transfer
        self.block_size = profile.block_size
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        self.policy = RoutingPolicy(PolicyConfig(block_size=self.block_size,
                                                 local_prefill_threshold=config.skip_prefill_tokens),
                                    rng=random.Random(seed))
        self.index = PrefixIndex()  # empty: prefix caching is not simulated
        self.prefills = [Replica(f"prefill-{i}", "prefill", PREFILL_BLOCKS, PREFILL_BLOCKS)
                         for i in range(config.prefill_replicas)]
        self.decodes = [Replica(f"decode-{i}", "decode", config.decode_blocks, config.decode_blocks)
                        for i in range(config.decode_replicas)]
        self._by_id = {r.replica_id: r for r in self.prefills + self.decodes}
        self._events: list = []  # the event core's heap
        self._seq = 0
        self._dirty: list[Replica] = []
        self.now = 0.0
        self.busy = 0  # replicas mid-step
        self._sharing: dict[Replica, list] = {}  # the shared cores' steps under way (sim/cores.py)
        self._shared_at = 0.0  # when the steps under way were last advanced
        self._slowdown = 1.0  # their current slowdown (of len(self._sharing) at once)
        self.itl: list[float] = []
        self.preemptions = 0
        self.remote = self.local = 0
        self.transfer_s = 0.0
        self.split, self.flip_s = split, flip_s
        self.step_jitter = step_jitter
        self._jitter = random.Random(jitter_seed)  # the steps' noise, apart from the router's draws
        # the serving path's measured costs (profile.serving): a decode step's loop and relay, the
        # client's TTFT per path, the remote hand-off (with the transfer)
        sv = profile.serving
        self.serving_step_s, self.serving_stream_s = (sv.decode_step_s, sv.decode_stream_s) if sv else (0.0, 0.0)
        # their CPU per relayed token, competing for the cores when the replicas share a machine's
        self.relay_cpu_s = sv.message_cpu_s if sv is not None and config.cores is not None else 0.0
        self.flips: list[tuple[float, str, str, str]] = []  # (when, replica, to, reason) as each completed
        self.decisions: list = []  # the planner's decisions other than hold, in order


def simulate(profile: Profile, config: ClusterConfig, specs: list[RequestSpec], slo: SLO, seed: int = 0,
             transfer: Transfer | None = None, split: SplitPolicy | None = None, flip_s: float = 0.5,
             step_jitter: float = 0.0, jitter_seed: int = 0) -> SimResult:
    return Simulator(profile, config, slo, seed, transfer, split, flip_s, step_jitter, jitter_seed).run(specs)
