"""A Serve replica with tensor_parallel_size 2: its worker rank is a Ray actor in the replica's
placement group (cluster/serving/tensor_parallel.py). Colocated (KV transfer between degrees:
test_tensor_parallel_pd.py): two decode replicas of tp=2 on the tiny model (4 query, 2 KV heads:
one KV head a rank).

- Greedy streams equal tp=1's (the in-process engine), both replicas' pools whole afterwards with
  exactly the configured block count, each replica's ranks on its node.
- Killing a replica's worker mid-stream ends that replica (the failed forward ends its process),
  the stream migrates and finishes with the reference tokens.
- Killing an idle replica's worker fails its health check: Serve replaces it.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import ray

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import app_router, grpc_stub, inject_fault, serve_replica_ids, wait_for

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def app(serve_apps, tiny_model):
    tp2 = {"num_replicas": 2, "num_cpus": 0.5, "engine": {"tensor_parallel_size": 2}}
    with serve_apps.run(tiny_model, mode="colocated", decode=tp2, engine={"num_blocks": NUM_BLOCKS},
                        fault_tolerance={"fault_injection": True}) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=NUM_BLOCKS)

    def run(prompt, max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return engine.generate([prompt], sp)[0].token_ids

    return run


def prompt(i: int) -> list[int]:
    return [256] + [(i * 13 + j * 7) % 250 for j in range(4 + 29 * i)]  # 5 .. 120 tokens


def request(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))


def replica_load(replica: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("decode", "pdserve").load.remote(target_replica=replica).result(timeout_s=30)


def workers(replica: str) -> list:
    """The worker rank actors of a replica (named pdserve-tp:<replica>:<rank>)."""
    names = sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"pdserve-tp:{replica}:"))
    return [ray.get_actor(name, namespace=ns) for name, ns in names]


def two_live_replicas() -> list[str]:
    """The two decode replicas, once Serve runs exactly two (a replacement of an earlier test's
    victim has started) and the app's router routes to exactly those: no replica is still starting
    or ending, so the one a request reaches is one of them."""
    def settled() -> bool:
        named = serve_replica_ids().get("decode", [])
        routed = sorted(load.replica_id for load in ray.get(app_router().live_loads.remote()) if load.role == "decode")
        return len(named) == 2 and routed == named

    wait_for(settled, "two decode replicas, both routed to", 120)
    return serve_replica_ids()["decode"]


def wait_whole(replicas: list[str]) -> dict[str, dict]:
    seen: dict[str, dict] = {}

    def whole() -> bool:
        seen.update({r: replica_load(r) for r in replicas})
        return all(s["free_blocks"] == s["total_blocks"] and s["running"] == s["waiting"] == 0 for s in seen.values())

    wait_for(whole, f"the replicas' pools whole (last seen {seen})", timeout=30)
    return seen


def test_tp2_replicas_stream_tp1s_tokens_and_their_pools_are_whole(app, reference):
    prompts = [prompt(i) for i in range(5)]
    with grpc_stub(app) as stub, concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda p: [t for r in stub.Generate(request(p, 12), timeout=120)
                                           for t in r.token_ids], prompts))
    assert streams == [reference(p, 12) for p in prompts]
    replicas = serve_replica_ids()["decode"]
    assert len(replicas) == 2
    loads = wait_whole(replicas)
    for r, load in loads.items():
        assert load["total_blocks"] == NUM_BLOCKS  # blocks of the whole model: every rank holds its heads of each
        assert load["rank_nodes"] == [load["node_id"]] * 2  # STRICT_PACK: rank 0 (the replica) and rank 1
        assert len(workers(r)) == 1


@pytest.mark.timeout(240)
def test_killing_a_worker_mid_stream_migrates_the_stream_to_the_reference_tokens(app, reference):
    before = two_live_replicas()
    for r in before:  # ~10 s streams: the kill lands while the stream runs, not after it ended
        inject_fault(r, step_delay_s=0.1)
    ids, max_tokens = prompt(2), 96
    with grpc_stub(app) as stub:
        stream = stub.Generate(request(ids, max_tokens), timeout=180)
        tokens = list(next(stream).token_ids)
        serving = [r for r in before if replica_load(r)["running"] == 1]
        assert len(serving) == 1
        [worker] = workers(serving[0])
        ray.kill(worker, no_restart=True)
        tokens += [t for r in stream for t in r.token_ids]
    assert tokens == reference(ids, max_tokens)
    wait_for(lambda: serving[0] not in serve_replica_ids().get("decode", []), "the broken replica to be gone", 60)


@pytest.mark.timeout(240)
def test_killing_an_idle_replicas_worker_fails_its_health_check(app):
    victim = two_live_replicas()[0]
    [worker] = workers(victim)
    ray.kill(worker, no_restart=True)
    wait_for(lambda: victim not in serve_replica_ids().get("decode", []), "Serve to replace the replica", 60)


@pytest.mark.timeout(240)
def test_a_poison_request_ends_one_tp_replica_and_is_not_migrated_onto_the_other(app):
    """Poison containment (issue 52): a forward that raises with every rank alive (the poison
    token, injected on rank 0 inside GroupGuard) ends its step's request with the error, INTERNAL
    naming it and its replica, then the replica ends; the request is not migrated, so the other
    replica never runs it and stays up. (It used to end this replica, migrate, and end the next.)"""
    import re

    before = two_live_replicas()
    for r in before:
        inject_fault(r, poison_token=255, step_delay_s=0.0)
    with grpc_stub(app) as stub, pytest.raises(Exception) as e:
        list(stub.Generate(request([256, 1, 2, 255, 3], 8), timeout=60))
    assert e.value.code().name == "INTERNAL"
    match = re.fullmatch(
        r"request [0-9a-f]{32}: the forward holding it failed on decode replica (\S+) after 0 tokens \(engine "
        r"step failed: PoisonError: fault injection: the forward's input holds poison token 255\); not retried on "
        r"another replica, as it may be what made the forward fail", e.value.details())
    assert match is not None, e.value.details()
    hit = match.group(1)
    assert hit in before, (hit, before, serve_replica_ids().get("decode"))
    [other] = [r for r in before if r != hit]
    wait_for(lambda: hit not in serve_replica_ids().get("decode", []), "the poisoned replica to end", 60)
    assert other in serve_replica_ids()["decode"]
    load = replica_load(other)  # it never ran the poison request: no step of it failed (one would end it)
    assert (load["replica_id"], load["step_errors"]) == (other, 0)
    inject_fault(other, poison_token=-1)
