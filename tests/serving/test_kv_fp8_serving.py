"""A bf16 prefill pool feeding an fp8 decode pool through the whole app (issue 49): every prompt is
prefilled remotely and converted on decode's pull, and the tokens are exactly those of an fp8 engine
in process (the conversion stores what that engine stores). The decode replica reports twice the
prefill's blocks for the same kv_cache_memory_gb: the load the router and the autoscaler read."""

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from tests.engine.test_engine_correctness import prompts
from tests.helpers import grpc_stub, pool_loads, wait_pools_whole

ENGINE = {"num_blocks": None, "kv_cache_memory_gb": 0.002, "dtype": "bfloat16"}


def test_bf16_prefill_pool_feeds_an_fp8_decode_pool(serve_apps, tiny_model):
    ps = prompts(2, [17, 70], seed=49)
    reference = LLMEngine.from_model(tiny_model, num_blocks=64, dtype="bfloat16", kv_cache_dtype="fp8")
    want = [o.token_ids for o in reference.generate(ps, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    with serve_apps.run(tiny_model, engine=ENGINE, decode={"engine": {"kv_cache_dtype": "fp8"}},
                        routing={"local_prefill_threshold": 0}) as cfg:
        loads = pool_loads()
        # 2 layers x K,V x 16 tokens x 2 heads x 16 dims: 4096 bytes a bf16 block, 2048 an fp8 one
        assert (loads["prefill"]["total_blocks"], loads["decode"]["total_blocks"]) == (524, 1048)
        received = loads["prefill"]["requests_received"]
        with grpc_stub(cfg) as stub:
            for prompt, tokens in zip(ps, want):
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                    max_tokens=8, temperature=0, ignore_eos=True))
                assert [t for r in stub.Generate(request, timeout=60) for t in r.token_ids] == tokens
        assert pool_loads()["prefill"]["requests_received"] - received == len(ps)  # each one prefilled there
        wait_pools_whole()
