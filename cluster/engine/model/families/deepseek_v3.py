"""DeepSeek-V3 (and R1): multi-head latent attention (model/mla.py) and, past the first
`first_k_dense_replace` dense layers, the MoE with group-limited sigmoid routing, the score
correction bias, `routed_scaling_factor` and shared experts (model/deepseek_moe.py), as transformers'
deepseek_v3 modeling defines them. YaRN rope scaling (the released checkpoints' rope_scaling) is
refused by the rope parser, naming rope_type."""

from __future__ import annotations

from cluster.engine.model.families.base import (Family, FamilyFields, GroupedRouting, MLAConfig, MoEConfig, Rename,
                                                required, unsupported)

_EXPERT = r"\.mlp\.experts\.(?P<expert>\d+)"

# Per-expert names (Hub checkpoints, transformers 5's save_pretrained); the attention's projections,
# mlp.gate (the router and its e_score_correction_bias) and the stacked experts are our own names.
# No q/k/v fusion: MLA's projections stay apart.
RENAMES = (
    Rename(_EXPERT + r"\.gate_proj\.weight$", ".mlp.experts.gate_up_proj", 0),
    Rename(_EXPERT + r"\.up_proj\.weight$", ".mlp.experts.gate_up_proj", 1),
    Rename(_EXPERT + r"\.down_proj\.weight$", ".mlp.experts.down_proj"),
    Rename(r"\.mlp\.shared_experts\.gate_proj\.", ".mlp.shared_experts.gate_up_proj.", 0),
    Rename(r"\.mlp\.shared_experts\.up_proj\.", ".mlp.shared_experts.gate_up_proj.", 1),
    Rename(r"\.mlp\.gate_proj\.", ".mlp.gate_up_proj.", 0),
    Rename(r"\.mlp\.up_proj\.", ".mlp.gate_up_proj.", 1),
)


def _positive(cfg: dict, field: str, even: bool = False) -> int:
    value = cfg.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (even and value % 2):
        raise unsupported(field, value, "it must be a positive" + (" even" if even else "") + " integer")
    return value


def parse_mla(cfg: dict) -> MLAConfig:
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise unsupported("num_key_value_heads", kv_heads,
                          f"latent attention expands the latent to every head: it must equal num_attention_heads "
                          f"({heads})")
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(q_lora_rank=None if q_lora is None else _positive(cfg, "q_lora_rank"),
                     kv_lora_rank=_positive(cfg, "kv_lora_rank"),
                     qk_nope_head_dim=_positive(cfg, "qk_nope_head_dim"),
                     qk_rope_head_dim=_positive(cfg, "qk_rope_head_dim", even=True),
                     v_head_dim=_positive(cfg, "v_head_dim"),
                     rope_interleave=bool(cfg.get("rope_interleave", True)),
                     bias=bool(cfg.get("attention_bias", False)))


def parse_routing(cfg: dict, num_experts: int, top_k: int) -> GroupedRouting:
    # transformers' V3 router is always sigmoid + noaux_tc; the Hub configs say so: anything else is refused.
    for field, served in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(field, served) != served:
            raise unsupported(field, cfg[field], f"DeepSeek-V3 routing is {served} here (as transformers')")
    groups, topk_groups = parse_groups(cfg, num_experts, top_k, 2)
    return GroupedRouting(num_groups=groups, topk_groups=topk_groups, scaling=parse_scaling(cfg, 2.5),
                          shared_intermediate_size=shared_intermediate(cfg))


def parse_groups(cfg: dict, num_experts: int, top_k: int, min_per_group: int) -> tuple[int, int]:
    """(n_group, topk_group): the expert groups and how many of them a token's experts come from."""
    groups = _positive(cfg, "n_group")
    if num_experts % groups or num_experts // groups < min_per_group:
        raise unsupported("n_group", groups, f"the {num_experts} experts must split into groups of at least "
                          f"{min_per_group}")
    topk_groups = _positive(cfg, "topk_group")
    per_group = num_experts // groups
    if topk_groups > groups or top_k > topk_groups * per_group:
        raise unsupported("topk_group", topk_groups, f"it must be 1..{groups} (n_group) and its groups must hold "
                          f"num_experts_per_tok={top_k} experts ({per_group} a group)")
    return groups, topk_groups


def parse_scaling(cfg: dict, default: float) -> float:
    scaling = cfg.get("routed_scaling_factor", default)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or scaling <= 0:
        raise unsupported("routed_scaling_factor", scaling, "it must be a positive number")
    return float(scaling)


def shared_intermediate(cfg: dict) -> int:
    return required(cfg, "moe_intermediate_size") * _positive(cfg, "n_shared_experts")


def moe_layers(cfg: dict, first_dense_default: int) -> tuple[int, ...]:
    """The sparse layers: every one past the first `first_k_dense_replace` dense ones."""
    first_dense = cfg.get("first_k_dense_replace", first_dense_default)
    if not isinstance(first_dense, int) or first_dense < 0:
        raise unsupported("first_k_dense_replace", first_dense, "it must be a non-negative integer")
    if cfg.get("moe_layer_freq", 1) != 1:  # the Hub configs' field; transformers makes every later layer sparse
        raise unsupported("moe_layer_freq", cfg["moe_layer_freq"], "every layer past first_k_dense_replace is sparse")
    return tuple(range(first_dense, cfg["num_hidden_layers"]))


def _deepseek_v3(cfg: dict) -> FamilyFields:
    mla = parse_mla(cfg)
    sparse = moe_layers(cfg, 3)
    if not sparse:
        return FamilyFields(mla=mla)
    num_experts = required(cfg, "n_routed_experts", "num_local_experts")
    moe = MoEConfig(num_experts=num_experts, top_k=required(cfg, "num_experts_per_tok"),
                    intermediate_size=required(cfg, "moe_intermediate_size"),
                    renormalize=bool(cfg.get("norm_topk_prob", True)), float32_weights=True, sparse_layers=sparse)
    return FamilyFields(moe=moe, moe_routing=parse_routing(cfg, num_experts, moe.top_k), mla=mla)


# Tensor-parallel: query heads split, the latent whole on every rank, experts (routed and shared)
# split by their intermediate size, or the routed ones whole per rank with expert_parallel
# (distributed/plan.py).
DEEPSEEK_V3 = Family(parse=_deepseek_v3, renames=RENAMES, llama_shaped=False, cuda_graphs=False,
                     skips_extra_layers=True, tensor_parallel=True, expert_count_field="n_routed_experts")
