"""Tensor parallelism on CPU (gloo): tp ranks give tp=1's and transformers' greedy tokens.

Rank 0 is the engine in this process; the other ranks are spawned processes that only execute
(cluster/engine/distributed/launch.py). After each run: the driver's pool is whole, every rank ran
every forward, each rank's KV cache has the driver's block count and holds exactly its KV heads
of every block (equal to the same heads of tp=1's cache), and the workers exit cleanly.
"""

from __future__ import annotations

import random

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.launch import tensor_parallel_engine
from cluster.engine.distributed.plan import ShardPlan, check_degree
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model_config import ModelConfig
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import Tokenizer
from tests.reference import hf_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# A 24-token budget chunks the longer prompts: decodes, first chunks and later chunks share steps.
OPTIONS = dict(num_blocks=32, block_size=16, max_num_batched_tokens=24)
LENGTHS = [1, 17, 33, 64]


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[256] + [rng.randrange(256) for _ in range(n - 1)] for n in LENGTHS]


def run(model: str, tp: int, ps, **options):
    """(tokens per prompt, the ranks' reports with their KV caches, the workers' exit codes) at tp."""
    config = EngineConfig(model=model, tensor_parallel_size=tp, **OPTIONS, **options)
    with tensor_parallel_engine(config, timeout_s=60) as (engine, ranks):
        tokens = [o.token_ids for o in engine.generate(ps, GREEDY)]
        engine.check_invariants()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks == 32 and engine.kv.num_requests() == 0
        reports = engine.tensor_parallel.reports(with_kv=True)
    return tokens, reports, ranks.exit_codes


def reference(model: str, ps, **options) -> tuple[list[list[int]], torch.Tensor]:
    engine = LLMEngine(EngineConfig(model=model, **OPTIONS, **options))
    tokens = [o.token_ids for o in engine.generate(ps, GREEDY)]
    assert engine.kv.num_free_blocks == 32
    return tokens, engine.kv_cache


def assert_ranks_hold_their_heads(reports, tp1_cache: torch.Tensor, heads: list[tuple[int, int]]):
    assert [r.rank for r in reports] == list(range(len(heads)))
    assert len({r.steps for r in reports}) == 1 and reports[0].steps > 0  # every rank ran every forward
    for r, (start, n) in zip(reports, heads):
        assert r.kv_heads == (start, n)
        assert r.kv_shape == (*tp1_cache.shape[:4], n, tp1_cache.shape[5])
        torch.testing.assert_close(r.kv_cache, tp1_cache[:, :, :, :, start : start + n], atol=1e-5, rtol=1e-4)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shape", [
    dict(heads=4, kv_heads=2, hidden=64, vocab=320),
    # qkv biases, a tied embedding, and a vocabulary tp does not divide (the last shard padded)
    dict(heads=8, kv_heads=4, hidden=128, vocab=331, arch="qwen2", tie_embeddings=True),
], ids=["llama-gqa-4q-2kv", "qwen2-tied-8q-4kv-odd-vocab"])
def test_tp2_equals_tp1_and_transformers(model_factory, shape):
    model = model_factory("tp", layers=2, max_positions=512, seed=3, **shape)
    ps = prompts(seed=1)
    tp1_tokens, tp1_cache = reference(model, ps)
    tokens, reports, exit_codes = run(model, 2, ps)
    assert tokens == tp1_tokens == [hf_greedy(model, p, 8) for p in ps]
    kv = shape["kv_heads"] // 2
    assert_ranks_hold_their_heads(reports, tp1_cache, [(0, kv), (kv, kv)])
    assert exit_codes == [0]


@pytest.mark.timeout(90)
def test_kv_heads_are_replicated_when_tp_is_a_multiple_of_them(model_factory):
    model = model_factory("tp-mqa", layers=2, heads=4, kv_heads=1, hidden=64, vocab=320, max_positions=512, seed=4)
    ps = prompts(seed=2)
    tp1_tokens, tp1_cache = reference(model, ps)
    tokens, reports, exit_codes = run(model, 2, ps)
    assert tokens == tp1_tokens == [hf_greedy(model, p, 8) for p in ps]
    assert_ranks_hold_their_heads(reports, tp1_cache, [(0, 1), (0, 1)])  # both ranks hold the one KV head
    assert exit_codes == [0]


def test_smollm2_refuses_tp2_exactly(smollm2):
    """9 query heads and 3 KV heads: tp=2 divides neither and is no multiple of 3."""
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineConfig(model=smollm2, tensor_parallel_size=2, num_blocks=8))
    assert str(e.value) == (
        "tensor_parallel_size 2 cannot shard this model: it does not divide 9 query heads nor 3 KV heads "
        "(split needs tp to divide them, replication tp a multiple of them); degrees that work: [1, 3]")


@pytest.mark.timeout(120)
def test_smollm2_tp3_equals_transformers(smollm2):
    """tp=1 equals transformers on this prompt too (test_real_model.py), so tp=3 equals tp=1."""
    prompt = Tokenizer(smollm2).encode("The three primary colors are")
    expected = hf_greedy(smollm2, prompt, 8)
    tokens, reports, exit_codes = run(smollm2, 3, [prompt])
    assert tokens == [expected]
    assert [(r.kv_heads, r.kv_shape[4]) for r in reports] == [((0, 1), 1), ((1, 1), 1), ((2, 1), 1)]
    assert exit_codes == [0, 0]


def test_shard_plans():
    def mc(h, hkv, inter=128, vocab=320):
        return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=inter,
                           num_layers=1, num_heads=h, num_kv_heads=hkv, head_dim=16, max_position_embeddings=64,
                           rms_norm_eps=1e-5, tie_word_embeddings=False, qkv_bias=False, dtype="float32")

    p = ShardPlan.for_model(mc(8, 4, vocab=331), 2, 1)
    assert (p.num_heads, p.head_start, p.num_kv_heads, p.kv_head_start, p.kv_replicas) == (4, 4, 2, 2, 1)
    assert (p.intermediate, p.vocab_shard, p.vocab_start) == (64, 166, 166)
    # tp 4 over 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1, each with the query heads that use it
    assert [(q.head_start, q.kv_head_start, q.kv_replicas) for q in
            (ShardPlan.for_model(mc(8, 2), 4, r) for r in range(4))] == [(0, 0, 2), (2, 0, 2), (4, 1, 2), (6, 1, 2)]
    with pytest.raises(ValueError, match="^tensor_parallel_size 4 cannot shard this model: it does not divide "
                       r"6 KV heads \(split needs"):
        check_degree(mc(12, 6), 4)
    with pytest.raises(ValueError, match="intermediate size 100; degrees that work: \\[1, 2, 4, 5"):
        check_degree(mc(20, 20, inter=100), 8)


@pytest.mark.timeout(60)
def test_a_dead_worker_fails_the_step_and_the_pool_stays_whole(tiny_model):
    """Killing a rank does not hang the driver: the next collective fails, the step's requests end
    with error (the engine's step-failure path; the replica's health counts it), no block leaks."""
    config = EngineConfig(model=tiny_model, tensor_parallel_size=2, **OPTIONS)
    with tensor_parallel_engine(config, timeout_s=20) as (engine, ranks):
        ranks.processes[0].kill()
        ranks.processes[0].join(10)
        outs = engine.generate(prompts(seed=5)[:2], GREEDY)
        assert [(o.finish_reason, o.error_kind) for o in outs] == [("error", "forward")] * 2
        assert all(o.error.startswith("engine step failed: ") for o in outs)
        assert engine.stats.step_errors == 1
        engine.check_invariants()
        assert engine.kv.num_free_blocks == 32 and engine.kv.num_requests() == 0
    assert ranks.exit_codes == [-9]


MIB_GB = 2**-10  # kv_cache_memory_gb of 1 MiB


def test_kv_capacity_counts_blocks_of_the_whole_model_in_each_devices_memory(tiny_model):
    """kv_cache_memory_gb is each device's: a rank's block holds only its KV heads, so a replica of
    tp ranks holds more blocks of the whole model. Tiny model: a block is 8 KiB (2 layers, K and V,
    16 tokens, 2 KV heads of 16 floats); tp=2 splits the heads (4 KiB a rank), tp=4 replicates
    them (one head a rank: still 4 KiB, so no more blocks than tp=2)."""
    from cluster.engine.config import EngineOptions, kv_block_bytes_per_rank
    from cluster.engine.validation import RequestValidator

    mc = ModelConfig.from_dir(tiny_model)
    opts = {tp: EngineOptions(tensor_parallel_size=tp, kv_cache_memory_gb=MIB_GB) for tp in (1, 2, 4)}
    assert [kv_block_bytes_per_rank(mc, o) for o in opts.values()] == [8192, 4096, 4096]
    assert [RequestValidator.for_model(tiny_model, [o]).num_blocks for o in opts.values()] == [128, 256, 256]
    # a request must fit the smallest pool it visits: a tp=1 prefill pool beside a tp=2 decode pool
    assert RequestValidator.for_model(tiny_model, [opts[2], opts[1]]).num_blocks == 128


@pytest.mark.timeout(60)
def test_a_tp2_replica_reports_its_capacity_in_blocks_of_the_whole_model(tiny_model):
    """What the router and the autoscaler read (LoadReporter.replica_load, EngineLoad.kv_usage):
    256 blocks of the whole model, each rank's pool 1 MiB (256 blocks of its one KV head)."""
    from cluster.serving.reporting import LoadReporter
    from kv_transfer.stats import TransferStats

    config = EngineConfig(model=tiny_model, tensor_parallel_size=2, kv_cache_memory_gb=MIB_GB,
                          max_num_batched_tokens=24)
    with tensor_parallel_engine(config, timeout_s=30) as (engine, ranks):
        reporter = LoadReporter(engine, TransferStats(), "tp2", "decode", registry=None)
        engine.add_request("r", prompt_token_ids=prompts(seed=7)[3], sampling=GREEDY)  # 64 prompt tokens
        engine.step()  # its first chunk of 24 tokens: two blocks held
        held = reporter.replica_load(engine.load(), now=0.0)
        assert (held.total_blocks, held.free_blocks) == (256, 254)
        assert engine.load().kv_usage == 2 / 256
        while engine.has_unfinished():
            engine.step()
        idle = reporter.replica_load(engine.load(), now=0.0)
        assert (idle.total_blocks, idle.free_blocks) == (256, 256)
        shapes = [r.kv_shape for r in engine.tensor_parallel.reports()]
    assert shapes == [(256, 2, 2, 16, 1, 16)] * 2  # 256 x 2 x 2 x 16 x 1 x 16 floats = 1 MiB a rank
    assert ranks.exit_codes == [0]
