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
Deterministic: the same inputs and seed give the same result.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from router.index import PrefixIndex
from router.policy import PolicyConfig, ReplicaLoad, RoutingPolicy

from cluster.planner.config import SLO, ClusterConfig
from cluster.planner.outcome import Dist, SimResult
from cluster.planner.profile import Profile, Transfer
from cluster.planner.runtime import SplitPolicy
from cluster.planner.workload import RequestSpec


@dataclass(eq=False)  # identity: two requests in the same state are still two
class SimRequest:
    spec: RequestSpec
    known: int  # tokens whose KV a step may compute (prompt + sampled)
    computed: int = 0  # tokens in the KV cache
    generated: int = 0
    blocks: int = 0  # held on its decode replica
    in_prompt: bool = False  # computing a prompt (or a recompute) on the replica that holds it
    decode: "Replica | None" = None
    remote: bool = False  # prefilled on the prefill pool (the serving path's remote TTFT applies)
    first_token_s: float = -1.0
    last_token_s: float = -1.0
    done_s: float = -1.0


@dataclass(eq=False)
class Replica:
    replica_id: str
    pool: str  # "prefill" | "decode"
    total_blocks: int
    free_blocks: int
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # admission order
    busy: bool = False
    kicked: bool = False  # a step start is pending for this instant
    busy_s: float = 0.0
    steps: int = 0
    tokens: int = 0  # computed (prompt chunks and decodes): with busy_s, its measured pace
    step_s: float = 0.0  # a decode step's seconds, smoothed (the router's step_time_s)
    assigned: int = 0  # a decode replica's requests, from routing to their end (some still on prefill)
    draining: bool = False  # the run-time planner is moving it to the other pool: no new work
    flipping: bool = False  # drained; the flip completes at a scheduled instant
    why: str = ""  # the planner's reason for the move under way

    prompt_tokens_left: int = 0  # prompt (or recompute) tokens still to compute here: kept, not summed

    def queue(self, r: "SimRequest", front: bool = False) -> None:
        if self.pool == "prefill" or r.known - r.computed > 1:  # a prompt to compute (an import only decodes)
            r.in_prompt = True
            self.prompt_tokens_left += r.known - r.computed
        if front:
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.replica_id, self.pool, self.free_blocks, self.total_blocks,
                           running=len(self.running), waiting=len(self.waiting),
                           queued_prefill_tokens=self.prompt_tokens_left, step_time_s=self.step_s,
                           tokens_per_s=self.tokens / self.busy_s if self.busy_s > 0 else 0.0)

    def drained(self) -> bool:
        return not (self.busy or self.waiting or self.running or self.assigned)


_ARRIVE, _STEP, _TRANSFERRED, _PLAN, _FLIPPED = 0, 1, 2, 3, 4
PREFILL_BLOCKS = 1 << 40  # prefill replicas' KV is not modelled


class Simulator:
    def __init__(self, profile: Profile, config: ClusterConfig, slo: SLO, seed: int = 0,
                 transfer: Transfer | None = None, split: SplitPolicy | None = None, flip_s: float = 0.5):
        """`split`: the run-time planner's policy, asked every split.opts.interval_s of simulated
        time; a replica it moves drains (no new work), then changes pool `flip_s` later (its
        weights stay loaded: the flip's own cost)."""
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
        self._events: list = []
        self._seq = 0
        self._dirty: list[Replica] = []
        self.now = 0.0
        self.busy = 0  # replicas mid-step
        # config.cores: the steps under way, replica -> [profiled seconds left, start, work, the id
        # of its end event (earlier ones are stale)]
        self._sharing: dict[Replica, list] = {}
        self._shared_at = 0.0  # when the steps under way were last advanced
        self._slowdown = 1.0  # their current slowdown (of len(self._sharing) at once)
        self.itl: list[float] = []
        self.preemptions = 0
        self.remote = self.local = 0
        self.transfer_s = 0.0
        self.split, self.flip_s = split, flip_s
        # the serving path's measured costs (profile.serving): a decode step's loop and relay, the
        # client's TTFT per path, the remote hand-off (with the transfer)
        sv = profile.serving
        self.serving_step_s, self.serving_stream_s = (sv.decode_step_s, sv.decode_stream_s) if sv else (0.0, 0.0)
        self.flips: list[tuple[float, str, str, str]] = []  # (when, replica, to, reason) as each completed
        self.decisions: list = []  # the planner's decisions other than hold, in order

    # ---- events ----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def run(self, specs: list[RequestSpec]) -> SimResult:
        reqs = self.requests = [SimRequest(s, s.prompt_tokens) for s in specs]
        for r in reqs:
            self._push(r.spec.arrival_s, _ARRIVE, r)
        if self.split is not None and reqs:
            self._push(min(r.spec.arrival_s for r in reqs) + self.split.opts.interval_s, _PLAN, None)
        clamped0 = self.profile.prefill.clamped_low + self.profile.decode.clamped_low
        while self._events:
            self.now, _, kind, obj = heapq.heappop(self._events)
            if kind == _ARRIVE:
                self._arrive(obj)
            elif kind == _STEP:
                self._step_end(*obj)
            elif kind == _TRANSFERRED:
                self._enqueue_decode(obj)
            elif kind == _PLAN:
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

    # ---- the run-time planner ---------------------------------------------------------------

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
            self._push(self.now + self.split.opts.interval_s, _PLAN, None)

    def _finish_drain(self, rep: Replica) -> None:
        if rep.draining and not rep.flipping and rep.drained():
            rep.flipping = True
            self._push(self.now + self.flip_s, _FLIPPED, rep)

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

    def _wake(self, rep: Replica) -> None:
        """Start rep's next step once every event at this instant is handled (requests that arrive
        together are scheduled together)."""
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
            self._push(self.now + seconds, _STEP, (rep, work, 0))
        else:
            self._advance_shared()
            self._sharing[rep] = [seconds, self.now, work, 0]
            self._reschedule_shared()

    def _account(self, rep: Replica, work, seconds: float) -> None:
        """A step's time, as the replica measures it (its busy time; a decode step's smoothed time,
        which the router reads)."""
        rep.busy_s += seconds
        if rep.pool == "decode" and work[0]:
            rep.step_s = seconds if rep.step_s == 0 else 0.7 * rep.step_s + 0.3 * seconds

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
            heapq.heappush(self._events, (self.now + max(entry[0], 0.0) * self._slowdown, self._seq, _STEP,
                                          (rep, entry[2], self._seq)))

    # ---- a prefill replica's step ----------------------------------------------------------

    def _schedule_prefill(self, rep: Replica):
        """Prompts part-way first, then the queue in order, up to chunk_tokens."""
        budget = self.config.chunk_tokens
        work = []
        for r in rep.running:
            if budget == 0:
                break
            take = min(r.known - r.computed, budget)
            work.append((r, take))
            budget -= take
        while budget > 0 and rep.waiting:
            r = rep.waiting.popleft()
            rep.running.append(r)
            take = min(r.known - r.computed, budget)
            work.append((r, take))
            budget -= take
        if not work:
            return None
        return self._prefill_seconds(work), work

    def _prefill_seconds(self, work) -> float:
        tokens = sum(take for _, take in work)
        context = sum(r.computed * take for r, take in work) / tokens  # token-weighted context before the chunk
        return self.profile.prefill(tokens, context)

    # ---- a decode replica's step -----------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _schedule_decode(self, rep: Replica):
        cfg = self.config
        decodes, chunks = [], []
        decoding = [x for x in rep.running if x.known - x.computed == 1]
        short = [x for x in decoding if x.computed >= x.blocks * self.block_size]  # need one more block
        if len(short) <= rep.free_blocks:  # the common case: every decode fits
            for r in short:
                r.blocks += 1
            rep.free_blocks -= len(short)
            decodes = decoding
            scheduled = set(map(id, decoding))
        else:
            scheduled = self._decodes_preempting(rep, decoding, decodes)
        budget = cfg.chunk_tokens - len(decodes)
        for r in rep.running:  # (2) prompts part-way
            if budget <= 0:
                break
            if r.known - r.computed > 1 and id(r) not in scheduled:
                take = self._fit_chunk(rep, r, budget)
                if take == 0:
                    break
                chunks.append((r, take))
                budget -= take
        while budget > 0 and rep.waiting and len(rep.running) < cfg.max_num_seqs:  # (3) the queue, in order
            r = rep.waiting[0]
            if r.known - r.computed == 1:  # imported from prefill: its whole prompt's KV arrives
                need = self._blocks_for(r.computed + 1)
                if need > rep.free_blocks:
                    break
                rep.waiting.popleft()
                rep.running.append(r)
                self._grow(rep, r, need)
                decodes.append(r)
                budget -= 1
            else:
                take = self._fit_chunk(rep, r, budget)
                if take == 0:
                    break
                rep.waiting.popleft()
                rep.running.append(r)
                chunks.append((r, take))
                budget -= take
        if not decodes and not chunks:
            return None
        seconds = 0.0
        if decodes:
            ctx = sum(r.computed for r in decodes) / len(decodes) + 1
            seconds += (self.profile.decode(len(decodes), ctx) + self.serving_step_s
                        + self.serving_stream_s * len(decodes))
        if chunks:
            seconds += self._prefill_seconds(chunks)
        return seconds, (decodes, chunks)

    def _decodes_preempting(self, rep: Replica, decoding: list, decodes: list) -> set:
        """Blocks ran out: in admission order, each decode that needs a block preempts the most
        recently admitted request not yet scheduled in this step (itself, if it is that one)."""
        scheduled, preempted = set(), set()
        for r in decoding:
            if id(r) in preempted:  # for an older request, earlier in this loop
                continue
            need = self._blocks_for(r.computed + 1) - r.blocks
            while need > rep.free_blocks:
                victim = next(v for v in reversed(rep.running) if id(v) not in scheduled)
                self._preempt(rep, victim)
                preempted.add(id(victim))
                if victim is r:
                    break
            else:
                self._grow(rep, r, need)
                decodes.append(r)
                scheduled.add(id(r))
        return scheduled

    def _fit_chunk(self, rep: Replica, r: SimRequest, budget: int) -> int:
        """Prompt tokens of r this step: as many as the budget and the free blocks allow."""
        take = min(r.known - r.computed, budget)
        room = (r.blocks + rep.free_blocks) * self.block_size - r.computed
        take = min(take, room)
        if take <= 0:
            return 0
        self._grow(rep, r, self._blocks_for(r.computed + take) - r.blocks)
        return take

    def _grow(self, rep: Replica, r: SimRequest, n: int) -> None:
        rep.free_blocks -= n
        r.blocks += n

    def _preempt(self, rep: Replica, r: SimRequest) -> None:
        rep.running.remove(r)
        rep.free_blocks += r.blocks
        r.blocks = 0
        if r.in_prompt:  # what it had left to compute is counted again, whole, below
            rep.prompt_tokens_left -= r.known - r.computed
            r.in_prompt = False
        r.computed = 0  # recompute: prompt and output so far, as a prompt
        rep.queue(r, front=True)
        self.preemptions += 1

    # ---- a step ends -----------------------------------------------------------------------

    def _step_end(self, rep: Replica, work, event: int) -> None:
        if event:  # config.cores: only the step's latest end event counts
            entry = self._sharing.get(rep)
            if entry is None or entry[3] != event:
                return
            self._advance_shared()
            del self._sharing[rep]
            self._account(rep, work, self.now - entry[1])
            self._reschedule_shared()
        rep.busy = False
        self.busy -= 1
        if rep.pool == "prefill":
            for r, take in work:
                r.computed += take
                rep.prompt_tokens_left -= take
                if r.computed == r.known:
                    r.in_prompt = False
                    rep.running.remove(r)
                    self._sample(r)
                    if r.done_s < 0:
                        self._transfer(r)
                    else:  # its first token ended it: decode never takes it
                        self._release(r.decode)
        else:
            decodes, chunks = work
            now, itl = self.now, self.itl
            ended = []
            for r in decodes:  # inline: the simulator's hottest loop (one pass per token)
                r.computed += 1
                if r.in_prompt:  # a prompt's last token, computed as a decode
                    rep.prompt_tokens_left -= 1
                    r.in_prompt = False
                if r.generated == 0:  # a one-token prompt prefilled here
                    self._sample(r)
                else:
                    r.generated += 1
                    r.known += 1
                    itl.append(now - r.last_token_s)
                    r.last_token_s = now
                    if r.generated >= r.spec.output_tokens:
                        r.done_s = now
                if r.done_s >= 0:
                    ended.append(r)
            for r, take in chunks:
                r.computed += take
                rep.prompt_tokens_left -= take
                if r.computed == r.known:
                    r.in_prompt = False
                    self._sample(r)
                    if r.done_s >= 0:
                        ended.append(r)
            for r in ended:
                rep.running.remove(r)
                rep.free_blocks += r.blocks
                r.blocks = 0
                rep.assigned -= 1
        if rep.draining:
            self._finish_drain(rep)
        self._wake(rep)

    def _release(self, rep: Replica) -> None:
        rep.assigned -= 1
        if rep.draining:
            self._finish_drain(rep)

    def _sample(self, r: SimRequest) -> None:
        now = self.now
        r.generated += 1
        r.known += 1
        if r.generated == 1:
            r.first_token_s = now
        else:
            self.itl.append(now - r.last_token_s)
        r.last_token_s = now
        if r.generated >= r.spec.output_tokens:
            r.done_s = now

    def _transfer(self, r: SimRequest) -> None:
        seconds = 0.0
        if self.transfer is not None:
            seconds = self.transfer.seconds(r.computed * self.kv_bytes_per_token)
        if self.profile.serving is not None:
            seconds += self.profile.serving.handoff_s
        self.transfer_s += seconds
        self._push(self.now + seconds, _TRANSFERRED, r)

    def check_invariants(self) -> None:
        """Blocks: free + held == total on every decode replica; prompt tokens left == the sum
        over the replica's requests still computing a prompt."""
        for rep in self.prefills + self.decodes:
            reqs = list(rep.waiting) + rep.running
            assert rep.prompt_tokens_left == sum(r.known - r.computed for r in reqs if r.in_prompt), rep.replica_id
            if rep.pool == "decode":
                assert rep.free_blocks + sum(r.blocks for r in reqs) == rep.total_blocks, rep.replica_id

    # ---- results -----------------------------------------------------------------------------

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
                         self.transfer_s, clamped, tuple(self.flips))


def simulate(profile: Profile, config: ClusterConfig, specs: list[RequestSpec], slo: SLO, seed: int = 0,
             transfer: Transfer | None = None, split: SplitPolicy | None = None, flip_s: float = 0.5) -> SimResult:
    return Simulator(profile, config, slo, seed, transfer, split, flip_s).run(specs)
