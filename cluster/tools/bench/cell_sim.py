"""A discrete-event simulation of a P/D pool behind the real routers (issue 50, item 7): the real
`router.router.Router` classes in process, fed the way replicas feed them (`Router.feed`: block
events and a `ReplicaLoad`, one call per interval), with no Ray and no engines. The bench that
drives it is cluster/tools/bench/cell_quality.py; tests/tools/test_cell_quality.py pins it.

- **A prefill replica** computes one prompt at a time, FIFO: `service_a + service_b x` its uncached
  tokens (the leading blocks its cache holds when the prompt starts are not computed). Its cache is
  a block LRU of `prefill_blocks` blocks, evicted tail first as the engine's pool does
  (cluster/engine/kv_cache/block_pool.py: a prompt's end before its shared prefix). A prompt's
  blocks are looked up (and touched) when it starts and stored when it ends: the "+" events of its
  new blocks and the "-" events of what they pushed out, in order.
- **A decode replica** holds each request for `decode_s` after its prefill ends (its stream count
  is what its load reports, and what the router's spill rule reads); its cache is not modelled, so
  every decision is a remote prefill, unless a cell has no prefill replica: then its decode
  replicas prefill locally, in the same FIFO way, their caches fed like a prefill replica's.
- **The feed**: every `feed_min_s` a replica whose queue or cache changed calls `Router.feed` with
  its events since its last call and its load; one that did not change calls every `feed_max_s`
  (router/events.py's timing). Replicas are spread over four phases of the interval. The routers'
  clock is the simulation's.
- **An arm** is one router over every replica, or the cells router/cells.py makes: a replica feeds
  the router of `replica_cell(role, id, n, rank)`, its rank its index among its role's replicas
  (as Serve ranks a deployment's: 0..N-1), or with placement "hash" no rank (the placement before
  ranks: each replica by its own hash); a request is decided by `walk` over its
  `request_ranking` with the spill bound, or with two choices by the cheaper of its first two
  cells, or of two drawn from its first d for a hot prefix (`HotPrefixes`, `Router.price`,
  `prefer`: what CellRouters does); the real functions; `walk` is driven
  without an event loop, as nothing it awaits suspends.
TTFT = the prefill's end - the arrival (queue + prefill; the router's own time is not counted)."""

from __future__ import annotations

import heapq
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

from router.cells import SPREAD, HotPrefixes, NO_BOUND, keyed_ranking, prefer, ranking, replica_cell, text_key, walk
from router.policy import PolicyConfig, ReplicaLoad, RouteDecision, RoutingPolicy
from router.router import Router


@dataclass(frozen=True)
class Params:
    """The pool's physics (the bench states its choices; tests use small ones)."""

    block_size: int = 16
    service_a: float = 0.02  # seconds a prompt costs whatever its length (a step's fixed part)
    service_b: float = 1 / 20_000  # seconds an uncached prompt token costs (20,000 tokens/s a replica)
    prefill_blocks: int = 576  # a prefill replica's KV blocks
    decode_blocks: int = 160_000  # a decode replica's
    decode_s: float = 10.24  # a stream's life on its decode replica (256 tokens at 40 ms)
    feed_min_s: float = 0.02
    feed_max_s: float = 0.25


@dataclass
class Request:
    arrival: float
    system: int  # which system prompt (the bench's popularity draws it)
    tokens: int  # prompt tokens
    hashes: list  # its full blocks' hashes (hash_request_blocks)
    cached: int = 0  # prompt tokens found cached when its prefill started
    done: float = -1.0  # its prefill's end (-1: not yet)
    first: int = 0  # the cell its ranking put first
    cell: int = 0  # the cell that decided it
    spilled: bool = False  # decided by a cell other than its first
    prefill: str = ""  # the replica that computed its prompt
    decode: str = ""  # the replica that holds its stream


class BlockLRU:
    """A replica's cached blocks, least recently used first. A prompt's blocks are touched tail
    first, so its first block is the most recent and its tail is evicted before its prefix."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict = OrderedDict()

    def prefix(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` held (chained hashes: a block counts only after all before it)."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[bytes]) -> None:
        for h in reversed(hashes):
            self.blocks.move_to_end(h)

    def store(self, hashes: Sequence[bytes], events: list) -> None:
        """Cache a computed prompt's blocks; ("+", h) / ("-", h) appended to `events` in order."""
        for h in reversed(hashes):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                events.append(("+", h))
        while len(self.blocks) > self.capacity:
            h, _ = self.blocks.popitem(last=False)
            events.append(("-", h))


class Replica:
    """One simulated replica: a FIFO of prompts to compute, a block cache, decode streams."""

    def __init__(self, rid: str, role: str, capacity: int, phase: int):
        self.rid, self.role, self.phase = rid, role, phase
        self.cache = BlockLRU(capacity)
        self.queue: deque[Request] = deque()
        self.current: Request | None = None
        self.started = self.ends = 0.0
        self.streams = self.stream_blocks = 0
        self.events: list = []
        self.seq = 0
        self.fed_at = float("-inf")
        self.changed = True
        self.busy_s = 0.0  # prefill seconds started inside the measured window

    def load(self, now: float, p: Params) -> ReplicaLoad:
        """What its engine would report: the queue's uncached tokens, the running prompt's rest."""
        bs = p.block_size
        queued = sum(r.tokens - bs * self.cache.prefix(r.hashes) for r in self.queue)
        running_left, pinned = 0, self.stream_blocks
        if self.current is not None:
            left = (self.ends - now) / max(self.ends - self.started, 1e-12)
            running_left = int((self.current.tokens - self.current.cached) * max(0.0, left))
            pinned += len(self.current.hashes)
        total = self.cache.capacity if self.role == "prefill" else p.decode_blocks
        return ReplicaLoad(self.rid, self.role, max(0, total - pinned), total,
                           running=(self.current is not None) + self.streams, waiting=len(self.queue),
                           queued_prefill_tokens=queued, tokens_per_s=1 / p.service_b,
                           running_prompt_tokens=running_left)


@dataclass
class Arm:
    """Routers and who feeds which: one router (`cells` 1) or the cells of router/cells.py."""

    cells: int
    spill_at: int | None  # None: one router, asked without a bound (as the ingress does)
    routers: list = field(default_factory=list)
    member: dict = field(default_factory=dict)  # replica id -> its router
    spills: int = 0
    local: int = 0  # decisions that prefilled on a decode replica (a cell without prefill)
    two_choices: bool = False  # router/cells.py's two choices (decide_two); else its spill walk
    hot: HotPrefixes | None = None  # two choices: the ingress's count of hot prefixes (None: 2 choices always)
    drawn: list = field(default_factory=lambda: [0, 0])  # two choices: [requests of hot prefixes, their d summed]
    # in-process CPU (process_time) of the routers' calls: [seconds, calls] of Router.price and of
    # the calls that decide (route, with a spill walk's HOT and EMPTY answers)
    price_cpu: list = field(default_factory=lambda: [0.0, 0])
    route_cpu: list = field(default_factory=lambda: [0.0, 0])


def make_arm(replicas: Sequence[tuple[str, str]], cell_size: int | None, spill_at: int | None,
             config: PolicyConfig, clock, seed: int, variant: str = "cells", most_choices: int = 2,
             spread: int = SPREAD, placement: str = "rank") -> Arm:
    """`cell_size` None (or >= the replicas): one router; else ceil(len / cell_size) cells, each
    replica in router/cells.py's `replica_cell` (`placed`; `variant` "cells": its spill walk, and
    "two": its two choices, `decide_two`, a hot prefix spread over up to `most_choices` cells:
    routing.cell_max_choices), or "balanced": `balanced_cells` (bench only)."""
    n = 1 if cell_size is None else max(1, -(-len(replicas) // cell_size))
    arm = Arm(n, None if n == 1 else spill_at, two_choices=variant == "two")
    if arm.two_choices and min(most_choices, n) > 2:  # as CellRouters builds its own
        arm.hot = HotPrefixes(n, most_choices, random.Random(seed), spread=spread)
    balanced = variant == "balanced"
    arm.routers = [Router(RoutingPolicy(config, random.Random(seed * 1000 + k)), clock=clock) for k in range(n)]
    cells = balanced_cells(replicas, n) if balanced else placed(replicas, n, placement)
    for rid, cell in cells.items():
        arm.member[rid] = arm.routers[cell]
    return arm


def placed(replicas: Sequence[tuple[str, str]], n: int, placement: str = "rank") -> dict[str, int]:
    """Each replica's cell by router/cells.py's `replica_cell`: `placement` "rank", with its rank
    (its index among its role's replicas in `replicas`, as Serve ranks a deployment's 0..N-1), or
    "hash", without one (each replica by the hash of its role and id: the placement before ranks)."""
    if placement not in ("rank", "hash"):
        raise ValueError(f"placement must be 'rank' or 'hash', not {placement!r}")
    seen: dict[str, int] = {}
    out: dict[str, int] = {}
    for role, rid in replicas:
        rank = seen[role] = seen.get(role, -1) + 1
        out[rid] = replica_cell(role, rid, n, rank if placement == "rank" else None)
    return out


def balanced_cells(replicas: Sequence[tuple[str, str]], n: int) -> dict[str, int]:
    """Each role's replicas spread evenly: in order of their key, each to the highest-ranked of its
    cells holding fewer than ceil(the role's replicas / n) of that role (rendezvous hashing with
    bounded loads). Needs every replica's id in one place: an alternative the bench measures."""
    out: dict[str, int] = {}
    for role in sorted({role for role, _ in replicas}):
        ids = sorted((text_key(f"{role}/{rid}"), rid) for r, rid in replicas if r == role)
        bound, held = -(-len(ids) // n), [0] * n
        for key, rid in ids:
            cell = next(c for c in ranking(key, n) if held[c] < bound)
            held[cell] += 1
            out[rid] = cell
    return out


def run_now(coro):
    """The value of a coroutine that never suspends (walk over in-process routers)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a routing coroutine suspended: nothing in the simulation should")


def decide_two(arm: Arm, req: Request, order: list[int], key: int | None) -> RouteDecision:
    """Two choices, as router/cells.py's CellRouters decides (routing.cell_choice "two"): the
    request's first two cells (for a hot prefix two drawn from its first d: `HotPrefixes.order`)
    each price it (`Router.price`), `prefer` puts the cheaper first, and `walk` has it decide
    without a bound."""
    if arm.hot is not None and key is not None:
        order = arm.hot.order(order, key)
        d = arm.hot.hot.get(key, 2)
        if d > 2:
            arm.drawn[0] += 1
            arm.drawn[1] += d
    prices = [timed(arm.price_cpu, arm.routers[cell].price, req.hashes, req.tokens) for cell in order[:2]]

    async def ask(cell: int, spill_at: int):
        return timed(arm.route_cpu, arm.routers[cell].route, req.hashes, req.tokens, None, None, spill_at)

    req.cell, d = run_now(walk(prefer(order, prices), ask, NO_BOUND))
    req.spilled = req.cell != req.first
    arm.spills += req.spilled
    return d


def timed(acc: list, fn, *args):
    """fn(*args), its CPU time and one call added to `acc` ([seconds, calls])."""
    t0 = time.process_time()
    out = fn(*args)
    acc[0] += time.process_time() - t0
    acc[1] += 1
    return out


def decide(arm: Arm, req: Request, rng: random.Random) -> RouteDecision:
    """The arm's decision for `req` (its cell and whether it spilled set on it)."""
    if arm.cells == 1:
        return timed(arm.route_cpu, arm.routers[0].route, req.hashes, req.tokens)
    key, order = keyed_ranking(req.hashes, None, arm.cells, rng)  # the key kept for two choices
    req.first = order[0]
    if arm.two_choices:
        return decide_two(arm, req, order, key)

    async def ask(cell: int, spill_at: int):
        return timed(arm.route_cpu, arm.routers[cell].route, req.hashes, req.tokens, None, None, spill_at)

    req.cell, d = run_now(walk(order, ask, arm.spill_at))
    req.spilled = req.cell != req.first
    arm.spills += req.spilled
    return d


class Simulation:
    """One arm over one request sequence. `window`: (start, end) of arrivals measured (busy time
    is counted for prefills that start inside it)."""

    TICKS = 4  # feed phases per feed_min_s

    def __init__(self, replicas: Sequence[tuple[str, str]], arm: Arm, params: Params, seed: int,
                 window: tuple[float, float] = (0.0, float("inf"))):
        self.p, self.arm, self.window = params, arm, window
        self.now = 0.0
        self.rng = random.Random(seed)
        self.replicas = {rid: Replica(rid, role, params.prefill_blocks if role == "prefill" else params.decode_blocks,
                                      k % self.TICKS) for k, (role, rid) in enumerate(replicas)}
        self._heap: list = []
        self._n = 0

    def clock(self) -> float:
        return self.now

    def _at(self, t: float, kind: str, what) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, kind, what))

    def run(self, requests: Sequence[Request]) -> list[Request]:
        """Every request to its prefill's end (the run stops at the last: streams still held, and
        changes no feed call has carried yet, stay as they are)."""
        self._feed_all()  # each replica's first call: an empty snapshot, as a fresh replica's
        for r in requests:
            self._at(r.arrival, "arrive", r)
        self._at(self.p.feed_min_s / self.TICKS, "tick", 0)
        pending = len(requests)
        while pending:
            self.now, _, kind, what = heapq.heappop(self._heap)
            if kind == "arrive":
                self._arrive(what)
            elif kind == "prefilled":
                pending -= 1
                self._prefilled(what)
            elif kind == "stream_end":
                rep, blocks = what
                rep.streams -= 1
                rep.stream_blocks -= blocks
                rep.changed = True
            else:
                self._tick(what)
        return list(requests)

    def _arrive(self, req: Request) -> None:
        d = decide(self.arm, req, self.rng)
        rep = self.replicas[d.prefill if d.prefill is not None else d.decode]
        self.arm.local += d.prefill is None
        req.prefill = rep.rid
        req.decode = d.decode
        rep.queue.append(req)
        rep.changed = True
        if rep.current is None:
            self._start(rep)

    def _start(self, rep: Replica) -> None:
        req = rep.queue.popleft()
        held = rep.cache.prefix(req.hashes)
        rep.cache.touch(req.hashes[:held])
        req.cached = min(held * self.p.block_size, req.tokens - 1)  # the last token is always computed
        rep.current, rep.started = req, self.now
        rep.ends = self.now + self.p.service_a + self.p.service_b * (req.tokens - req.cached)
        if self.window[0] <= self.now < self.window[1]:
            rep.busy_s += rep.ends - self.now
        rep.changed = True
        self._at(rep.ends, "prefilled", rep)

    def _prefilled(self, rep: Replica) -> None:
        req, rep.current = rep.current, None
        req.done = self.now
        rep.cache.store(req.hashes, rep.events)
        rep.changed = True
        dec = self.replicas[req.decode]
        blocks = -(-req.tokens // self.p.block_size)
        dec.streams += 1
        dec.stream_blocks += blocks
        dec.changed = True
        self._at(self.now + self.p.decode_s, "stream_end", (dec, blocks))
        if rep.queue:
            self._start(rep)

    def _feed(self, rep: Replica) -> None:
        """One feed call: the first an empty snapshot, later ones the events since the last."""
        router = self.arm.member[rep.rid]
        events, rep.events = rep.events, []
        if rep.seq == 0:
            rep.seq = 1
            ok = router.feed(rep.rid, "sim", 1, None, rep.load(self.now, self.p), ([], []))
        else:
            rep.seq += bool(events)
            ok = router.feed(rep.rid, "sim", rep.seq, events or None, rep.load(self.now, self.p))
        if not ok:
            raise RuntimeError(f"router refused {rep.rid}'s events at seq {rep.seq}: the simulation lost one")
        rep.fed_at, rep.changed = self.now, False

    def _feed_all(self) -> None:
        for rep in self.replicas.values():
            self._feed(rep)

    def _tick(self, k: int) -> None:
        for rep in self.replicas.values():
            if rep.phase == k % self.TICKS and (rep.changed or rep.events or
                                                self.now - rep.fed_at >= self.p.feed_max_s - 1e-9):
                self._feed(rep)
        self._at(self.now + self.p.feed_min_s / self.TICKS, "tick", k + 1)
