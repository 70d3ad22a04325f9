"""The saturation projection's arithmetic (cluster/tools/bench/saturation.py): no timing."""

import pytest

from cluster.tools.bench import saturation
from cluster.tools.bench.saturation import Deployment, interpolate, project, saturation_replicas


def test_saturation_replicas_finds_the_first_count_at_capacity():
    assert saturation_replicas(lambda n: 100.0, lambda n: 2.0 * n) == 50
    assert saturation_replicas(lambda n: 1e9, lambda n: n) is None  # never within range
    assert saturation_replicas(lambda n: 1.0, lambda n: 5.0) == 2  # already past it at the smallest size


def test_interpolate_is_linear_in_log_and_flat_beyond_the_points():
    pts = [(8, 800.0), (32, 200.0)]
    assert interpolate(pts, 16) == pytest.approx(500.0)
    assert interpolate(pts, 4) == 800.0 and interpolate(pts, 64) == 200.0


def test_project_names_the_binding_pool_and_counts_events_per_request():
    d = Deployment(gpus=80, gpus_per_replica=8, prefill_share=0.5, prompt_tokens=1024, cached_fraction=0.5,
                   output_tokens=256, prefill_tokens_per_s=5120.0, decode_tokens_per_s=25600.0, block_size=16)
    p = project(d)
    assert (p["replicas"], p["prefill"], p["decode"]) == (10, 5, 5)
    assert p["requests_per_s"] == pytest.approx(50.0) and p["binding_pool"] == "prefill"  # 5 x 5120 / 512
    # stored per request: 32 prompt blocks on prefill, 32 pulled + 16 output on decode; each evicted later
    assert p["events_per_s"] == pytest.approx(50.0 * 2 * 80)
    assert p["blocks_indexed"] == 10 * d.kv_blocks_per_replica
    # one feed call per change, 4-50 a second: decode a step each (25/s); prefill a chunk each
    # (5120/8192 a second) and a request in or out (2 x 50 / 5)
    assert p["feed_calls_per_s"] == pytest.approx(5 * 25 + 5 * (5120 / 8192 + 20))
    assert p["router_calls_per_s"] == pytest.approx(50 + p["feed_calls_per_s"])


def test_the_route_calls_inputs_are_the_measured_runs():
    """The projection's route call over each transport and the ingress's CPU before and after the
    channel: the figures docs/benchmarks.md gives with their runs (a change there must change these)."""
    s = saturation
    assert s.ROUTE_MEASURED_AT == 128
    decide = 1 / s.interpolate(s.MEASURED_DECISIONS, 128)
    assert s.RAY_ROUTE_EXTRA_S == pytest.approx(s.RAY_ROUTE_CALL_S - decide, abs=1e-12)
    assert s.CHANNEL_ROUTE_EXTRA_S == pytest.approx(s.CHANNEL_ROUTE_CALL_S - decide, abs=1e-12)
    assert 0 < s.CHANNEL_ROUTE_EXTRA_S < s.RAY_ROUTE_EXTRA_S
    # front_door --served 1 64 --parts, the means of pairs P1-P4 ("The route call on a channel of its own")
    assert s.INGRESS_ROUTE_BY_RAY.request_s == pytest.approx(2.26e-3) and s.INGRESS.request_s == pytest.approx(1.5325e-3)
    assert s.INGRESS_ROUTE_BY_RAY.message_s == pytest.approx(0.14575e-3)
    assert s.INGRESS.message_s == pytest.approx(0.1435e-3)
    assert (s.INGRESS_REQUEST_S, s.INGRESS_MESSAGE_S) == (s.INGRESS.request_s, s.INGRESS.message_s)  # cells.py's


def test_the_table_has_both_transports_and_differs_by_the_route_calls_alone():
    d = Deployment()
    p = project(d)
    rows = {r["component"]: r for r in saturation.saturation_table(d)}
    ray, channel = (rows[f"router actor: all of it, route over {w}"] for w in ("Ray (before)", "the channel"))
    assert ray["cores_at_size"] - channel["cores_at_size"] == pytest.approx(
        p["decisions_per_s"] * (saturation.RAY_ROUTE_CALL_S - saturation.CHANNEL_ROUTE_CALL_S))
    feed = rows["router actor: the feed's calls over Ray"]["cores_at_size"]
    decisions = rows["router: decisions (policy, in process)"]["cores_at_size"]
    route_extra = p["decisions_per_s"] * saturation.CHANNEL_ROUTE_EXTRA_S
    assert channel["cores_at_size"] == pytest.approx(feed + decisions + route_extra)
    assert channel["saturates_at"] > ray["saturates_at"]
    # the ingress: 1,211 requests/s and 38,750 messages/s at the figures of each arm
    assert (round(p["requests_per_s"]), p["output_tokens_per_s"] / d.tokens_per_message) == (1211, 38750.0)
    for name, cost in (("ingress: route over Ray (before)", (2.26e-3, 0.14575e-3)),
                       ("ingress: route over the channel", (1.5325e-3, 0.1435e-3))):
        assert rows[name]["cores_at_size"] == pytest.approx(p["requests_per_s"] * cost[0] + 38750 * cost[1])


def test_ingress_processes_carry_the_cores_at_eighty_percent():
    assert [saturation.ingress_processes(c) for c in (0.1, 0.8, 0.81, 8.0, 7.42, 74.64)] == [1, 1, 2, 10, 10, 94]


def test_cells_projection_counts_two_prices_and_a_decision_a_request():
    from cluster.tools.bench import cells

    c = cells.cells_projection(1000, 32, feed_us=300.0, route_us=lambda n: 200.0, rank_s=2e-6)
    p = project(Deployment(gpus=1000))
    assert (c["replicas"], c["cells"]) == (125, 4)
    members = 125 / 4
    per_replica_feeds, per_replica_requests = p["feed_calls_per_s"] / 125, p["requests_per_s"] / 125
    assert c["cell_cores"] == pytest.approx(members * (per_replica_feeds * 300e-6 + per_replica_requests * 3 * 200e-6))
    assert c["routers_cores"] == pytest.approx(4 * c["cell_cores"])
    # the largest cell router/cells.py makes of 125 replicas has 34 of them; of 1,250, 47
    assert c["largest_cell"] == 34 and c["largest_cell_cores"] == pytest.approx(34 / members * c["cell_cores"])
    # the ingress: its channel-era cost, the second price's further call, and ranking the cells
    ingress = (p["requests_per_s"] * (saturation.INGRESS.request_s + 2 * saturation.INGRESS_CHANNEL_CALL_S + 2e-6)
               + 38750 * saturation.INGRESS.message_s)
    assert c["ingress_cores"] == pytest.approx(ingress)
    assert c["ingress_processes"] == saturation.ingress_processes(ingress)
    spill = cells.cells_projection(1000, 32, feed_us=300.0, route_us=lambda n: 200.0, rank_s=2e-6, choice="spill")
    assert c["cell_cores"] - spill["cell_cores"] == pytest.approx(members * per_replica_requests * 2 * 200e-6)
    ten = cells.cells_projection(10_000, 32, feed_us=300.0, route_us=lambda n: 200.0, rank_s=2e-6)
    assert (ten["replicas"], ten["cells"], ten["largest_cell"]) == (1250, 40, 47)
    p10 = project(Deployment(gpus=10_000))  # a cell's load is its members': ~31 either way, not 10x
    assert ten["cell_cores"] == pytest.approx(1250 / 40 * (p10["feed_calls_per_s"] * 300e-6
                                                           + p10["requests_per_s"] * 3 * 200e-6) / 1250)
    assert ten["cell_cores"] == pytest.approx(c["cell_cores"], rel=0.01)
