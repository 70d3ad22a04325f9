"""Which slice of the model each tensor-parallel rank holds. No torch: config checks use it too.

Query heads, the MLP's intermediate rows and the vocabulary are split in tp equal parts. KV heads
are split when tp divides their count; when tp is a multiple of it each KV head is replicated on
tp / num_kv_heads ranks (vLLM's rule); any other degree is refused. Rank r's query heads then use
exactly the KV heads rank r holds, so attention needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.model.families import FAMILIES
from cluster.engine.model_config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    tp: int
    rank: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (its KV cache holds only these)
    kv_replicas: int  # ranks holding each KV head (1: split, tp / num_kv_heads: replicated)
    head_start: int  # first query head of this rank
    kv_head_start: int
    intermediate: int  # MLP rows on this rank
    vocab_shard: int  # vocabulary rows on this rank (the last shard padded when tp does not divide it)
    vocab_start: int

    @classmethod
    def for_model(cls, mc: ModelConfig, tp: int, rank: int) -> "ShardPlan":
        check_degree(mc, tp)
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is outside tensor_parallel_size {tp}")
        replicas = max(1, tp // mc.num_kv_heads)
        heads = mc.num_heads // tp
        vocab_shard = -(-mc.vocab_size // tp)
        kv_heads = kv_heads_per_rank(mc.num_kv_heads, tp)
        return cls(tp=tp, rank=rank, num_heads=heads, num_kv_heads=kv_heads,
                   kv_replicas=replicas, head_start=rank * heads, kv_head_start=(rank // replicas) * kv_heads,
                   intermediate=mc.intermediate_size // tp, vocab_shard=vocab_shard,
                   vocab_start=rank * vocab_shard)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads in each rank's pool: split when tp divides them, one (replicated) when tp is a multiple."""
    return max(1, num_kv_heads // tp)


def check_degree(mc: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the counts and the degrees that would work, unless `tp` can shard `mc`."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp > 1 and not mc.family.tensor_parallel:
        sharded = sorted(t for t, f in FAMILIES.items() if f.tensor_parallel)
        raise ValueError(f"tensor_parallel_size {tp}: model_type {mc.model_type!r} has no tensor-parallel "
                         f"sharding here (families that shard: {', '.join(sharded)}); use tensor_parallel_size 1")
    if tp > 1 and mc.weight_quant is not None:
        raise ValueError(f"tensor_parallel_size {tp}: block-scaled fp8 checkpoints (quantization_config) are "
                         "dequantized at load at tensor_parallel_size 1 only; use tensor_parallel_size 1")
    h, hkv = mc.num_heads, mc.num_kv_heads
    kv_ok = hkv % tp == 0 if tp <= hkv else tp % hkv == 0
    problems = []
    if h % tp:
        problems.append(f"{h} query heads")
    if not kv_ok:
        problems.append(f"{hkv} KV heads (split needs tp to divide them, replication tp a multiple of them)")
    if mc.intermediate_size % tp:
        problems.append(f"intermediate size {mc.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {tp} cannot shard this model: it does not divide "
                         f"{' nor '.join(problems)}; degrees that work: {valid_degrees(mc)}")


def valid_degrees(mc: ModelConfig, up_to: int = 64) -> list[int]:
    if not mc.family.tensor_parallel:
        return [1]
    h, hkv = mc.num_heads, mc.num_kv_heads
    return [tp for tp in range(1, up_to + 1)
            if h % tp == 0 and mc.intermediate_size % tp == 0 and (hkv % tp == 0 if tp <= hkv else tp % hkv == 0)]
