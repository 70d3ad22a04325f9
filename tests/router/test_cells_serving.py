"""Routers in cells on Ray (router/cells.py): a colocated app of two decode replicas with cell_size 1
has two cells. Each replica feeds only the router of its Serve rank's cell (one replica a cell),
and moves to its new rank's cell when Serve re-ranks it; a prefix asked twice is decided twice by
the router of its first block's cell (priced in both cells, the cheaper: the first when both are
idle, the one holding the prefix after), and hits there."""

import pytest
import ray
from ray.serve._private.common import DeploymentID
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.schema import ReplicaRank

from cluster.engine.kv_cache import hash_request_blocks
from cluster.engine.model.identity import model_identity
from protos.pdserve.v1 import generation_pb2 as pb
from router.actor import lookup, router_name
from router.cells import block_key, ranking
from tests.helpers import grpc_stub, serve_replica_ids, wait_until


@pytest.fixture(scope="module")
def app(serve_apps, tiny_model):
    with serve_apps.run(tiny_model, mode="colocated", served_model_name="tiny",
                        decode={"num_replicas": 2}, routing={"cell_size": 1}) as cfg:
        with grpc_stub(cfg) as stub:
            yield cfg, stub


def feeds(name: str) -> dict[str, int]:
    """The replicas a cell's router hears from, with its feed calls from each."""
    handle = lookup(name)
    return {} if handle is None else {v.replica_id: v.calls for v in ray.get(handle.feed_views.remote())}


def decode_ranks() -> dict[str, int]:
    """Each decode replica's rank, as Serve's controller gave it (0..N-1 in the deployment)."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ranks = ray.get(controller._get_replica_ranks_mapping.remote(DeploymentID(name="decode", app_name="pdserve")))
    return {rid: r.rank for rid, r in ranks.items()}


def idle(router) -> bool:
    """Nothing sent to the router's replicas since their last load report, and nothing in it."""
    return ray.get(router.pending_requests.remote()) == 0 and all(
        (load.running, load.waiting, load.queued_prefill_tokens) == (0, 0, 0)
        for load in ray.get(router.live_loads.remote()))


def test_each_replica_feeds_its_cell_only_and_a_prefix_is_decided_and_hit_in_its_cell(app, tiny_model, capsys):
    cfg, stub = app
    group = cfg.serving_group
    cells = [router_name("pdserve", group, k) for k in (0, 1)]
    decodes = serve_replica_ids()["decode"]
    ranks = decode_ranks()
    assert sorted(ranks) == decodes and sorted(ranks.values()) == [0, 1]
    member = {rid: ranks[rid] % 2 for rid in decodes}  # the exact assignment: rank mod cells
    expected = [[r for r in decodes if member[r] == k] for k in (0, 1)]
    assert [len(e) for e in expected] == [1, 1]  # one replica a cell (by hash, both shared one half the time)
    wait_until(lambda: [sorted(feeds(n)) for n in cells] == expected, f"the cells' routers hear {expected}")
    views = [feeds(n) for n in cells]
    assert all(views[member[r]][r] >= 1 for r in decodes)  # fed: calls counted by its cell's router
    assert all(r not in views[1 - member[r]] for r in decodes)  # never a call to the other cell's
    assert lookup(router_name("pdserve", group)) is None  # no router of the whole version

    # a 4-block system prompt
    salt = model_identity(tiny_model).encode()
    system = [256, 0] + list(range(62))
    home = ranking(block_key(hash_request_blocks(system, 16, salt)[0]), 2)[0]
    before = [ray.get(lookup(n).stats.remote()).decisions for n in cells]
    cached = []
    for tail in ([1] * 32, [2] * 32):
        # each request priced against idle replicas, as both routers have heard them (the last
        # request neither pending nor running in a load report: else the home cell's price carries
        # its work, and the other cell may win)
        wait_until(lambda: all(idle(lookup(n)) for n in cells), "the cells' routers heard their replicas idle")
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=system + tail), sampling=pb.SamplingParams(
            max_tokens=2, temperature=0, ignore_eos=True))
        cached.append(list(stub.Generate(req, timeout=60))[-1].usage.cached_prompt_tokens)
    after = [ray.get(lookup(n).stats.remote()).decisions for n in cells]
    assert [a - b for a, b in zip(after, before)] == [2 if k == home else 0 for k in (0, 1)], (
        home, [ray.get(lookup(n).recent_decisions.remote())[-2:] for n in cells],
        [ray.get(lookup(n).live_loads.remote()) for n in cells])
    assert cached == [0, 64]  # the second request hit the 4 blocks the first left in the cell
    decisions = [d for d, _ in ray.get(lookup(cells[home]).recent_decisions.remote())[-2:]]
    assert decisions[0].decode == decisions[1].decode and decisions[1].predicted_cached_tokens == 64
    assert decisions[1].decode in expected[home]

    # each cell's price over Ray (Router.price, what the ingress asked of both before each request):
    # a third request's, once the home router heard the second's replica again (nothing pending)
    router = lookup(cells[home])
    wait_until(lambda: ray.get(router.pending_requests.remote()) == 0, "the home cell heard its replica's load")
    third = hash_request_blocks(system + [3] * 32, 16, salt)
    assert ray.get(router.price.remote(third, 96)) == 32.0  # 64 of its 96 tokens cached, nothing ahead
    assert ray.get(lookup(cells[1 - home]).price.remote(third, 96)) == 96.0  # its replica holds none of it
    assert [ray.get(lookup(n).stats.remote()).decisions for n in cells] == after  # priced, not decided

    # `pdserve status` (its routers part, text and --json): each cell, the replicas it hears from, spills
    from cluster.app.status_cli import _print_routers, _routers

    shown = _routers(["pdserve"])
    assert {n: (r["cell"], r["replicas"]) for n, r in shown.items()} == {
        cells[k]: (k, expected[k]) for k in (0, 1)}
    capsys.readouterr()
    _print_routers(shown)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("router ")]
    assert [x.split(":")[0] for x in lines] == [f"router {cells[k]} (cell {k}" for k in (0, 1)]
    assert [f"(cell {k}: {len(expected[k])} replicas fed)" in lines[k] and "(0 spilled on)" in lines[k]
            for k in (0, 1)] == [True] * 2


def test_a_replica_serve_ranks_anew_feeds_its_new_ranks_cell(app):
    """Serve re-ranks a replica (after a downscale: ReplicaActor.reconfigure with a new rank, the
    call its controller makes): its feed moves to the new rank's cell, whose router hears it (the
    old one forgets it); given its rank back, it moves back."""
    cfg, _ = app
    cells = [router_name("pdserve", cfg.serving_group, k) for k in (0, 1)]
    ranks = decode_ranks()
    by_rank = {k: rid for rid, k in ranks.items()}
    actor = ray.get_actor(f"SERVE_REPLICA::pdserve#decode#{by_rank[0]}", namespace=SERVE_NAMESPACE)
    config = ray.get(actor.initialize_and_get_metadata.remote())[0]  # initialized already: its metadata
    for rank, heard in ((3, [[], sorted(ranks)]), (0, [[by_rank[0]], [by_rank[1]]])):  # 3: cell 1
        ray.get(actor.reconfigure.remote(config, ReplicaRank(rank=rank, node_rank=0, local_rank=rank)))
        wait_until(lambda: [sorted(feeds(n)) for n in cells] == heard, f"the cells' routers hear {heard}")
