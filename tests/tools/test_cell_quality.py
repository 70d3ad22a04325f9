"""The cell-quality simulation's mechanics (cluster/tools/bench/cell_sim.py, cell_quality.py), on
cases small enough to work out by hand: no Ray, no engines, the real routers."""

import random

import pytest

from cluster.engine.kv_cache import hash_request_blocks
from cluster.tools.bench.cell_quality import Workload, label, pool, rate
from cluster.tools.bench.cell_sim import BlockLRU, Params, Request, Simulation, balanced_cells, make_arm, placed
from router.cells import replica_cell, request_ranking
from router.policy import PolicyConfig

BS = 16
# a prompt: a 64-token system prompt (4 blocks) + a fresh 32-token suffix (2 blocks)
P = Params(block_size=BS, service_a=0.01, service_b=0.001, prefill_blocks=6, decode_blocks=1000, decode_s=0.5)


def prompt(system: int, suffix: int, t: float) -> Request:
    tokens = [1000 * (system + 1) + i for i in range(64)] + [50_000 + 100 * suffix + i for i in range(32)]
    return Request(t, system, len(tokens), hash_request_blocks(tokens, BS, b"s"))


def simulate(replicas, reqs, cell_size=None, spill_at=None, seed=0, variant="cells", most_choices=2, window=None):
    box = []
    arm = make_arm(replicas, cell_size, spill_at, PolicyConfig(block_size=BS), lambda: box[0].now, seed, variant,
                   most_choices)
    if window is not None:
        arm.hot.window = window
    sim = Simulation(replicas, arm, P, seed)
    box.append(sim)
    return sim.run(reqs), sim, arm


def test_the_lru_evicts_a_prompts_tail_before_its_shared_prefix():
    lru, events = BlockLRU(4), []
    lru.store([b"a", b"b", b"c"], events)
    assert events == [("+", b"c"), ("+", b"b"), ("+", b"a")]
    events.clear()
    lru.store([b"a", b"d", b"e"], events)  # a shared first block: touched; c, the oldest tail, goes
    assert events == [("+", b"e"), ("+", b"d"), ("-", b"c")]
    assert list(lru.blocks) == [b"b", b"e", b"d", b"a"]
    assert (lru.prefix([b"a", b"d", b"x"]), lru.prefix([b"x", b"a"])) == (2, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_prefill_replicas_of_one_prompts_room_each_keep_one_prompt_each(seed):
    """A1, B1, A2, B2 a second apart: A1 goes to either (a tie), B1 to the other (the capacity
    term: on A1's replica it would evict 6 cached blocks), A2 and B2 back to their prompt's
    replica, each finding its 4 system blocks (64 tokens) and computing its 32-token suffix."""
    replicas = [("prefill", "pa"), ("prefill", "pb"), ("decode", "d")]
    done, sim, arm = simulate(replicas, [prompt(0, 0, 0.0), prompt(1, 1, 1.0), prompt(0, 2, 2.0), prompt(1, 3, 3.0)],
                              seed=seed)
    assert [r.cached for r in done] == [0, 0, 64, 64]
    assert [round(r.done - r.arrival, 9) for r in done] == [0.106, 0.106, 0.042, 0.042]  # 10 ms + 1 ms a token
    a1, b1, a2, b2 = done
    assert a1.prefill == a2.prefill != b1.prefill == b2.prefill and {r.decode for r in done} == {"d"}
    # the router's index is what the replicas' caches hold: A2's 6 blocks (A1's suffix evicted)
    assert arm.routers[0].hashes(a2.prefill) == set(sim.replicas[a2.prefill].cache.blocks) == set(a2.hashes)
    # B2 ended the run (at 3.042 s) before its replica's next feed call: the router still knows B1's
    assert set(sim.replicas[b2.prefill].cache.blocks) == set(b2.hashes)
    assert arm.routers[0].hashes(b2.prefill) == set(b1.hashes)
    # each stream holds d for 0.5 s: A1's, B1's and A2's ended, B2's holds it when the run ends
    assert (arm.spills, arm.local, sim.replicas["d"].streams, sim.replicas["d"].stream_blocks) == (0, 0, 1, 6)


def two_cells(n: int = 2) -> list[tuple[str, str]]:
    """One prefill and one decode replica in each of n cells, as router/cells.py places them."""
    out = []
    for role in ("prefill", "decode"):
        ids = [f"{role}-{i}" for i in range(64)]
        out += [(role, next(rid for rid in ids if replica_cell(role, rid, n) == cell)) for cell in range(n)]
    return out


def test_a_request_past_its_cells_bound_is_decided_by_its_second_cell():
    """Two of prompt A 1 ms apart (no feed call between: the router counts the first as pending).
    Bound 1: the second finds its first cell's prefill replica holding one request and goes to the
    other cell, where nothing waits (and nothing is cached); bound 2: it queues behind the first in its
    own cell."""
    replicas = two_cells()
    first = request_ranking(prompt(0, 0, 0.0).hashes, None, 2, random.Random(0))[0]
    done, _, arm = simulate(replicas, [prompt(0, 0, 0.0), prompt(0, 1, 0.001)], cell_size=2, spill_at=1)
    assert arm.cells == 2 and [(r.first, r.cell, r.spilled) for r in done] == [(first, first, False),
                                                                              (first, 1 - first, True)]
    assert [round(r.done - r.arrival, 9) for r in done] == [0.106, 0.106] and arm.spills == 1
    assert done[0].prefill != done[1].prefill
    done, _, arm = simulate(replicas, [prompt(0, 0, 0.0), prompt(0, 1, 0.001)], cell_size=2, spill_at=2)
    assert [(r.cell, r.spilled) for r in done] == [(first, False), (first, False)] and arm.spills == 0
    # it waits 105 ms, then finds the first's system blocks: 10 ms + 32 tokens
    assert [round(r.done - r.arrival, 9) for r in done] == [0.106, 0.147] and done[1].cached == 64


def test_two_choices_send_the_second_request_to_the_cheaper_cell():
    """Both cells idle: the first request goes to its first cell (a tie keeps the ranking's order);
    the second, 1 ms on, would wait behind the first's 96 tokens there (a cost of 96 + 96) and
    costs 96 in the other cell: it goes there, and no cell was asked with a bound."""
    replicas = two_cells()
    first = request_ranking(prompt(0, 0, 0.0).hashes, None, 2, random.Random(0))[0]
    done, _, arm = simulate(replicas, [prompt(0, 0, 0.0), prompt(0, 1, 0.001)], cell_size=2, variant="two")
    assert [(r.cell, r.spilled) for r in done] == [(first, False), (1 - first, True)] and arm.spills == 1
    assert [round(r.done - r.arrival, 9) for r in done] == [0.106, 0.106]
    assert sum(r.stats().spilled for r in arm.routers) == 0
    # through the product's calls: each request priced in both cells, decided in one
    assert (arm.price_cpu[1], arm.route_cpu[1]) == (4, 2)
    assert [r.stats().decisions for r in arm.routers] == [1, 1]


def test_a_prefix_hotter_than_two_cells_is_decided_in_more_after_a_window_each_request_priced_in_two():
    """4 cells of one prefill and one decode replica; one system prompt, a request every 50 ms
    (each 42-106 ms of prefill). Past a window of 16 requests, all of one prefix, it is spread
    over ceil(4 x 1 x 4) = 16 cells, at most 4: its requests are priced in two drawn from all 4,
    and the cells its first two never hold come to decide some; with most_choices 2, never."""
    replicas = two_cells(4)
    reqs = [prompt(0, i, 0.05 * i) for i in range(48)]
    first_two = set(request_ranking(reqs[0].hashes, None, 4, random.Random(0))[:2])
    done, _, arm = simulate(replicas, reqs, cell_size=2, variant="two")
    assert arm.cells == 4 and arm.hot is None and {r.cell for r in done} == first_two
    reqs = [prompt(0, i, 0.05 * i) for i in range(48)]
    done, _, arm = simulate(replicas, reqs, cell_size=2, variant="two", seed=2, most_choices=4, window=16)
    assert {r.cell for r in done[:15]} == first_two  # the first window: its first two, as before
    later = [r.cell for r in done[15:]]  # the 16th ends the window: drawn, as the 32 after it
    assert set(later) == {0, 1, 2, 3} and sum(c not in first_two for c in later) == 18  # of 33
    assert arm.drawn == [33, 132] and (arm.price_cpu[1], arm.route_cpu[1]) == (96, 48)  # two prices a request


def test_balanced_cells_give_each_cell_an_equal_share_of_each_role():
    replicas = [("prefill", f"p{i}") for i in range(16)] + [("decode", f"d{i}") for i in range(48)]
    cells = balanced_cells(replicas, 2)
    assert sorted(sum(cells[r] == c for _, r in replicas[:16]) for c in (0, 1)) == [8, 8]
    assert sorted(sum(cells[r] == c for _, r in replicas[16:]) for c in (0, 1)) == [24, 24]


def test_the_arms_place_replicas_by_the_products_replica_cell_by_rank_or_by_hash():
    """Seed 2's pool at R = 256 in 8 cells (docs/benchmarks.md: its cells of 15 and 4 prefill
    replicas by hash): by rank (the product's), 8 prefill and 24 decode replicas each."""
    replicas = pool(256, random.Random(2))
    role_counts = {pl: [[sum(cells[r] == k for role, r in replicas if role == want) for k in range(8)]
                        for want in ("prefill", "decode")]
                   for pl, cells in (("rank", placed(replicas, 8)), ("hash", placed(replicas, 8, "hash")))}
    assert role_counts["rank"] == [[8] * 8, [24] * 8]
    assert role_counts["hash"] == [[15, 12, 9, 5, 6, 4, 6, 7], [21, 30, 21, 23, 25, 19, 28, 25]]
    # each through router/cells.py's replica_cell: the k-th replica of a role has rank k
    ranked = placed(replicas, 8)
    assert all(ranked[rid] == replica_cell(role, rid, 8, k % 64 if role == "prefill" else k - 64)
               for k, (role, rid) in enumerate(replicas))
    hashed = placed(replicas, 8, "hash")
    assert all(hashed[rid] == replica_cell(role, rid, 8) for role, rid in replicas)
    arm = make_arm(replicas, 32, None, PolicyConfig(), lambda: 0.0, 0, "two", 8, placement="hash")
    members = [sum(arm.member[r] is arm.routers[k] for _, r in replicas) for k in range(8)]
    assert members == [36, 42, 30, 28, 31, 23, 34, 32]  # the two roles' counts above, summed
    assert label(32, None, "two", 8, placement="hash") == "cells of 32, up to 8 choices, by hash"
    with pytest.raises(ValueError, match="placement must be 'rank' or 'hash', not 'ring'"):
        placed(replicas, 8, "ring")


def test_the_arrival_rate_is_the_load_times_the_pools_capacity_at_full_hits():
    # 16 prefill replicas, each 20 ms + 50 us x 256 mean suffix tokens = 32.8 ms a request
    assert rate(Workload(64, 0.5), Params()) == pytest.approx(0.5 * 16 / 0.0328)
    assert Workload(256).systems == 256 and Workload(64).systems == 64
