"""The host-side shortcuts of a decode step (issue 40) change no output: the decode groups' plan is
the scalar DP's, and the torch path (the GPU path, attention_backend torch, model_ops torch) gives
transformers' greedy tokens with many decodes of mixed lengths in a step."""

import random

from cluster.engine.attention.metadata import partition_by_length
from cluster.engine.kv_cache.manager import NO_PREFIX
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from tests.reference import hf_greedy


def reference_partition(blocks: list[int], max_groups: int) -> list[tuple[int, int]]:
    """The scalar DP partition_by_length used to be: the plan the fast one must equal."""
    n = len(blocks)
    if n == 0:
        return []
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    cost[0][0] = 0
    for g in range(1, max_groups + 1):
        for i in range(1, n + 1):
            for j in range(i):
                c = cost[g - 1][j] + (i - j) * blocks[j]
                if c < cost[g][i]:
                    cost[g][i], cut[g][i] = c, j
    g = min(range(1, max_groups + 1), key=lambda k: (cost[k][n], k))
    bounds, i = [], n
    while i > 0:
        j = cut[g][i]
        bounds.append((j, i))
        i, g = j, g - 1
    return bounds[::-1]


def test_partition_equals_the_scalar_dp():
    rng = random.Random(0)
    cases = [[], [3], [5, 5, 5], [9, 1], [4, 4, 3, 3, 1, 1, 1], [2, 1, 1, 1, 1, 1, 1, 1, 1]]
    for _ in range(300):
        n = rng.randrange(1, 40)
        top = rng.choice([2, 5, 40, 300])
        cases.append(sorted((rng.randrange(1, top) for _ in range(n)), reverse=True))
    for blocks in cases:
        for groups in (1, 2, 4):
            assert partition_by_length(blocks, groups) == reference_partition(blocks, groups), (blocks, groups)


def test_torch_path_many_decodes_equal_transformers(tiny_model):
    engine = LLMEngine.from_model(tiny_model, num_blocks=128, block_size=16, attention_backend="torch",
                                  model_ops="torch", max_num_seqs=16)
    rng = random.Random(5)
    # lengths spread over several blocks: several decode groups, re-planned as requests cross blocks
    ps = [[256] + [rng.randrange(256) for _ in range(n - 1)] for n in (3, 9, 16, 17, 30, 33, 47, 64, 70, 95)]
    outs = engine.generate(ps, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(tiny_model, p, 20), f"prompt of {len(p)} tokens"
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_decode_fast_paths_agree_with_the_general_ones(tiny_model):
    """A decode step's shortcuts (issue 40, host time): allocate_slots returns at once when the
    request's last block has room, cache_blocks when no block filled, the static rows are reused
    when their table did not change. Checked at every call and step on a pool small enough to
    preempt, with requests crossing blocks: allocate_slots answers what the block count says,
    every full computed block is indexed, the tokens are transformers' and the pool ends whole."""
    engine = LLMEngine.from_model(tiny_model, num_blocks=12, block_size=16, attention_backend="torch",
                                  model_ops="torch", max_num_seqs=16, max_num_batched_tokens=64,
                                  static_decode="eager")
    kv = engine.kv
    allocate = kv.allocate_slots

    def checked(req, n, cached=NO_PREFIX):
        new, revived = kv._blocks_needed(req, n, cached)  # the general path's count, before it runs
        want = new + len(cached.loads) + revived <= kv.num_free_blocks
        got = allocate(req, n, cached)
        assert got == want, (req.request_id, n)
        return got

    kv.allocate_slots = checked
    rng = random.Random(6)
    ps = [[256] + [rng.randrange(256) for _ in range(n - 1)] for n in (30, 45, 20, 60, 35, 50)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = [engine.add_request(f"r{i}", prompt_token_ids=p, sampling=sp).request_id for i, p in enumerate(ps)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.token_ids
        engine.check_invariants()
        for req in engine.scheduler.running:
            blocks = kv.block_ids(req.request_id)
            assert kv._num_cached.get(req.request_id, 0) == min(req.num_computed_tokens // 16, len(blocks))
    assert engine.stats.preemptions > 0 and engine.runner.static.steps > 0
    assert [tokens[rid] for rid in ids] == [hf_greedy(tiny_model, p, 24) for p in ps]
    assert kv.num_free_blocks == kv.num_blocks and engine.runner.static._rows == {}
