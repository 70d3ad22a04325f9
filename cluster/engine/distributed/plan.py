"""Which slice of the model each tensor-parallel rank holds. No torch: config checks use it too.

Query heads, the MLP's intermediate rows and the vocabulary are split in tp equal parts. KV heads
are split when tp divides their count; when tp is a multiple of it each KV head is replicated on
tp / num_kv_heads ranks (vLLM's rule); any other degree is refused. Rank r's query heads then use
exactly the KV heads rank r holds, so attention needs no communication.

Mixtures of experts shard every expert by its intermediate size (vLLM's rule): each rank holds
1/tp of every expert's gate/up rows and down columns (and of DeepSeek-V3's shared experts), the
router whole, so every rank routes the same tokens to the same experts and the layer's partial
outputs are summed by one all-reduce, as a dense MLP's. With expert_parallel the routed experts
are partitioned whole instead (vLLM's --enable-expert-parallel over the tp group): rank r holds
experts [r E/tp, (r+1) E/tp) with all their rows, runs only the rows routed to them, and the same
one all-reduce sums the ranks' outputs; the router, and DeepSeek-V3's shared experts (still split
by their rows), are as without it. Latent attention (MLA) splits its query
heads; the latent (kv_lora_rank + qk_rope_head_dim a token) is one "KV head" every rank holds whole.
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
    num_kv_heads: int  # KV heads on this rank (its KV cache holds only these); latent attention: 1, the latent
    kv_replicas: int  # ranks holding each KV head (1: split, tp / num_kv_heads: replicated; the latent: tp)
    head_start: int  # first query head of this rank
    kv_head_start: int
    intermediate: int  # dense MLP rows on this rank
    vocab_shard: int  # vocabulary rows on this rank (the last shard padded when tp does not divide it)
    vocab_start: int
    expert_intermediate: int = 0  # each expert's rows on this rank (0: no experts; expert parallel: all)
    shared_intermediate: int = 0  # the shared experts' rows on this rank (DeepSeek-V3; 0: none)
    expert_parallel: bool = False  # the routed experts partitioned whole over the ranks
    expert_start: int = 0  # the first routed expert this rank holds (0 unless expert parallel)
    local_experts: int = 0  # routed experts this rank holds (every one, or E / tp with expert parallel; 0: none)

    @classmethod
    def for_model(cls, mc: ModelConfig, tp: int, rank: int, expert_parallel: bool = False) -> "ShardPlan":
        check_degree(mc, tp, expert_parallel)
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is outside tensor_parallel_size {tp}")
        kv_heads = 1 if mc.mla else mc.num_kv_heads  # the latent: one entry every rank holds
        replicas = max(1, tp // kv_heads)
        heads = mc.num_heads // tp
        vocab_shard = -(-mc.vocab_size // tp)
        local_kv = kv_heads_per_rank(kv_heads, tp)
        shared = mc.moe_routing.shared_intermediate_size if mc.moe_routing else 0
        return cls(tp=tp, rank=rank, num_heads=heads, num_kv_heads=local_kv,
                   kv_replicas=replicas, head_start=rank * heads, kv_head_start=(rank // replicas) * local_kv,
                   intermediate=mc.intermediate_size // tp, vocab_shard=vocab_shard,
                   vocab_start=rank * vocab_shard, shared_intermediate=shared // tp,
                   **_experts(mc, tp, rank, expert_parallel))

    def holds_expert(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.local_experts


def _experts(mc: ModelConfig, tp: int, rank: int, expert_parallel: bool) -> dict:
    """The routed experts a rank holds: all of them, 1/tp of each one's rows; or E/tp whole ones."""
    if mc.moe is None:
        return {}
    e, inter = mc.moe.num_experts, mc.moe.intermediate_size
    if expert_parallel:
        return dict(expert_parallel=True, expert_start=rank * (e // tp), local_experts=e // tp,
                    expert_intermediate=inter)
    return dict(local_experts=e, expert_intermediate=inter // tp)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads in each rank's pool: split when tp divides them, one (replicated) when tp is a multiple."""
    return max(1, num_kv_heads // tp)


def _has_dense_mlp(mc: ModelConfig) -> bool:
    return mc.moe is None or len(mc.moe.sparse_layers) < mc.num_layers


def _divisors(mc: ModelConfig, expert_parallel: bool = False) -> list[tuple[int, str]]:
    """(count, what it is) for each count a degree must divide (the KV heads apart: _kv_ok)."""
    out = [(mc.num_heads, f"{mc.num_heads} query heads")]
    if _has_dense_mlp(mc):
        out.append((mc.intermediate_size, f"intermediate size {mc.intermediate_size}"))
    if mc.moe is not None and expert_parallel:
        n = mc.moe.num_experts
        out.append((n, f"{mc.family.expert_count_field} {n} (whole experts, split over the ranks by "
                       "expert_parallel)"))
    elif mc.moe is not None:
        n = mc.moe.intermediate_size
        out.append((n, f"{mc.family.expert_size_field} {n} (each expert's rows, split over the ranks)"))
    if mc.moe_routing is not None:  # n_shared_experts x moe_intermediate_size: divided whenever the experts are
        n = mc.moe_routing.shared_intermediate_size
        out.append((n, f"the shared experts' {n} rows"))
    return out


def _kv_ok(mc: ModelConfig, tp: int) -> bool:
    if mc.mla is not None:  # the latent is replicated: any degree
        return True
    hkv = mc.num_kv_heads
    return hkv % tp == 0 if tp <= hkv else tp % hkv == 0


def check_expert_parallel(mc: ModelConfig, expert_parallel: bool) -> None:
    """expert_parallel on a model without routed experts is refused, not ignored."""
    if expert_parallel and mc.moe is None:
        raise ValueError(f"expert_parallel: model_type {mc.model_type!r} has no routed experts (no mixture-of-"
                         "experts layer) to partition; set expert_parallel false")


def check_degree(mc: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Raise ValueError naming the counts and the degrees that would work, unless `tp` can shard `mc`
    (its routed experts whole per rank with expert_parallel)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    check_expert_parallel(mc, expert_parallel)
    if tp > 1 and not mc.family.tensor_parallel:
        sharded = sorted(t for t, f in FAMILIES.items() if f.tensor_parallel)
        raise ValueError(f"tensor_parallel_size {tp}: model_type {mc.model_type!r} has no tensor-parallel "
                         f"sharding here (families that shard: {', '.join(sharded)}); use tensor_parallel_size 1")
    divisors = _divisors(mc, expert_parallel)
    problems = [what for n, what in divisors[:1] if n % tp]
    if not _kv_ok(mc, tp):
        problems.append(f"{mc.num_kv_heads} KV heads (split needs tp to divide them, replication tp a multiple of "
                        "them)")
    problems += [what for n, what in divisors[1:] if n % tp]
    if problems:
        works = valid_degrees(mc, expert_parallel=expert_parallel)
        raise ValueError(f"tensor_parallel_size {tp} cannot shard this model: it does not divide "
                         f"{' nor '.join(problems)}; degrees that work: {works}")


def valid_degrees(mc: ModelConfig, up_to: int = 64, expert_parallel: bool = False) -> list[int]:
    if not mc.family.tensor_parallel:
        return [1]
    divisors = _divisors(mc, expert_parallel)
    return [tp for tp in range(1, up_to + 1) if _kv_ok(mc, tp) and all(n % tp == 0 for n, _ in divisors)]
