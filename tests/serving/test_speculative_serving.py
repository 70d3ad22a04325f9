"""Speculative decoding on Ray Serve: the decode pool's engine speculates (n-gram, set per pool in
the app config), disaggregated (the first token from prefill, the prompt's KV pulled over NIXL)
and colocated (the prompt prefilled on decode). Greedy streams equal the in-process engine
without speculation, drafts were accepted, and the pools end with every block free."""

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.helpers import grpc_stub, wait_for

NGRAM = {"method": "ngram", "k": 4, "ngram_min": 1, "ngram_max": 3, "cost_model": "off"}  # acceptance alone decides: deterministic
# 17..80 tokens over a small alphabet: above local_prefill_threshold (remote prefill), and n-grams recur
PROMPTS = [[256] + [(i * 5 + j * j) % 13 for j in range(16 + 16 * i)] for i in range(5)]
MAX_TOKENS = 40


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def server(request, serve_apps, tiny_model):
    with serve_apps.run(tiny_model, mode=request.param, served_model_name="tiny",
                        decode={"engine": {"num_blocks": 64, "speculative": NGRAM}},
                        routing={"local_prefill_threshold": 16}) as cfg:
        yield cfg


def loads() -> dict[str, dict]:
    from ray import serve

    status = serve.status().applications["pdserve"].deployments
    return {pool: serve.get_deployment_handle(pool, "pdserve").load.remote().result(timeout_s=30)
            for pool in ("prefill", "decode") if pool in status}


def test_greedy_streams_equal_the_engine_without_speculation(server, tiny_model):
    plain = LLMEngine.from_model(tiny_model, num_blocks=64)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, sp)]
    before = loads()["decode"]["speculative"]["accepted"]
    with grpc_stub(server) as stub:
        for p, w in zip(PROMPTS, want):
            responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)), timeout=120))
            assert [t for r in responses for t in r.token_ids] == w
    seen = {}

    def whole() -> bool:
        seen.update(loads())
        return all(s["free_blocks"] == s["total_blocks"] and s["running"] == s["waiting"] == s["importing"]
                   == s["held"] == 0 for s in seen.values())

    wait_for(whole, f"every pool back at its totals (last seen: {seen})", 30)
    assert seen["decode"]["speculative"]["accepted"] - before >= 20
    if server.mode == "disaggregated":
        assert seen["decode"]["transfer"]["pulls_ok"] >= len(PROMPTS)  # first tokens came from prefill
        assert seen["prefill"]["speculative"] == {"proposed": 0, "accepted": 0, "off": {}}
