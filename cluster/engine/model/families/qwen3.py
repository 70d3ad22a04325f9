"""Qwen3 (dense): the Llama layer with an RMSNorm over head_dim on each q and k head before RoPE,
no q/k/v bias, head_dim from config.json (not hidden / heads)."""

from __future__ import annotations

from cluster.engine.model.families.base import Family, FamilyFields, unsupported


def parse_qwen3_attention(cfg: dict) -> None:
    """Qwen3's attention_bias adds q/k/v and o biases: not implemented (no released Qwen3 sets it)."""
    if cfg.get("attention_bias"):
        raise unsupported("attention_bias", True, "Qwen3 attention with biases is not implemented")


def _qwen3(cfg: dict) -> FamilyFields:
    parse_qwen3_attention(cfg)
    return FamilyFields(qk_norm=True)


QWEN3 = Family(parse=_qwen3, llama_shaped=False, tensor_parallel=True)
