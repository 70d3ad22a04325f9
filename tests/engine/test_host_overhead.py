"""The host-side shortcuts of a decode step (issue 40) change no output: the decode groups' plan is
the scalar DP's, and the torch path (the GPU path, attention_backend torch, model_ops torch) gives
transformers' greedy tokens with many decodes of mixed lengths in a step."""

import random

from cluster.engine.attention.metadata import partition_by_length
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
