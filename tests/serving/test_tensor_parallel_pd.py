"""Disaggregated Serve apps whose pools differ in tensor-parallel degree, on the tiny model (2 KV
heads: one a rank at tp=2; kv_transfer/rank_reads.py):
- prefill tp=2 (its worker rank a Ray actor serving READs), decode tp=1: the decode replica reads
  head 0 from prefill rank 0 and head 1 from rank 1;
- prefill tp=1, decode tp=2: each decode rank reads its head from the one prefill replica;
- prefill tp=2, decode tp=2 (the same degree): decode rank r reads head r from prefill rank r.

Greedy streams equal the in-process engine's, every prompt's KV was pulled (no recompute), each
pulled block's bytes once, and both pools are whole afterwards. Then a mixture of experts with latent
attention (DeepSeek-V3) and one with expert parallelism on decode (Qwen3-MoE), each prefilled at
tp=1 and decoded at tp=2, against transformers' tokens.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from tests.engine.test_engine_correctness import prompts as engine_prompts
from tests.engine.test_families import write_checkpoint
from tests.helpers import grpc_stub, pool_loads, serve_replica_ids, wait_for, wait_pools_whole
from tests.reference import hf_greedy
from tests.serving.test_tensor_parallel_serving import NUM_BLOCKS, prompt, request


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)],
                ids=["P-tp2-D-tp1", "P-tp1-D-tp2", "P-tp2-D-tp2"])
def app(request, serve_apps, tiny_model):
    p_tp, d_tp = request.param
    with serve_apps.run(tiny_model, engine={"num_blocks": NUM_BLOCKS},
                        prefill={"num_replicas": 1, "num_cpus": 0.5, "engine": {"tensor_parallel_size": p_tp}},
                        decode={"num_replicas": 1, "num_cpus": 0.5, "engine": {"tensor_parallel_size": d_tp}}) as cfg:
        yield cfg, p_tp, d_tp


def reference(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in LLMEngine.from_model(model, num_blocks=NUM_BLOCKS).generate(prompts, sp)]


def load(pool: str, replica: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(pool, "pdserve").load.remote(target_replica=replica).result(timeout_s=30)


@pytest.mark.timeout(240)
def test_pools_of_different_degrees_stream_the_reference_tokens(app, tiny_model):
    app, p_tp, d_tp = app
    # 92 .. 179 tokens: past routing.local_prefill_threshold (64), so each is prefilled on the tp=2 pool
    prompts = [prompt(i) for i in range(3, 7)]
    with grpc_stub(app) as stub, concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda p: [t for r in stub.Generate(request(p, 8), timeout=120)
                                           for t in r.token_ids], prompts))
    assert streams == reference(tiny_model, prompts, 8)
    [p_replica], [d_replica] = serve_replica_ids()["prefill"], serve_replica_ids()["decode"]
    seen: dict = {}

    def whole() -> bool:
        seen.update(prefill=load("prefill", p_replica), decode=load("decode", d_replica))
        return all(s["free_blocks"] == s["total_blocks"] == NUM_BLOCKS for s in seen.values())

    try:
        wait_for(whole, "both pools whole", timeout=30)
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen {seen}") from None
    t = seen["decode"]["transfer"]
    assert (t["pulls_ok"], t["pulls_failed"], t["fallbacks_recompute"]) == (len(prompts), 0, 0), t
    assert t["blocks_pulled"] == sum(-(-len(p) // 16) for p in prompts), t  # each prompt block once
    for pool, tp in (("prefill", p_tp), ("decode", d_tp)):
        assert len(seen[pool].get("rank_nodes", [seen[pool]["node_id"]])) == tp


# Mixtures of experts and latent attention, prefill tp=1 -> decode tp=2, through the served app: each
# prompt prefilled on the prefill pool (local_prefill_threshold 0), its KV pulled by both decode ranks.
# DeepSeek-V3 (test_families' config at 2 layers: MLA, layer 1 8 routed experts + 1 shared, each split
# by its rows): each decode rank reads every latent block whole from the one prefill rank, so the pull
# moves blocks x latent block bytes (2 layers x 16 tokens x (32 + 8) x fp32 = 5,120) x 2 ranks.
# Qwen3-MoE (layer 0 sparse, layer 1 dense; 2 KV heads of 32) with expert parallelism on decode (4 whole
# experts a rank): each decode rank reads its head, the block's bytes (2 x K, V x 16 x 2 x 32 x fp32) once.
MOE_PROMPT_LENGTHS = [17, 40, 100]  # 2 + 3 + 7 blocks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type, decode_engine, pulled_bytes_per_block", [
    ("deepseek_v3", {}, 2 * 5120),
    ("qwen3_moe", {"expert_parallel": True}, 2 * 2 * 16 * 2 * 32 * 4),
], ids=["deepseek_v3", "qwen3_moe-expert-parallel"])
def test_moe_and_latent_attention_pulled_from_tp1_into_tp2_give_transformers_tokens(
        serve_apps, tmp_path_factory, model_type, decode_engine, pulled_bytes_per_block):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp(f"pd-tp-{model_type}"), model_type, seed=3,
                                  num_hidden_layers=2)
    ps = engine_prompts(len(MOE_PROMPT_LENGTHS), MOE_PROMPT_LENGTHS, seed=49)
    decode = {"num_replicas": 1, "num_cpus": 0.5, "engine": {"tensor_parallel_size": 2, **decode_engine}}
    with serve_apps.run(checkpoint, engine={"num_blocks": NUM_BLOCKS}, routing={"local_prefill_threshold": 0},
                        prefill={"num_replicas": 1, "num_cpus": 0.5}, decode=decode) as cfg:
        received = pool_loads()["prefill"]["requests_received"]
        with grpc_stub(cfg) as stub:
            streams = [[t for r in stub.Generate(request(p, 8), timeout=120) for t in r.token_ids] for p in ps]
        assert streams == [hf_greedy(checkpoint, p, 8) for p in ps]
        seen = wait_pools_whole()
        assert seen["prefill"]["requests_received"] - received == len(ps)  # each one prefilled there
        assert seen["prefill"]["total_blocks"] == seen["decode"]["total_blocks"] == NUM_BLOCKS
        t = seen["decode"]["transfer"]
        assert (t["pulls_ok"], t["pulls_failed"], t["fallbacks_recompute"]) == (len(ps), 0, 0), t
        blocks = sum(-(-n // 16) for n in MOE_PROMPT_LENGTHS)
        assert (t["blocks_pulled"], t["bytes_pulled"]) == (blocks, blocks * pulled_bytes_per_block), t
        assert len(seen["decode"]["rank_nodes"]) == 2
