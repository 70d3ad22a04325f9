"""Routers in cells without Ray (router/cells.py): how many cells, which cell a replica feeds and a
request asks, and the spill and pass-on rules, on real Router objects."""

import asyncio
import random
from collections import Counter

import pytest

from cluster.config import AppConfig
from cluster.engine.kv_cache import hash_request_blocks
from router.cells import (MASK, NO_BOUND, VECTOR_FROM, block_key, cell_count, cell_of_name, ranking, replica_cell,
                          request_ranking, spill_bound, text_key, walk, weight)
from router.actor import router_name
from router.policy import NoReplicaError, PolicyConfig, ReplicaLoad, RoutingPolicy
from router.router import EMPTY, HOT, Router

BS = 16
PROMPT = list(range(80))


def load(rid, pool, running=0, waiting=0):
    return ReplicaLoad(rid, pool, 1000, 1000, running, waiting)


def router(*loads):
    r = Router(RoutingPolicy(PolicyConfig(block_size=BS), random.Random(0)))
    for x in loads:
        r.report_load(x)
    return r


def test_the_number_of_cells_comes_from_the_most_replicas_and_the_cell_size():
    assert cell_count(AppConfig(model="m")) == 1  # 1 prefill + 1 decode, cell_size 32: as without cells
    assert cell_count(AppConfig(model="m", prefill={"num_replicas": 16}, decode={"num_replicas": 16})) == 1
    assert cell_count(AppConfig(model="m", prefill={"num_replicas": 16}, decode={"num_replicas": 17})) == 2
    scaled = {"num_replicas": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 90}}
    assert cell_count(AppConfig(model="m", decode=scaled, routing={"cell_size": 10})) == 10  # 1 + 90 replicas
    # colocated: the prefill section is not a pool
    assert cell_count(AppConfig(model="m", mode="colocated", decode={"num_replicas": 2}, routing={"cell_size": 1})) == 2
    assert spill_bound(AppConfig(model="m")) is None  # two choices, the default: no bound
    assert spill_bound(AppConfig(model="m", routing={"cell_choice": "spill"})) == 32  # hot_load_cap
    assert spill_bound(AppConfig(model="m", routing={"cell_choice": "spill", "cell_spill_requests": 5})) == 5
    with pytest.raises(ValueError, match="routing.cell_spill_requests applies only with routing.cell_choice 'spill'"):
        AppConfig(model="m", routing={"cell_spill_requests": 5})
    with pytest.raises(ValueError, match="cell_choice"):
        AppConfig(model="m", routing={"cell_choice": "three"})
    with pytest.raises(ValueError, match="cell_size"):
        AppConfig(model="m", routing={"cell_size": 0})
    with pytest.raises(ValueError, match="cell_size"):
        AppConfig(model="m", routing={"cell_size": 4097})


def test_rendezvous_rankings_are_fixed_and_a_new_cell_takes_replicas_only_for_itself():
    # fixed across processes and versions: the ingress and every replica compute the same
    assert ranking(block_key(bytes(range(16))), 4) == [3, 2, 0, 1]
    assert ranking(text_key("conv-1"), 4) == [1, 2, 3, 0]
    assert [replica_cell("decode", f"r{i}", 3) for i in range(8)] == [1, 2, 2, 1, 1, 2, 2, 1]
    assert [replica_cell("prefill", f"r{i}", 3) for i in range(8)] == [2, 1, 0, 2, 0, 2, 0, 2]  # the role counts
    assert replica_cell("decode", "r0", 1) == 0
    four = {i: replica_cell("decode", f"r{i}", 4) for i in range(1000)}
    assert sorted(Counter(four.values()).items()) == [(0, 239), (1, 251), (2, 260), (3, 250)]
    five = {i: replica_cell("decode", f"r{i}", 5) for i in range(1000)}
    moved = [i for i in four if five[i] != four[i]]
    assert len(moved) == 192 and {five[i] for i in moved} == {4}  # only to the new cell; the rest stay


def test_a_ranking_over_many_cells_is_every_cells_weight_in_order():
    """From VECTOR_FROM cells the ranking is computed with numpy: the same order, to the last cell,
    as each cell's weight sorted one at a time (what it was before, and is below VECTOR_FROM)."""
    rng = random.Random(3)
    for n in (VECTOR_FROM - 1, VECTOR_FROM, 312):
        for key in [0, MASK] + [rng.getrandbits(64) for _ in range(200)]:
            assert ranking(key, n) == sorted(range(n), key=lambda cell: weight(key, cell), reverse=True)
    assert ranking(block_key(bytes(range(16))), 40)[:6] == [39, 34, 26, 17, 29, 4]
    assert ranking(text_key("conv-1"), 312)[:6] == [300, 82, 50, 102, 198, 221]


def test_replicas_by_serve_rank_spread_each_role_evenly_and_keep_their_cell_as_the_pool_grows():
    # Serve ranks a deployment's replicas 0..N-1: a replica's cell is its rank mod the cells
    assert [replica_cell("prefill", f"r{i}", 3, rank=i) for i in range(8)] == [0, 1, 2, 0, 1, 2, 0, 1]

    def counts(role: str, n_replicas: int, cells: int, rank: bool) -> list[int]:
        c = Counter(replica_cell(role, f"{role}-{i}", cells, i if rank else None) for i in range(n_replicas))
        return [c[k] for k in range(cells)]

    # 256 replicas, P:D 1:3, in 8 cells of 32 (docs/benchmarks.md, "A prefix hotter than two cells"):
    # by rank, each cell 8 prefill and 24 decode replicas; by hash (no rank), 5-12 and 14-32
    assert counts("prefill", 64, 8, True) == [8] * 8 and counts("decode", 192, 8, True) == [24] * 8
    assert counts("prefill", 64, 8, False) == [7, 12, 6, 9, 5, 8, 7, 10]
    assert counts("decode", 192, 8, False) == [14, 28, 28, 27, 18, 25, 32, 20]
    # N of a role over n cells: floor(N / n) each, the first N mod n one more
    assert counts("decode", 67, 8, True) == [9, 9, 9, 8, 8, 8, 8, 8]
    assert counts("prefill", 3, 8, True) == [1, 1, 1, 0, 0, 0, 0, 0]  # a small app: cells 0-2 hold both roles
    # as the pool grows (autoscaling takes the next rank) no replica moves: its cell is its rank's alone
    grown = [[replica_cell("decode", f"r{i}", 8, i) for i in range(size)] for size in (1, 9, 40, 67)]
    assert all(big[:len(small)] == small for small, big in zip(grown, grown[1:]))
    # whatever role it plays (a flip keeps its cell); one cell: 0
    assert replica_cell("prefill", "a", 8, 13) == replica_cell("decode", "a", 8, 13) == 5
    assert replica_cell("decode", "a", 1, 13) == 0
    # no rank (not a Serve replica): the hash of its role and id, as pinned above
    assert replica_cell("decode", "r1", 3, None) == replica_cell("decode", "r1", 3) == 2


def test_a_request_ranks_cells_by_its_session_else_its_first_block():
    h = hash_request_blocks(PROMPT, BS, b"salt")
    other_tail = hash_request_blocks(PROMPT[:16] + [999] * 64, BS, b"salt")
    rng = random.Random(0)
    assert request_ranking(h, None, 8, rng) == request_ranking(other_tail, None, 8, rng) == ranking(block_key(h[0]), 8)
    assert request_ranking(h, "conv-1", 4, rng) == [1, 2, 3, 0]  # the session key's, whatever the prompt
    assert request_ranking([], None, 4, random.Random(7)) == ranking(random.Random(7).getrandbits(64), 4)


def test_router_names_carry_the_cell():
    assert router_name("app", "tiny@v1") == "app/router/tiny@v1" and cell_of_name("app/router/tiny@v1") is None
    assert router_name("app", "tiny@v1", 3) == "app/router/tiny@v1/cell-3"
    assert cell_of_name(router_name("app", "tiny@v1", 3)) == 3


def test_a_cell_answers_hot_when_every_replica_it_chose_holds_the_bound():
    h = hash_request_blocks(PROMPT, BS, b"salt")
    r = router(load("p", "prefill", running=3), load("d", "decode", running=2, waiting=1))
    assert r.route(h, 80, spill_at=3) == HOT  # p: 3 requests, d: 3
    assert (r.recent_decisions(), r.pending_requests(), r.stats().spilled) == ([], 0, 1)  # nothing recorded
    d = r.route(h, 80, spill_at=4)  # both below 4: a decision, recorded
    assert (d.prefill, d.decode, d.mode) == ("p", "d", "remote")
    assert r.pending_requests() == 2
    assert r.route(h, 80, spill_at=4) == HOT  # the work it sent counts: 4 each now
    assert router(load("p", "prefill")).route(h, 80, spill_at=1) == EMPTY  # no decode replica here
    with pytest.raises(NoReplicaError):
        router(load("p", "prefill")).route(h, 80)  # without a bound: as before cells


def test_a_cell_is_hot_by_the_replica_computing_the_prompt_whatever_its_decode_replica_holds():
    h = hash_request_blocks(PROMPT, BS, b"salt")
    swamped = router(load("p", "prefill", running=1, waiting=4), load("d", "decode", running=2))
    assert swamped.route(h, 80, spill_at=5) == HOT  # p: 5 requests; d's 2 streams do not hold it back
    idle_prefill = router(load("p", "prefill", running=1), load("d", "decode", running=40))
    d = idle_prefill.route(h, 80, spill_at=5)  # d's 40 streams say nothing of the prefix
    assert (d.prefill, d.decode, d.mode) == ("p", "d", "remote")
    local = router(load("d", "decode", waiting=5))  # no prefill replica: d prefills, and 5 prompts wait there
    assert local.route(h, 80, spill_at=5) == HOT


def test_a_colocated_replicas_streams_do_not_make_its_cell_hot_its_waiting_prompts_do():
    h = hash_request_blocks(PROMPT, BS, b"salt")
    streaming = router(load("d", "decode", running=40, waiting=1))  # 40 streams, 1 prompt waiting
    d = streaming.route(h, 80, spill_at=32)  # the default bound: it decides (it answered HOT before)
    assert (d.prefill, d.decode, d.mode) == (None, "d", "local")
    assert streaming.route(h, 80, spill_at=2) == HOT  # 1 waiting + the one just sent: 2 prompts
    short_miss = router(load("p", "prefill"), load("d", "decode", running=40))  # P/D, the prompt cached on d:
    short_miss.index.resync("d", "i", 1, h[:4])  # 16 uncached tokens, under local_prefill_threshold
    d = short_miss.route(h, 80, spill_at=32)
    assert (d.prefill, d.decode, d.mode) == (None, "d", "local")


def test_a_hot_cell_spills_to_the_second_which_decides_without_the_bound():
    h = hash_request_blocks(PROMPT, BS, b"salt")
    cells = [router(load("p0", "prefill", running=9), load("d0", "decode", running=9)),
             router(load("p1", "prefill", running=9), load("d1", "decode", running=9)),
             router(load("p2", "prefill"), load("d2", "decode"))]
    asked = []

    async def ask(cell, spill_at):
        asked.append((cell, spill_at))
        return cells[cell].route(h, 80, spill_at=spill_at)

    cell, d = asyncio.run(walk([0, 1, 2], ask, 5))
    assert (cell, d.prefill, d.decode) == (1, "p1", "d1")  # the second, hot too: it decides, no third
    assert asked == [(0, 5), (1, NO_BOUND)]
    assert [c.pending_requests() for c in cells] == [0, 2, 0]


def test_empty_cells_pass_the_request_on_and_a_hot_cell_decides_when_no_other_can():
    h = hash_request_blocks(PROMPT, BS, b"salt")
    empty, hot = router(load("p", "prefill")), router(load("d", "decode", waiting=9))
    asked = []

    def asker(cells):
        async def ask(cell, spill_at):
            asked.append((cell, spill_at))
            return cells[cell].route(h, 80, spill_at=spill_at)
        return ask

    cell, d = asyncio.run(walk([0, 1, 2], asker([empty, empty, router(load("d", "decode"))]), 5))
    assert (cell, d.decode, d.mode, asked) == (2, "d", "local", [(0, 5), (1, 5), (2, 5)])
    asked.clear()
    cell, d = asyncio.run(walk([0, 1], asker([hot, empty]), 5))
    assert (cell, d.decode, asked) == (0, "d", [(0, 5), (1, NO_BOUND), (0, NO_BOUND)])
    with pytest.raises(NoReplicaError, match="no cell of 2"):
        asyncio.run(walk([0, 1], asker([empty, empty]), 5))
