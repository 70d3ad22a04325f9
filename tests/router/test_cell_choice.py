"""Two choices between cells without Ray (router/cells.py, routing.cell_choice "two"): the price a
router gives without deciding (Router.price), and the ingress's CellRouters pricing a request in
its first two cells at once and sending it to the cheaper one's router, on real Router objects."""

import asyncio
import random

import pytest

from cluster.config import AppConfig
from cluster.engine.kv_cache import hash_request_blocks
from router.actor import ActorRef
from router.cells import (HOT_WINDOW, CellRouters, HotPrefixes, block_key, ingress_routers, prefer, ranking,
                          spill_bound, text_key)
from router.policy import PolicyConfig, ReplicaLoad, RoutingPolicy, SessionHint
from router.router import Router

BS = 16
PROMPT = list(range(80))  # 5 blocks
H = hash_request_blocks(PROMPT, BS, b"salt")


def load(rid, pool, running=0, waiting=0, queued=0):
    return ReplicaLoad(rid, pool, 1000, 1000, running, waiting, queued)


def state(r: Router):
    """Everything a decision changes or reads: loads, work pending, sessions, counters, history, draws."""
    return (dict(r._loads), dict(r._pending_tokens), dict(r._pending_requests), list(r.sessions._entries.items()),
            r.stats(), r.recent_decisions(), r.policy.rng.getstate(), {rid: r.hashes(rid) for rid in r._loads})


def test_a_price_is_the_cost_the_decision_then_picks_and_changes_nothing():
    now = [0.0]
    r = Router(RoutingPolicy(PolicyConfig(block_size=BS, session_ttl_s=1.0), random.Random(0)), clock=lambda: now[0])
    r.report_load(load("gone", "prefill", queued=1))  # silent from here on: stale (past 3 s) when priced
    now[0] = 2.0
    for x in (load("p0", "prefill", queued=100), load("p1", "prefill"), *(load(f"d{i}", "decode") for i in range(3))):
        r.report_load(x)
    r.resync("p0", "i", 1, H[:4])  # p0 holds the first 64 tokens, behind 100 queued
    first = r.route(H, 80, session="old")  # p0: 16 + 100 = 116, p1: 80, gone: 81
    assert (first.prefill, first.compute_cost) == ("p1", 80.0) and r.pending_requests() == 2
    # two of the three decode replicas are idle still: each decision draws between them
    now[0] = 3.5  # "gone" is stale; the session "old" is past its ttl (1 s)
    before = state(r)
    # p0: 16 uncached + 100 ahead = 116; p1: 80 uncached + the 80 sent to it since its last report = 160
    assert r.price(H, 80, session="old") == 116.0
    assert state(r) == before  # nothing recorded, pending, expired, forgotten or drawn
    assert r.price(H, 80) == 116.0  # asked again: the same
    d = r.route(H, 80)  # the decision picks what was priced (the decode pair's tie drawn alike)
    assert (d.prefill, d.mode, d.compute_cost) == ("p0", "remote", 116.0) and d.decode != first.decode
    assert r.policy.rng.getstate() != before[6]  # the decision drew; the prices did not
    assert r.stats().decisions == 2 and "gone" not in r._loads  # the decision forgot the stale replica


def test_a_backlogged_cells_price_is_its_prompts_own_cost_without_the_charge():
    # both prefill replicas have 2 waiting: the cell's backlog charge (1 + 2 on work beyond the
    # least: p0 holds 64 of the 80 tokens) sends the prompt to p0 behind its 200 queued, and the
    # decision says what chose it: 16 + 200 = 216 against p1's 80 + 10 + 2 * 64 = 218. Another
    # cell's charge is over its own least, so the price two cells compare is the prompt's own work
    # there, 216 too; when the charge is what a miss pays, the price is the miss's own: p1, 80 + 10.
    r = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)))
    for x in (load("p0", "prefill", waiting=2, queued=200), load("p1", "prefill", waiting=2, queued=10),
              load("d0", "decode")):
        r.report_load(x)
    r.resync("p0", "i", 1, H[:4])
    assert r.price(H, 80) == 216.0
    d = r.route(H, 80)
    assert (d.prefill, d.compute_cost, d.prompt_cost) == ("p0", 216.0, 216.0)
    assert "pool backlogged: 2 waiting on each replica" in d.reason
    r.report_load(load("p0", "prefill", waiting=2, queued=300))  # now p1's charged miss wins: 218 < 316
    assert r.price(H, 80) == 90.0
    d = r.route(H, 80)
    assert (d.prefill, d.compute_cost, d.prompt_cost) == ("p1", 218.0, 90.0)


def test_a_local_decision_is_priced_on_its_decode_replica_and_a_cell_without_one_has_no_price():
    r = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)))
    r.report_load(load("d", "decode", running=40, queued=7))  # colocated: d computes the prompt
    r.resync("d", "i", 1, H[:2])
    assert r.price(H, 80) == 80 - 32 + 7 == r.route(H, 80).compute_cost
    assert Router().price(H, 80) is None  # no replica: what route(spill_at=...) answers EMPTY


def test_prefer_puts_the_cheaper_of_the_first_two_first_and_the_unpriced_last():
    assert prefer([3, 1, 0, 2], [50.0, 10.0]) == [1, 3, 0, 2]
    assert prefer([3, 1, 0, 2], [10.0, 10.0]) == [3, 1, 0, 2]  # a tie keeps the ranking's order
    assert prefer([3, 1, 0, 2], [None, 10.0]) == [1, 0, 2, 3]  # cell 3 has no replica for it
    assert prefer([3, 1, 0, 2], [None, None]) == [0, 2, 3, 1]


class Local:
    """A Router called as its actor's handle is (`method.remote(...)`: an awaitable), each call
    logged when it starts and when it answers (a price call yields once in between)."""

    def __init__(self, cell: int, router: Router, log: list):
        self.cell, self.router, self.log = cell, router, log

    def __getattr__(self, method):
        fn = getattr(self.router, method)

        async def call(*args, **kwargs):
            self.log.append((method, self.cell, "asked"))
            await asyncio.sleep(0)  # let the other cell's call start: they run at once
            self.log.append((method, self.cell, "answered"))
            return fn(*args, **kwargs)

        return type("M", (), {"remote": staticmethod(call)})


def test_a_request_whose_first_cell_is_swamped_goes_to_the_other_cells_replica():
    first, second = ranking(block_key(H[0]), 2)
    routers = [None, None]
    # its first cell holds the prefix on p0, behind 5,000 queued tokens and 10 prompts (under the
    # spill bound of 32: the spill walk would keep it there, behind them); the second is idle
    routers[first] = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)))
    for x in (load("p0", "prefill", running=1, waiting=9, queued=5000), load("d0", "decode")):
        routers[first].report_load(x)
    routers[first].resync("p0", "i", 1, H[:4])
    routers[second] = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)))
    for x in (load("p1", "prefill"), load("d1", "decode")):
        routers[second].report_load(x)
    log = []
    cells = CellRouters([Local(k, routers[k], log) for k in (0, 1)], spill_bound(AppConfig(model="m")))
    d = asyncio.run(cells.route.remote(H, 80, None, None))
    assert (d.prefill, d.decode, d.predicted_cached_tokens, d.compute_cost) == ("p1", "d1", 0, 80.0)
    assert log == [("price", first, "asked"), ("price", second, "asked"), ("price", first, "answered"),
                   ("price", second, "answered"), ("route", second, "asked"), ("route", second, "answered")]
    assert [routers[k].stats().decisions for k in (first, second)] == [0, 1]  # one decision, in the cheaper cell
    assert routers[first].pending_requests() == 0 and routers[second].pending_requests() == 2


def test_one_cell_is_one_router_asked_once_and_cells_choose_by_two_prices():
    one = ingress_routers(AppConfig(model="m"), "app")  # 2 replicas: one router, its actor's ref, as before
    assert isinstance(one, ActorRef) and one.name == "app/router/m"
    many = ingress_routers(AppConfig(model="m", mode="colocated", decode={"num_replicas": 2},
                                     routing={"cell_size": 1}), "app")
    assert isinstance(many, CellRouters) and len(many.refs) == 2 and many.spill_at is None
    spill = ingress_routers(AppConfig(model="m", mode="colocated", decode={"num_replicas": 2},
                                      routing={"cell_size": 1, "cell_choice": "spill"}), "app")
    assert spill.spill_at == 32


class Down:
    """A cell whose router fails every call (its actor died), as a Ray call raises."""

    def __getattr__(self, method):
        async def call(*args, **kwargs):
            raise RuntimeError(f"{method}: the router is gone")

        return type("M", (), {"remote": staticmethod(call)})


def test_a_second_cell_that_fails_leaves_the_first_to_decide_and_a_first_that_fails_fails_the_call():
    first, second = ranking(block_key(H[0]), 2)
    live = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)))
    for x in (load("p0", "prefill", queued=5000), load("d0", "decode")):
        live.report_load(x)
    refs = [None, None]
    refs[first], refs[second] = Local(first, live, []), Down()
    d = asyncio.run(CellRouters(refs, None).route.remote(H, 80, None, None))
    assert (d.prefill, d.decode, live.stats().decisions) == ("p0", "d0", 1)  # however dear: the other cannot price
    refs[first], refs[second] = Down(), Local(second, live, [])
    with pytest.raises(RuntimeError, match="price: the router is gone"):
        asyncio.run(CellRouters(refs, None).route.remote(H, 80, None, None))
    assert live.stats().decisions == 1  # nothing decided: the flow recalls where the prefix went (RouteMemory)


def test_cells_carry_the_session_to_both_prices_and_its_cell_adopts_it():
    """A session's carried replicas (RouteMemory.carried) ride on both cells' prices and on the
    decision. On idle cells the prices tie and the session's first cell decides (its replicas
    are there: it decided the session's turns before); it alone adopts the session (the other has
    none of the replicas live, and a price adopts nothing)."""
    routers = [Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(k))) for k in (0, 1)]
    log = []
    cells = CellRouters([Local(k, routers[k], log) for k in (0, 1)], None)
    homes = [ranking(text_key(f"t/s{i}"), 2)[0] for i in range(6)]
    for i, home in enumerate(homes):
        for k, r in enumerate(routers):  # idle again: the work sent since counts no more
            for x in (load(f"p{k}a", "prefill"), load(f"p{k}b", "prefill"), load(f"d{k}", "decode")):
                r.report_load(x)
        carried = (f"p{home}b", f"d{home}", 3.0)
        d = asyncio.run(cells.route.remote(H, 80, f"t/s{i}", None, carried=carried))
        assert (d.prefill, d.decode) == carried[:2] and f"session kept on p{home}b" in d.reason
        assert routers[home].sessions.peek(f"t/s{i}", 0.0) == SessionHint(*carried[:2])
    assert [len(r.sessions) for r in routers] == [homes.count(0), homes.count(1)] and set(homes) == {0, 1}
    assert [m for m, _, when in log if when == "asked"] == ["price", "price", "route"] * len(homes)


def test_a_prefix_past_half_a_cells_share_is_spread_over_more_cells_for_the_next_window_and_a_cold_one_keeps_two():
    hot = HotPrefixes(8, 6, window=32)  # 8 cells: half a cell's share is 2 of 32 requests
    keys = [1] * 12 + [2] * 2 + [3] * 3 + [4] * 5 + list(range(100, 110))
    assert [hot.choices(key) for key in keys[:-1]] == [2] * 31  # the first window knows nothing hot
    assert hot.choices(109) == 2 and hot.seen == 0  # the request that ends it
    # ceil(4 x share x 8): 1 had 12 / 32 (12 cells, at most 6), 3 had 3 / 32 (3), 4 had 5 / 32 (5);
    # 2 had exactly half a cell's share (2 cells: its first two), the others less
    assert hot.hot == {1: 6, 3: 3, 4: 5} and hot.counts == {}
    assert [hot.choices(k) for k in (1, 2, 3, 5)] == [6, 2, 3, 2]
    for _ in range(28):
        hot.choices(5)  # 5 takes the window; 1 and 3 cool
    assert hot.hot == {5: 6} and hot.choices(1) == 2 == hot.choices(3)
    assert HotPrefixes(3, 16).most == 3  # never more cells than there are


def test_a_hot_prefixs_two_priced_cells_are_drawn_from_its_first_d_and_a_cold_ones_are_its_first_two():
    hot = HotPrefixes(8, 3, random.Random(0), window=4)
    order = [5, 2, 7, 0, 1, 3, 4, 6]
    for _ in range(3):
        assert hot.order(order, 9) is order  # nothing hot yet: the ranking as it is
    drawn = [hot.order(order, 9) for _ in range(30)]  # the first ends the window: 9 is hot from it on
    assert hot.hot == {9: 3}  # the whole window: ceil(4 x 1 x 8) = 32 cells, at most 3
    assert all(sorted(o[:2]) in ([2, 5], [2, 7], [5, 7]) and sorted(o) == sorted(order) for o in drawn)
    assert [o[2:] for o in drawn] == [[c for c in order if c not in o[:2]] for o in drawn]  # the rest in order
    assert {tuple(sorted(o[:2])) for o in drawn} == {(2, 5), (2, 7), (5, 7)}  # each pair drawn, in 30


def swamped_and_idle(cells: int, holders: list[int]) -> list[Router]:
    """A router per cell: those in `holders` hold the prompt's first 4 blocks on their prefill
    replica behind 5,000 queued tokens, the others are idle."""
    routers = []
    for k in range(cells):
        r = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)))
        busy = k in holders
        r.report_load(load(f"p{k}", "prefill", running=busy, waiting=9 * busy, queued=5000 * busy))
        r.report_load(load(f"d{k}", "decode"))
        if busy:
            r.resync(f"p{k}", "i", 1, H[:4])
        routers.append(r)
    return routers


def test_a_hot_prefix_whose_two_cells_are_swamped_reaches_its_third_and_every_request_asks_two_prices():
    order = ranking(block_key(H[0]), 4)
    routers = swamped_and_idle(4, order[:2])
    log = []
    cells = CellRouters([Local(k, routers[k], log) for k in range(4)], None, random.Random(1), most_choices=3)
    for key in range(HOT_WINDOW - 1):
        cells.hot.choices(key)  # a window of as many prefixes but one request
    d = asyncio.run(cells.route.remote(H, 80, None, None))  # the window's end: H had 1 of 1,024
    # its first two, as before: dear and as dear (a tie keeps the ranking's order)
    assert d.prefill == f"p{order[0]}" and [c for m, c, _ in log if m == "price"] == [order[0], order[1]] * 2
    assert cells.hot.hot == {}
    for _ in range(HOT_WINDOW):
        cells.hot.choices(block_key(H[0]))  # H takes a whole window: hot (ceil(4 x 1 x 4) = 16, at most 3)
    assert cells.hot.hot == {block_key(H[0]): 3}
    decided = []
    for _ in range(12):
        log.clear()
        d = asyncio.run(cells.route.remote(H, 80, None, None))
        asked = [c for m, c, s in log if m == "price" and s == "asked"]
        assert len(asked) == 2 and set(asked) < set(order[:3])  # two prices, of its first three cells
        # the third, idle, wins when drawn (a miss beats 5,000 ahead); else the cheaper holder
        assert d.prefill == f"p{order[2]}" if order[2] in asked else d.prefill in (f"p{order[0]}", f"p{order[1]}")
        decided.append(d.prefill)
    assert decided.count(f"p{order[2]}") == 8  # random.Random(1)'s draws: the third in 8 of 12
    log.clear()
    cold = hash_request_blocks([7] + PROMPT[1:], BS, b"salt")  # another first block: another prefix
    asyncio.run(cells.route.remote(cold, 80, None, None))
    assert [c for m, c, s in log if m == "price" and s == "asked"] == ranking(block_key(cold[0]), 4)[:2]


def test_more_choices_are_configured_bounded_and_cost_nothing_with_two_cells_or_a_bound_of_two():
    assert AppConfig(model="m").routing.cell_max_choices == 8
    cfg = dict(model="m", mode="colocated", decode={"num_replicas": 3})
    three = ingress_routers(AppConfig(**cfg, routing={"cell_size": 1}), "app")
    assert (three.hot.cells, three.hot.most) == (3, 3)  # 8, but only 3 cells
    assert ingress_routers(AppConfig(**cfg, routing={"cell_size": 1, "cell_max_choices": 2}), "app").hot is None
    assert ingress_routers(AppConfig(**cfg, routing={"cell_size": 2}), "app").hot is None  # 2 cells: 2 choices
    for bad in (1, 65):
        with pytest.raises(ValueError, match="cell_max_choices"):
            AppConfig(model="m", routing={"cell_max_choices": bad})
    with pytest.raises(ValueError, match="routing.cell_max_choices applies only with routing.cell_choice 'two'"):
        AppConfig(model="m", routing={"cell_choice": "spill", "cell_max_choices": 3})
