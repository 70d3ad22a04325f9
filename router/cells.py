"""Routers in cells: one model version's replicas partitioned into cells of bounded size, each with
its own router (prefix index, loads, sessions: router/router.py), so that no router's work grows
with the cluster (docs/architecture.md, "Where the design saturates").

**How many.** `cell_count`: ceil(the version's most replicas / routing.cell_size), the most being
each pool's num_replicas or autoscaling.max_replicas. It comes from the config alone, so the ingress
and every replica agree on it without asking anyone, and autoscaling never changes it. One cell: the
router is the version's own, named as without cells (`app/router/group`); with more, cell K's is
`app/router/group/cell-K`.

**Which cell, rendezvous (highest random weight) hashing.** Every (key, cell) pair has a weight,
a 64-bit mix of the two; a key's cells ranked by weight, highest first, are its ranking.
- A replica feeds the cell of its Serve rank (`replica_cell`: rank mod cells). Serve ranks each
  deployment's replicas 0..N-1 (`ReplicaContext.rank`): a new replica takes the lowest rank free
  (a dead replica's replacement takes its rank, so its cell), and once a deployment is healthy
  after a downscale Serve re-ranks only the replicas above the new count into the holes
  (`reconfigure(rank)`: the replica moves its feed to its new cell, router/events.py
  RouterFeed.move; the old cell forgets it). So each pool (role) is spread evenly: N of a role give
  every cell floor(N / cells) or one more, and a replica's cell never depends on N. The prefill and
  decode pools are separate deployments, each ranked from 0, so cell K holds the prefill and the
  decode replicas of the same ranks (a small app's cells each get both roles first). A role flip
  keeps the replica in its cell (its rank is its deployment's, whatever role it plays).
  A replica without a rank (not a Serve replica: some tests) feeds the first cell of
  `role/replica_id` by the hashing below, and a flip moves it to its new role's first cell; that
  was every replica's placement before ranks, and left cells 2-15 prefill replicas of 64 apart
  (docs/benchmarks.md, "A prefix hotter than two cells").
- A request goes to the first cell of its prompt's first block hash, or of its session key when it
  has one: every request of a prefix (of a session) meets the same router, so its cache stays in
  one cell. A prompt shorter than one block, without a session, gets a random ranking.
- Two choices (`routing.cell_choice` "two", the default): the first two cells of the ranking
  each price the request (`Router.price`: what their router would decide the prompt costs on the
  replica computing it, in tokens: uncached tokens, tokens ahead, evictions; nothing recorded),
  both asked at once; the cheaper decides (`prefer`; a tie keeps the ranking's order), so a
  prefix lives in at most two cells (more when hot: below) and load picks between them, as one
  router's policy would.
  One decision per request; a round trip more than one cell's (the prices, then the decision).
  A prefix hotter than two cells (past half a cell's share of the ingress's recent requests:
  `HotPrefixes`) has its two priced cells drawn from its first d, d growing with its share (at
  most `routing.cell_max_choices`), so it lives in those d cells and load picks among them.
  A second cell whose router fails to answer is left out (the first decides); a first cell's
  failure fails the call, as one router's does (the flow falls back to RouteMemory).
- Spill (`routing.cell_choice` "spill", `walk`): the first cell is asked with `spill_at`; when
  the replica its router would choose to compute the prompt already holds that many prompts (the
  prefix is hotter than its cell; a remote prefill's decode replica is not asked) it answers HOT
  and the second-ranked cell decides, without the bound. Measured worse than two choices
  (docs/benchmarks.md, "Routing quality in cells against one router").
Either way a cell whose router knows no replica that can take the request (EMPTY, price None: a
small app spread over many cells) passes it on down the ranking.

Weights are a splitmix64 finalizer over 64-bit keys (a block hash's first 8 bytes are already
uniform; replica ids and session keys go through blake2b once): a few hundred nanoseconds a cell,
stable across processes and Python versions (not `hash()`, which is salted per process). A
request's ranking over `VECTOR_FROM` cells or more is computed with numpy over all the cells at
once (uint64 arithmetic wraps as the masked Python does; the weights are distinct, so the order is
the same to the last cell): ~10 us at 312 cells against ~100 us a cell at a time."""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Awaitable, Callable, Sequence

import numpy as np

from router.actor import ROUTER, app_actor_names, get_router, lookup, router_name
from router.policy import NoReplicaError, RouteDecision
from router.router import EMPTY, HOT

MASK = (1 << 64) - 1
CELL_SUFFIX = "/cell-"


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit ints whose output bits each depend on all input bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK
    return x ^ (x >> 31)


def text_key(text: str) -> int:
    """A replica id's or session key's 64-bit key."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def block_key(block_hash: bytes) -> int:
    """A block hash's key: its first 8 bytes (a blake2b digest: uniform already)."""
    return int.from_bytes(block_hash[:8], "little")


_SEEDS: list[int] = []  # cell K's seed: _mix(K + the golden ratio's 64 bits)


def _seeds(n: int) -> list[int]:
    while len(_SEEDS) < n:
        _SEEDS.append(_mix((len(_SEEDS) + 0x9E3779B97F4A7C15) & MASK))
    return _SEEDS


def weight(key: int, cell: int) -> int:
    return _mix(key ^ _seeds(cell + 1)[cell])


VECTOR_FROM = 16  # cells from which numpy ranks faster (8 cells: 2.8 us in Python, 4.5 with numpy; 32: 9.9, 4.6)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_R30, _R27, _R31 = np.uint64(30), np.uint64(27), np.uint64(31)
_SEED_ARRAYS: dict[int, np.ndarray] = {}  # n -> the first n seeds as uint64


def ranking(key: int, n: int) -> list[int]:
    """The cells 0..n-1 by this key's weight, highest first."""
    seeds = _seeds(n)
    if n < VECTOR_FROM:
        return sorted(range(n), key=lambda cell: _mix(key ^ seeds[cell]), reverse=True)
    arr = _SEED_ARRAYS.get(n)
    if arr is None:
        arr = _SEED_ARRAYS[n] = np.array(seeds[:n], dtype=np.uint64)
    x = arr ^ np.uint64(key)  # _mix, every cell at once (uint64 products wrap: & MASK)
    x = (x ^ (x >> _R30)) * _M1
    x = (x ^ (x >> _R27)) * _M2
    x ^= x >> _R31
    return np.argsort(x)[::-1].tolist()


def replica_cell(role: str, replica_id: str, n: int, rank: int | None = None) -> int:
    """The cell a replica playing `role` feeds (0 when there is one cell): its Serve rank's (rank
    mod n), else (no rank) the first cell of `role/replica_id` by rendezvous hashing."""
    if n == 1:
        return 0
    if rank is not None:
        return rank % n
    key = text_key(f"{role}/{replica_id}")
    return max(range(n), key=lambda cell: weight(key, cell))


def request_key(hashes: Sequence[bytes], session: str | None) -> int | None:
    """What ranks a request's cells: its session key's, else its first block's (None: neither)."""
    if session is not None:
        return text_key(session)
    return block_key(hashes[0]) if hashes else None


def keyed_ranking(hashes: Sequence[bytes], session: str | None, n: int,
                  rng: random.Random) -> tuple[int | None, list[int]]:
    """(request_key, the request's cells best first): by its session key, else its first block,
    else (key None) at random."""
    key = request_key(hashes, session)
    return key, ranking(rng.getrandbits(64) if key is None else key, n)


def request_ranking(hashes: Sequence[bytes], session: str | None, n: int, rng: random.Random) -> list[int]:
    """A request's cells, best first (keyed_ranking's)."""
    return keyed_ranking(hashes, session, n, rng)[1]


def cell_count(cfg) -> int:
    """One model version's cells (`cfg`: its AppConfig, AppConfig.served_versions)."""
    pools = ("prefill", "decode") if cfg.has_prefill_pool else ("decode",)
    most = 0
    for pool in pools:
        opts = getattr(cfg, pool)
        most += opts.autoscaling.max_replicas if opts.autoscaling is not None else opts.num_replicas
    return max(1, -(-most // cfg.routing.cell_size))


def spill_bound(cfg) -> int | None:
    """Prompts on the replica chosen to compute one at which a cell spills
    (routing.cell_spill_requests); None with two choices (routing.cell_choice "two")."""
    r = cfg.routing
    if r.cell_choice == "two":
        return None
    return r.hot_load_cap if r.cell_spill_requests is None else r.cell_spill_requests


def cell_router(cfg, app: str, role: str, replica_id: str, rank: int | None = None):
    """The router a replica playing `role` feeds: its cell's (the version's own with one cell)."""
    n = cell_count(cfg)
    return get_router(cfg.serving_group, app, None if n == 1 else replica_cell(role, replica_id, n, rank))


Ask = Callable[[int, "int | None"], Awaitable["RouteDecision | str"]]


NO_BOUND = 1 << 62  # spill_at for a cell that must decide: never HOT (still EMPTY when it has no replica)


async def walk(order: Sequence[int], ask: Ask, spill_at: int) -> tuple[int, RouteDecision]:
    """(cell, decision): the first cell of `order` asked with `spill_at`; one answering HOT hands
    the request to the next, which (like any after it) must decide (NO_BOUND); EMPTY passes it
    on. A hot cell that no later cell could relieve (all EMPTY) decides after all. None can:
    NoReplicaError."""
    hot = None
    for cell in order:
        answer = await ask(cell, spill_at if hot is None else NO_BOUND)
        if answer == HOT:
            hot = cell
        elif answer != EMPTY:
            return cell, answer
    if hot is not None:
        answer = await ask(hot, NO_BOUND)
        if answer != EMPTY:
            return hot, answer
    raise NoReplicaError(f"no cell of {len(order)} has a replica for this request")


def prefer(order: Sequence[int], prices: Sequence["float | None"]) -> list[int]:
    """Two choices: `order` (a request's ranking) with its first len(prices) cells (two) put
    cheapest first (a tie keeps the ranking's order) and those priced None (no replica for the
    request: EMPTY) put last; the first cell of the result decides (walk with NO_BOUND)."""
    k = len(prices)
    priced = sorted((p, i) for i, p in enumerate(prices) if p is not None)
    return ([order[i] for _, i in priced] + list(order[k:])
            + [order[i] for i, p in enumerate(prices) if p is None])


HOT_WINDOW = 1024  # requests an ingress counts before it reads which prefixes are hot
SPREAD = 4  # a hot prefix's cells: ceil(SPREAD x its share x the cells)


class HotPrefixes:
    """Which two cells price a request (two choices): its ranking's first two, or, for a prefix
    hotter than two cells, two drawn from its first d. A prefix past half a cell's share of the
    requests (1 / (2 x cells)) gets d = ceil(`spread` x share x cells) cells, spread 4 (at most
    `most`, routing.cell_max_choices, and the cells), so each carries about a quarter of a cell's
    share of it, and its cache stays in those d: d grows with its share, not with the cells
    (measured against 2 and 3: docs/benchmarks.md, "A prefix hotter than two cells").

    Drawn, not all d priced: a cell that does not hold the prefix prices its miss (~1,650 tokens
    for 1,024 of prefix) above a holder's queued hit (~750), so a third price almost never won a
    request (0 of 4,612 in one run: docs/benchmarks.md, "A prefix hotter than two cells") and the
    prefix never came to be held there; a drawn pair without a holder seeds it, and load then
    picks among the d as among two. Each request still asks two prices.

    The share is counted here, at the ingress, over windows of `window` requests (its ranking key:
    the session's or the first block's); a window's end sets the hot keys for the next one (a
    prefix that cools is back to its first two after a window; the first window has none). A
    request costs a dict update and a lookup, a hot one a draw; a window's end one pass over its
    counts (at most `window` keys; fewer than 2 x `cells` hot). Each ingress process counts its own
    requests: a share, not a rate, so many ingresses agree."""

    def __init__(self, cells: int, most: int, rng: random.Random | None = None, window: int = HOT_WINDOW,
                 spread: int = SPREAD):
        self.cells, self.most, self.window, self.spread = cells, min(most, cells), window, spread
        self.rng = rng or random.Random()
        self.counts: dict[int, int] = {}
        self.seen = 0
        self.hot: dict[int, int] = {}  # key -> its cells (d), from the last window

    def choices(self, key: int) -> int:
        """Counts a request of `key`; the cells it is spread over (d: 2 for all but hot ones)."""
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        self.seen += 1
        if self.seen >= self.window:
            self.roll()
        return self.hot.get(key, 2)

    def roll(self) -> None:
        """A window's end: a key counted c times of `seen` is spread over min(most, ceil(spread x
        c x cells / seen)) cells until the next, where that is more than 2."""
        n, seen, k = self.cells, self.seen, self.spread
        self.hot = {key: min(self.most, -(-k * c * n // seen))
                    for key, c in self.counts.items() if k * c * n > 2 * seen}
        self.counts, self.seen = {}, 0

    def order(self, order: list[int], key: int) -> list[int]:
        """`order` (the request's ranking, of `key`) with the two cells to price first: as it is,
        or for a hot key two of its first d drawn at random (the rest after them, in order)."""
        d = self.choices(key)
        if d == 2:
            return order
        a, b = self.rng.sample(range(d), 2)
        rest = order[:]  # the others in order (deletes at C speed: 312 cells cost ~8 us as a comprehension)
        del rest[max(a, b)], rest[min(a, b)]
        return [order[a], order[b]] + rest


class _Method:
    """`x.remote(...)`: an awaitable, as a router actor's method gives (what RequestFlow awaits)."""

    def __init__(self, fn):
        self.remote = fn


class CellRouters:
    """The ingress's router for a version in cells: it is called as one router actor's handle is
    (`route.remote(...)`, `live_loads.remote()`: awaitables; `configure.remote(...)`: sent), so
    the request flow is the same with one router or many. `refs`: cell K's router (ActorRef);
    `spill_at`: None for two choices, else the spill bound (module docstring); `most_choices`: the
    most cells a hot prefix is spread over (routing.cell_max_choices; HotPrefixes)."""

    def __init__(self, refs: Sequence, spill_at: int | None, rng: random.Random | None = None,
                 most_choices: int = 2):
        self.refs = list(refs)
        self.spill_at = spill_at
        self.rng = rng or random.Random()
        self.hot = HotPrefixes(len(self.refs), most_choices, self.rng) if spill_at is None and min(
            most_choices, len(self.refs)) > 2 else None
        self.route = _Method(self._route)
        self.live_loads = _Method(self._live_loads)
        self.configure = _Method(self._configure)

    async def _route(self, hashes: Sequence[bytes], num_prompt_tokens: int, session: str | None = None,
                     group: str | None = None, carried: tuple | None = None) -> RouteDecision:
        async def ask(cell: int, spill_at: int):
            return await self.refs[cell].route.remote(hashes, num_prompt_tokens, session, group, spill_at,
                                                      carried=carried)

        key, order = keyed_ranking(hashes, session, len(self.refs), self.rng)
        if self.spill_at is not None:
            _, decision = await walk(order, ask, self.spill_at)
            return decision
        if self.hot is not None and key is not None:
            order = self.hot.order(order, key)
        prices = await asyncio.gather(*(self.refs[cell].price.remote(hashes, num_prompt_tokens, session, group,
                                                                     carried=carried)
                                        for cell in order[:2]), return_exceptions=True)
        if isinstance(prices[0], Exception):  # the request's own cell's router failed: as with one cell
            raise prices[0]
        if isinstance(prices[1], Exception):  # the second's failed: the first decides, as before two choices
            prices[1] = None
        _, decision = await walk(prefer(order, prices), ask, NO_BOUND)
        return decision

    async def _live_loads(self) -> list:
        return [load for loads in await asyncio.gather(*(r.live_loads.remote() for r in self.refs)) for load in loads]

    def _configure(self, *args) -> list:
        """Each cell's router takes the policy (fire and forget, as one router's `configure.remote`)."""
        return [r.configure.remote(*args) for r in self.refs]


def ingress_routers(cfg, app: str):
    """A version's router as the ingress calls it: the one router's RouterRef (`route` and `price`
    over its channel: router/channel.py), or its cells'."""
    n = cell_count(cfg)
    if n == 1:
        return get_router(cfg.serving_group, app, channel=True)
    return CellRouters([get_router(cfg.serving_group, app, cell, channel=True) for cell in range(n)], spill_bound(cfg),
                       most_choices=cfg.routing.cell_max_choices)


def cell_of_name(name: str) -> int | None:
    """The cell of a router's actor name (None: a version's only router)."""
    head, sep, tail = name.rpartition(CELL_SUFFIX)
    return int(tail) if sep and tail.isdigit() else None


def group_router_names(app: str, group: str) -> list[str]:
    """The live routers of one version of an app: its own, or its cells' (creates none)."""
    own = router_name(app, group)
    return [n for n in app_actor_names(app, ROUTER) if n == own or n.startswith(own + CELL_SUFFIX)]


async def group_loads(app: str, groups: Sequence[str]) -> list:
    """Every live replica load the routers of these versions hold (each replica is in one cell)."""
    def find() -> list:  # GCS calls: off the caller's loop
        names = [n for g in groups for n in group_router_names(app, g)]
        return [h for h in map(lookup, names) if h is not None]

    handles = await asyncio.to_thread(find)
    return [load for loads in await asyncio.gather(*(h.live_loads.remote() for h in handles)) for load in loads]
