"""A model that sleeps (issue 18): its decode pool autoscales with min_replicas 0, so it starts with no
replica, the first request waits while one loads (cold start, measured) and gets its version's
tokens; after idle_timeout_s without a request the pool is back to zero, and a request whose
deadline is shorter than a cold start gets DEADLINE_EXCEEDED instead of waiting. /health stays 200
while the model sleeps: asleep is not down."""

import time
import urllib.request

import grpc
import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import grpc_stub, http_base, serve_replica_ids, wait_for

pytestmark = pytest.mark.ray

PROMPT = [256] + list(range(1, 10))
IDLE_S = 3.0


@pytest.fixture(scope="module")
def server(serve_apps, tiny_model):
    auto = {"min_replicas": 0, "max_replicas": 1, "idle_timeout_s": IDLE_S, "look_back_period_s": 2.0,
            "metrics_interval_s": 0.5}
    with serve_apps.run(tiny_model, mode="colocated", served_model_name="sleepy", version="r1",
                        decode={"autoscaling": auto}) as cfg:
        yield cfg


def decode_replicas() -> int:
    return len(serve_replica_ids().get("decode", []))


def generate(stub, timeout_s: str | None = None):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True))
    metadata = () if timeout_s is None else (("x-pdserve-timeout-s", timeout_s),)
    return stub.Generate(req, metadata=metadata, timeout=120)


def healthy(server) -> int:
    with urllib.request.urlopen(f"{http_base(server)}/health", timeout=30) as r:
        return r.status


def test_a_sleeping_model_wakes_for_a_request_and_sleeps_again(server, tiny_model):
    reference = LLMEngine.from_model(tiny_model, num_blocks=64).generate(
        [PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    assert decode_replicas() == 0  # min_replicas 0: it starts asleep
    assert healthy(server) == 200
    with grpc_stub(server) as stub:
        sent = time.monotonic()
        stream = generate(stub)
        first = next(stream)
        cold = time.monotonic() - sent
        tokens = list(first.token_ids) + [t for r in stream for t in r.token_ids]
        print(f"cold start: {cold:.2f} s from the request to its first token (replica start, weights, first step)")
        assert (first.model_version, tokens) == ("r1", reference)
        assert decode_replicas() == 1
        started = time.monotonic()
        wait_for(lambda: decode_replicas() == 0, "the idle pool asleep again", timeout=IDLE_S + 30)
        print(f"asleep again {time.monotonic() - started:.1f} s after the request (idle_timeout_s {IDLE_S:g})")
        assert healthy(server) == 200

        with pytest.raises(grpc.RpcError) as e:
            list(generate(stub, timeout_s="0.2"))  # shorter than any cold start here
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert e.value.details().endswith("deadline exceeded before a decode replica took it (version sleepy@r1)")
