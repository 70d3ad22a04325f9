"""Families beyond Llama served by the whole app (issue 49): a Qwen3-MoE checkpoint (q/k norms, sparse
and dense layers), a Phi-3 one (fused checkpoint tensors), a Gemma 3 one (sliding layers of a
24-token window: the pulled KV read windowed by decode), a DeepSeek-V2 and a DeepSeek-V3 one
(latent attention: their pulls move the latent), each written by transformers' save_pretrained, give exactly transformers'
greedy tokens over gRPC with every prompt prefilled on the prefill pool and its KV pulled by decode;
both pools end whole."""

import pytest

from protos.pdserve.v1 import generation_pb2 as pb
from tests.engine.test_engine_correctness import prompts
from tests.engine.test_families import write_checkpoint
from tests.helpers import grpc_stub, pool_loads, wait_pools_whole
from tests.reference import hf_greedy

LENGTHS = [1, 17, 300]  # one token; past one block; past the chunk budget


@pytest.mark.parametrize("model_type", ["qwen3_moe", "phi3", "gemma3_text", "deepseek_v2", "deepseek_v3"])
def test_a_family_is_served_with_every_prompt_prefilled_remotely(serve_apps, tmp_path_factory, model_type):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp(f"served-{model_type}"), model_type)
    # local_prefill_threshold 0: no prompt is ever prefilled on decode while a prefill replica exists
    with serve_apps.run(checkpoint, routing={"local_prefill_threshold": 0}) as cfg:
        received = pool_loads()["prefill"]["requests_received"]
        with grpc_stub(cfg) as stub:
            for prompt in prompts(len(LENGTHS), LENGTHS, seed=49):
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                    max_tokens=8, temperature=0, ignore_eos=True))
                replies = list(stub.Generate(request, timeout=120))
                assert [t for r in replies for t in r.token_ids] == hf_greedy(checkpoint, prompt, 8), len(prompt)
        assert pool_loads()["prefill"]["requests_received"] - received == len(LENGTHS)  # each one prefilled there
        wait_pools_whole()
