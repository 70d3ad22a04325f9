"""pdserve on a multi-node Ray cluster: the session's three nodes (tests/conftest.py), a head plus a
prefill node and a decode node that each advertise their pool's custom resource, as the node types
of deploy/cluster.yaml do. Each pool's replicas run on their own node, KV crosses between the
nodes over NIXL, tokens equal transformers'; and the decode pool, autoscaled on KV use, goes from
1 to 2 replicas under a bounded load and back to 1 after it (its new replica on the decode node).

All nodes are processes on this machine: "between nodes" means between raylets with their own
resources and workers, not across a network (UCX picks shared memory / CMA as it would for two
replicas on one GPU node)."""

import threading

import grpc
import pytest
import ray

from cluster.serving.registry import get_registry
from protos.pdserve.v1 import generation_pb2 as pb
from tests.conftest import DECODE_NODE_RESOURCES, PREFILL_NODE_RESOURCES
from tests.helpers import grpc_stub, wait_for
from tests.reference import hf_greedy

DECODE_BLOCKS = 32  # small, so that two streams fill half of it


@pytest.fixture(scope="module")
def app(serve_apps, tiny_model):
    with serve_apps.run(
        tiny_model,
        # two prefill replicas: without their resource Serve would spread them over two nodes
        prefill={"num_replicas": 2, "num_cpus": 0, "resources": {"pdserve_prefill": 1}},
        decode={"num_cpus": 0, "resources": {"pdserve_decode": 1}, "engine": {"num_blocks": DECODE_BLOCKS},
                "autoscaling": {"min_replicas": 1, "max_replicas": 2,
                                "target_kv_usage": 0.25,  # two 160-token streams: ~1.5-2.5 replicas' worth
                                "target_itl_s": 60.0,  # off: CPU step times here say nothing
                                "upscale_delay_s": 0.5, "downscale_delay_s": 3.0,
                                "look_back_period_s": 1.0, "metrics_interval_s": 0.2}},
        routing={"local_prefill_threshold": 16},
    ) as cfg, grpc_stub(cfg) as stub:
        yield stub


def node_with(resources: dict) -> str:
    [node] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and all(n["Resources"].get(k) == v
                                                                       for k, v in resources.items())]
    return node


def live_replicas(pool: str) -> dict[str, dict]:
    """Replicas of `pool` that reported their load in the last 3 s (they report every second)."""
    snapshot = ray.get(get_registry().snapshot.remote())
    return {rid: s for rid, s in snapshot.items() if s["role"] == pool and s["age_s"] < 3.0}


def running(pool: str) -> int:
    from ray import serve

    return serve.status().applications["pdserve"].deployments[pool].replica_states.get("RUNNING", 0)


def generate(stub, prompt, max_tokens):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]


def test_each_pool_runs_on_its_own_node_and_kv_crosses_between_them(app, tiny_model):
    prefill_node, decode_node = node_with(PREFILL_NODE_RESOURCES), node_with(DECODE_NODE_RESOURCES)
    head = ray.get_runtime_context().get_node_id()
    assert len({head, prefill_node, decode_node}) == 3
    wait_for(lambda: (len(live_replicas("prefill")), len(live_replicas("decode"))) == (2, 1), "both pools report")
    assert [s["node_id"] for s in live_replicas("prefill").values()] == [prefill_node, prefill_node]
    [decode] = live_replicas("decode").values()
    assert decode["node_id"] == decode_node
    pulls_before = decode["transfer"]["pulls_ok"]

    prompts = [[256] + [(i * 17 + j) % 250 for j in range(30 + 9 * i)] for i in range(3)]  # 31..49 tokens
    for p in prompts:  # more uncached tokens than the local-prefill threshold: prefilled remotely
        assert generate(app, p, 8) == hf_greedy(tiny_model, p, 8)

    def pulled():
        [d] = live_replicas("decode").values()
        return d["transfer"]["pulls_ok"] - pulls_before

    wait_for(lambda: pulled() >= len(prompts), "the decode node's reports show the pulls", timeout=10)
    assert pulled() == len(prompts)  # every prompt's KV came over from the prefill node


def test_decode_pool_scales_up_under_load_and_back_down_after(app, tiny_model):
    decode_node = node_with(DECODE_NODE_RESOURCES)
    assert running("decode") == 1
    stop, done, errors = threading.Event(), [], []

    def load(worker: int):  # 41 prompt + 120 output tokens: 10 of the 32 blocks per stream at the end
        i = 0
        while not stop.is_set():
            prompt = [256] + [(worker * 101 + i * 13 + j) % 250 for j in range(40)]
            try:
                done.append(len(generate(app, prompt, 120)))
            except grpc.RpcError as e:
                errors.append(e)
                return
            i += 1

    threads = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: running("decode") == 2, "the decode pool scales up to 2 replicas", timeout=90)
        wait_for(lambda: len(live_replicas("decode")) == 2, "the new decode replica reports", timeout=15)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert done and set(done) == {120}  # every stream of the load ran to its end
    assert {s["node_id"] for s in live_replicas("decode").values()} == {decode_node}

    wait_for(lambda: running("decode") == 1, "the idle decode pool scales back to 1 replica", timeout=60)
    p = [256] + list(range(1, 40))
    assert generate(app, p, 6) == hf_greedy(tiny_model, p, 6)  # still serving, on the one left
