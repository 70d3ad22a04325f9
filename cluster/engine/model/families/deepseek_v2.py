"""DeepSeek-V2 (and V2-Lite, V2.5): DeepSeek-V3's layers (latent attention, model/mla.py; shared
experts) behind transformers' DeepseekV2TopkRouter: float32 softmax scores, no score correction
bias, top-k over every expert (topk_method greedy) or over the topk_group groups whose best expert
scores highest (group_limited_greedy), the k scores times routed_scaling_factor and never
renormalised. The rope pairs are interleaved (transformers rotates them as complex numbers)."""

from __future__ import annotations

import dataclasses

from cluster.engine.model.families.base import Family, FamilyFields, GroupedRouting, MoEConfig, required, unsupported
from cluster.engine.model.families.deepseek_v3 import (RENAMES, moe_layers, parse_groups, parse_mla, parse_scaling,
                                                       shared_intermediate)

TOPK_METHODS = ("greedy", "group_limited_greedy")


def parse_routing(cfg: dict, num_experts: int, top_k: int) -> GroupedRouting:
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise unsupported("scoring_func", cfg["scoring_func"], "DeepSeek-V2 routing is softmax here (as transformers')")
    method = cfg.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise unsupported("topk_method", method, f"DeepSeek-V2 routing is one of {', '.join(TOPK_METHODS)} here "
                          "(as transformers')")
    if cfg.get("norm_topk_prob"):  # DeepSeek's own code would renormalise: two answers, so neither is given
        raise unsupported("norm_topk_prob", cfg["norm_topk_prob"], "transformers' DeepSeek-V2 router never "
                          "renormalises the top-k weights; the served DeepSeek-V2 checkpoints set it false")
    groups, topk_groups = (1, 1) if method == "greedy" else parse_groups(cfg, num_experts, top_k, 1)
    return GroupedRouting(num_groups=groups, topk_groups=topk_groups, scaling=parse_scaling(cfg, 1.0),
                          shared_intermediate_size=shared_intermediate(cfg), scoring="softmax")


def _deepseek_v2(cfg: dict) -> FamilyFields:
    mla = dataclasses.replace(parse_mla(cfg), rope_interleave=True)
    sparse = moe_layers(cfg, 0)
    if not sparse:
        return FamilyFields(mla=mla)
    num_experts = required(cfg, "n_routed_experts", "num_local_experts")
    moe = MoEConfig(num_experts=num_experts, top_k=required(cfg, "num_experts_per_tok"),
                    intermediate_size=required(cfg, "moe_intermediate_size"), renormalize=False,
                    float32_weights=True, sparse_layers=sparse)
    return FamilyFields(moe=moe, moe_routing=parse_routing(cfg, num_experts, moe.top_k), mla=mla)


# Tensor-parallel as DeepSeek-V3 (the same parameters): query heads split, the latent whole on every
# rank, experts split by their rows or, with expert_parallel, whole per rank.
DEEPSEEK_V2 = Family(parse=_deepseek_v2, renames=RENAMES, llama_shaped=False, cuda_graphs=False,
                     tensor_parallel=True, expert_count_field="n_routed_experts")
