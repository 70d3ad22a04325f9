"""With migration off (max_migrations 0), streams on a killed decode replica end ABORTED, saying
how many tokens were sent; the others finish; nothing hangs and the survivor is leak-free."""

import grpc
import pytest
import ray

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from tests.serving.test_fault_tolerance import kill, live_replicas, prompts, replica_load, request
from tests.helpers import app_router, grpc_stub, wait_until


@pytest.fixture(scope="module")
def stub(serve_apps, tiny_model):
    with serve_apps.run(tiny_model, prefill={"num_replicas": 0}, decode={"num_replicas": 2},
                        health_check_period_s=1.0, fault_tolerance={"max_migrations": 0}) as cfg, \
            grpc_stub(cfg) as stub:
        yield stub


def test_streams_on_a_killed_decode_replica_end_aborted_with_the_count_sent(stub, tiny_model):
    wait_until(lambda: len(live_replicas("decode")) == 2, "both decode replicas report")
    ps = prompts(8, 16, base=500)
    expected = [o.token_ids for o in LLMEngine.from_model(tiny_model, num_blocks=128).generate(
        ps, SamplingParams(max_tokens=160, temperature=0, ignore_eos=True))]
    streams = [iter(stub.Generate(request(p, 160), timeout=120)) for p in ps]
    got = [list(next(s).token_ids) for s in streams]
    running = {rid: replica_load("decode", rid)["running"] for rid in live_replicas("decode")}
    assert sum(running.values()) == 8
    victim = max(running, key=running.get)  # the streams it serves end ABORTED, the others finish
    [survivor] = [rid for rid in running if rid != victim]
    kill(victim)
    outcomes = []
    for i, s in enumerate(streams):
        try:
            for r in s:
                got[i] += r.token_ids
            outcomes.append("OK")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.ABORTED
            assert f"died after {len(got[i])} tokens were sent (0 migrations allowed)" in e.details()
            outcomes.append("ABORTED")
            assert got[i] == expected[i][:len(got[i])]  # what was sent is right, just not all of it
    assert outcomes.count("ABORTED") == running[victim] and outcomes.count("OK") == running[survivor]
    assert [g for g, o in zip(got, outcomes) if o == "OK"] == [e for e, o in zip(expected, outcomes) if o == "OK"]
    wait_until(lambda: live_replicas("decode") == [survivor] or len(live_replicas("decode")) == 2,
               "the dead replica is dropped")
    wait_until(lambda: (lambda s: s["free_blocks"] == 64 and s["running"] == 0)(replica_load("decode", survivor)),
               "the survivor's blocks are back")
    # the ingress tells the app's routers once Serve reports the death (a fire-and-forget call):
    # waited for, not assumed done when the registry and the survivor are settled
    wait_until(lambda: not ray.get(app_router().hashes.remote(victim)), "the router forgets the dead replica",
               timeout=15)
