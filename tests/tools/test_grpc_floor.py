"""The front door's floor bench (cluster/tools/bench/grpc_floor.py): each arm's server relays
exactly the tokens asked, two a response, through its hop; the context-switch count it reports
counts a sleeping thread's wake-ups."""

from __future__ import annotations

import os
import threading
import time

import pytest

from cluster.tools.bench import grpc_floor, ingress_parts


@pytest.mark.parametrize("max_tokens,chunks", [
    (1, [[[7], True]]),
    (2, [[[7, 8], True]]),
    (5, [[[7, 8], False], [[7, 8], False], [[7], True]]),
])
def test_the_upstream_streams_two_tokens_a_chunk_and_finishes_the_last(max_tokens, chunks):
    assert grpc_floor._chunks(max_tokens) == chunks


@pytest.mark.parametrize("name", ["edge", "grpc", "socket"])
def test_each_arm_relays_every_token_asked_two_a_response(name):
    r = grpc_floor.arm(name, 7, 0.0, clients=2, seconds=0.3)
    assert r["errors"] == {} and r["n"] >= 1
    assert (r["messages"], round(r["tokens_per_s"] * (r["n"] / r["rps"]))) == (4 * r["n"], 7 * r["n"])
    assert set(r["cores"]) == ({"server"} if name == "edge" else {"server", "upstream"})


def test_switches_counts_every_live_threads_wake_ups():
    started, napped, done = threading.Event(), threading.Event(), threading.Event()

    def nap():  # 20 sleeps: 20 voluntary switches of this thread, then alive until counted
        started.set()
        for _ in range(20):
            time.sleep(0.001)
        napped.set()
        done.wait(timeout=30)
    t = threading.Thread(target=nap)
    t.start()
    started.wait(timeout=30)
    before = ingress_parts.switches(os.getpid())
    napped.wait(timeout=30)
    after = ingress_parts.switches(os.getpid())
    done.set()
    t.join(timeout=30)
    assert after - before >= 20


@pytest.mark.parametrize("frames, part", [
    (["Thread.run (threading.py:982)", "MetricBatch._run (router/ingress/gateway/metric_batch.py:70)",
      "MetricBatch.flush (router/ingress/gateway/metric_batch.py:80)", "Metric._record (ray/util/metrics.py:133)"],
     "metrics"),
    (["FrontDoor.serve (router/ingress/gateway/front_door.py:230)",
      "IngressTelemetry._record (router/ingress/gateway/telemetry.py:77)",
      "MetricBatch.observe (router/ingress/gateway/metric_batch.py:50)"], "metrics"),
    (["FrontDoor.serve (router/ingress/gateway/front_door.py:230)", "Capacity.check (router/ingress/gateway/capacity.py:90)"],
     "admit"),
    (["Thread.run (threading.py:982)"], None),
])
def test_the_ingress_parts_count_our_metrics_apart_from_admission(frames, part):
    """ingress_parts: the metric batch's frames (its thread's records, the loop's appends) are
    their own part, not admit's, although they live in gateway/ as admission does."""
    assert ingress_parts.part_of(frames) == part
