"""Mixtral: Mistral's attention, every layer's MLP a sparse MoE (softmax over the experts, top-k,
the k weights renormalised to sum to one, expert outputs scaled in float32)."""

from __future__ import annotations

from cluster.engine.model.families.base import FUSE_QKV_GATE_UP, Family, FamilyFields, MoEConfig, Rename, required

_EXPERT = r"\.block_sparse_moe\.experts\.(?P<expert>\d+)"

# Hub checkpoints (and save_pretrained of transformers 5) name each expert's w1 (gate), w3 (up) and
# w2 (down); transformers 5's own stacked names (mlp.experts.gate_up_proj, mlp.experts.down_proj,
# mlp.gate) are the model's parameter names, so they load unrenamed.
RENAMES = (
    Rename(r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
    Rename(_EXPERT + r"\.w1\.weight$", ".mlp.experts.gate_up_proj", 0),
    Rename(_EXPERT + r"\.w3\.weight$", ".mlp.experts.gate_up_proj", 1),
    Rename(_EXPERT + r"\.w2\.weight$", ".mlp.experts.down_proj"),
) + FUSE_QKV_GATE_UP


def _mixtral(cfg: dict) -> FamilyFields:
    layers = cfg["num_hidden_layers"]
    moe = MoEConfig(num_experts=required(cfg, "num_local_experts"), top_k=required(cfg, "num_experts_per_tok"),
                    intermediate_size=cfg["intermediate_size"], renormalize=True, float32_weights=True,
                    sparse_layers=tuple(range(layers)))
    return FamilyFields(moe=moe)


MIXTRAL = Family(parse=_mixtral, renames=RENAMES, llama_shaped=False, cuda_graphs=False, tensor_parallel=True,
                 expert_size_field="intermediate_size", expert_count_field="num_local_experts")
