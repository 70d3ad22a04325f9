"""The head mapping between pools of different tensor-parallel degrees (kv_transfer/head_map.py):
which prefill rank each decode rank reads each of its KV heads from, the byte runs of a head slice
within a block, and the refusal of a degree that cannot be mapped. No torch, no NIXL."""

from __future__ import annotations

import pytest

from cluster.engine.distributed.plan import ShardPlan
from cluster.engine.model_config import ModelConfig
from kv_transfer.errors import IncompatiblePeerError
from kv_transfer.head_map import HeadSlice, head_map, rank_heads, slice_runs


def test_rank_heads_are_the_engines_shard_plans():
    for heads, kv_heads in [(4, 2), (8, 4), (4, 1), (8, 2), (9, 3)]:
        mc = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16 * heads, intermediate_size=72, num_layers=1,
                         num_heads=heads, num_kv_heads=kv_heads, head_dim=16, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, qkv_bias=False, dtype="float32")
        for tp in [t for t in (1, 2, 3, 4, 8) if heads % t == 0 and 72 % t == 0
                   and (kv_heads % t == 0 if t <= kv_heads else t % kv_heads == 0)]:
            for rank in range(tp):
                plan = ShardPlan.for_model(mc, tp, rank)
                assert rank_heads(kv_heads, tp, rank) == range(plan.kv_head_start, plan.kv_head_start + plan.num_kv_heads)


def test_prefill_tp2_to_decode_tp1_reads_one_head_from_each_prefill_rank():
    assert head_map(2, 2, 1) == [[HeadSlice(0, 0, 0, 1), HeadSlice(1, 0, 1, 1)]]


def test_prefill_tp1_to_decode_tp2_each_decode_rank_reads_its_heads_of_the_one_pool():
    assert head_map(2, 1, 2) == [[HeadSlice(0, 0, 0, 1)], [HeadSlice(0, 1, 0, 1)]]
    assert head_map(4, 1, 2) == [[HeadSlice(0, 0, 0, 2)], [HeadSlice(0, 2, 0, 2)]]  # adjacent heads: one slice


def test_replicated_heads_are_read_from_one_replica_spread_over_decode_ranks():
    # prefill tp=4 over 2 heads: head 0 on ranks 0-1, head 1 on ranks 2-3
    assert head_map(2, 4, 2) == [[HeadSlice(0, 0, 0, 1)], [HeadSlice(3, 0, 0, 1)]]
    assert head_map(2, 4, 1) == [[HeadSlice(0, 0, 0, 1), HeadSlice(2, 0, 1, 1)]]
    # decode tp=4 over 2 heads: every decode rank reads its one head, two ranks per head
    assert head_map(2, 1, 4) == [[HeadSlice(0, 0, 0, 1)], [HeadSlice(0, 0, 0, 1)],
                                 [HeadSlice(0, 1, 0, 1)], [HeadSlice(0, 1, 0, 1)]]
    assert head_map(2, 2, 2) == [[HeadSlice(0, 0, 0, 1)], [HeadSlice(1, 0, 0, 1)]]  # same degree: rank to rank


def test_a_degree_that_cannot_map_is_refused_naming_the_side():
    with pytest.raises(IncompatiblePeerError) as e:
        head_map(3, 2, 1)
    assert str(e.value) == ("cannot map KV heads: the prefill pool's tensor_parallel_size 2 neither divides the "
                            "model's 3 KV heads nor is a multiple of them")
    with pytest.raises(IncompatiblePeerError, match="the decode pool's tensor_parallel_size 4 neither"):
        head_map(6, 1, 4)


def test_byte_runs_of_a_head_slice_in_a_block():
    """The tiny model's block: 2 layers x K,V x 16 tokens = 64 rows of 2 heads x 16 floats (128 B a row)."""
    rows, head = 2 * 2 * 16, 16 * 4
    runs = slice_runs(rows, 2, 1, 1, head)  # head 1 of a tp=1 pool: decode rank 1 of tp=2 reads these
    assert runs[:2] == [(64, 64), (192, 64)] and len(runs) == 64 and runs[-1] == (63 * 128 + 64, 64)
    assert sum(n for _, n in runs) == 4096  # half the 8 KiB block
    assert slice_runs(rows, 1, 0, 1, head) == [(0, 4096)]  # a tp=2 rank's whole pool block: one region
    # decode tp=1 from prefill tp=2: one whole-block region from each prefill rank, 8 KiB in all
    assert [slice_runs(rows, 1, s.src_head, s.count, head) for s in head_map(2, 2, 1)[0]] == [[(0, 4096)]] * 2
    with pytest.raises(ValueError, match=r"heads \[1, 3\) are outside a pool of 2"):
        slice_runs(rows, 2, 1, 2, head)
