"""Routers in cells on Ray (router/cells.py): a colocated app of two decode replicas with cell_size 1
has two cells. Each replica feeds only the router of the cell rendezvous hashing gives it, and a
prefix asked twice is decided twice by the router of its first block's cell (priced in both cells,
the cheaper: the first when both are idle, the one holding the prefix after), and hits there."""

import pytest
import ray

from cluster.engine.kv_cache import hash_request_blocks
from cluster.engine.model.identity import model_identity
from protos.pdserve.v1 import generation_pb2 as pb
from router.actor import lookup, router_name
from router.cells import block_key, ranking, replica_cell
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


def test_each_replica_feeds_its_cell_only_and_a_prefix_is_decided_and_hit_in_its_cell(app, tiny_model, capsys):
    cfg, stub = app
    group = cfg.serving_group
    cells = [router_name("pdserve", group, k) for k in (0, 1)]
    decodes = serve_replica_ids()["decode"]
    member = {rid: replica_cell("decode", rid, 2) for rid in decodes}  # the exact assignment
    expected = [sorted(r for r in decodes if member[r] == k) for k in (0, 1)]
    wait_until(lambda: [sorted(feeds(n)) for n in cells] == expected, f"the cells' routers hear {expected}")
    views = [feeds(n) for n in cells]
    assert all(views[member[r]][r] >= 1 for r in decodes)  # fed: calls counted by its cell's router
    assert all(r not in views[1 - member[r]] for r in decodes)  # never a call to the other cell's
    assert lookup(router_name("pdserve", group)) is None  # no router of the whole version

    # a 4-block system prompt whose first block ranks a populated cell first (both replicas may share one)
    salt = model_identity(tiny_model).encode()
    system = next(s for s in ([256, i] + list(range(62)) for i in range(100))
                  if expected[ranking(block_key(hash_request_blocks(s, 16, salt)[0]), 2)[0]])
    home = ranking(block_key(hash_request_blocks(system, 16, salt)[0]), 2)[0]
    before = [ray.get(lookup(n).stats.remote()).decisions for n in cells]
    cached = []
    for tail in ([1] * 32, [2] * 32):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=system + tail), sampling=pb.SamplingParams(
            max_tokens=2, temperature=0, ignore_eos=True))
        cached.append(list(stub.Generate(req, timeout=60))[-1].usage.cached_prompt_tokens)
    after = [ray.get(lookup(n).stats.remote()).decisions for n in cells]
    assert [a - b for a, b in zip(after, before)] == [2 if k == home else 0 for k in (0, 1)]
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
    assert ray.get(lookup(cells[1 - home]).price.remote(third, 96)) == (96.0 if expected[1 - home] else None)
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
