"""Disaggregated Serve apps whose pools differ in tensor-parallel degree, on the tiny model (2 KV
heads: one a rank at tp=2; kv_transfer/rank_reads.py):
- prefill tp=2 (its worker rank a Ray actor serving READs), decode tp=1: the decode replica reads
  head 0 from prefill rank 0 and head 1 from rank 1;
- prefill tp=1, decode tp=2: each decode rank reads its head from the one prefill replica;
- prefill tp=2, decode tp=2 (the same degree): decode rank r reads head r from prefill rank r.

Greedy streams equal the in-process engine's, every prompt's KV was pulled (no recompute), each
pulled block's bytes once, and both pools are whole afterwards.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from tests.helpers import grpc_stub, serve_replica_ids, wait_for
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
