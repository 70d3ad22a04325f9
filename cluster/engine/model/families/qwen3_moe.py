"""Qwen3-MoE: Qwen3's attention (q/k norm); a layer's MLP is the sparse MoE when it is not in
mlp_only_layers and (layer + 1) is a multiple of decoder_sparse_step, else a dense MLP of
intermediate_size. Routing: softmax over the experts, top-k, renormalised only with norm_topk_prob,
the weights cast to the model dtype before they scale the expert outputs."""

from __future__ import annotations

from cluster.engine.model.families.base import (FUSE_QKV_GATE_UP, Family, FamilyFields, MoEConfig, Rename, required,
                                                unsupported)
from cluster.engine.model.families.qwen3 import parse_qwen3_attention

_EXPERT = r"\.mlp\.experts\.(?P<expert>\d+)"

# Per-expert names (Hub checkpoints, transformers 5's save_pretrained); mlp.gate (the router) and
# transformers 5's stacked mlp.experts.gate_up_proj / down_proj are the model's own names.
RENAMES = (
    Rename(_EXPERT + r"\.gate_proj\.weight$", ".mlp.experts.gate_up_proj", 0),
    Rename(_EXPERT + r"\.up_proj\.weight$", ".mlp.experts.gate_up_proj", 1),
    Rename(_EXPERT + r"\.down_proj\.weight$", ".mlp.experts.down_proj"),
) + FUSE_QKV_GATE_UP


def sparse_layers(cfg: dict, num_experts: int) -> tuple[int, ...]:
    layers = cfg["num_hidden_layers"]
    dense = cfg.get("mlp_only_layers") or []
    outside = [i for i in dense if not 0 <= i < layers]
    if outside:
        raise unsupported("mlp_only_layers", dense, f"layers {outside} are outside 0..{layers - 1}")
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise unsupported("decoder_sparse_step", step, "it must be a positive integer")
    if num_experts == 0:
        return ()
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def _qwen3_moe(cfg: dict) -> FamilyFields:
    parse_qwen3_attention(cfg)
    # transformers 5 writes num_local_experts (its attribute map); Hub configs say num_experts.
    num_experts = required(cfg, "num_experts", "num_local_experts")
    layers = sparse_layers(cfg, num_experts)
    moe = None
    if layers:
        moe = MoEConfig(num_experts=num_experts, top_k=required(cfg, "num_experts_per_tok"),
                        intermediate_size=required(cfg, "moe_intermediate_size"),
                        renormalize=bool(cfg.get("norm_topk_prob", False)), float32_weights=False,
                        sparse_layers=layers)
    return FamilyFields(qk_norm=True, moe=moe)


QWEN3_MOE = Family(parse=_qwen3_moe, renames=RENAMES, llama_shaped=False, cuda_graphs=False, tensor_parallel=True)
