"""Llama 2/3, Mistral and Qwen2: the Llama layer (Qwen2 adds q/k/v biases)."""

from __future__ import annotations

from cluster.engine.model.families.base import Family, FamilyFields


def _llama(cfg: dict) -> FamilyFields:
    # Llama's attention_bias adds q/k/v and o biases; the o bias has no place here, so such a
    # checkpoint is refused by the loader naming that tensor.
    return FamilyFields(qkv_bias=bool(cfg.get("attention_bias", False)))


def _qwen2(cfg: dict) -> FamilyFields:
    return FamilyFields(qkv_bias=True)


LLAMA = Family(parse=_llama, tensor_parallel=True)
QWEN2 = Family(parse=_qwen2, tensor_parallel=True)
