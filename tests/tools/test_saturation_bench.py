"""The saturation projection's arithmetic (cluster/tools/bench/saturation.py): no timing."""

import pytest

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
