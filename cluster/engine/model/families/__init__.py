"""The served model families: config.json's model_type -> its Family (families/base.py says what
one declares). A new family is one file here and one line below."""

from __future__ import annotations

from cluster.engine.model.families.base import Family
from cluster.engine.model.families.deepseek_v2 import DEEPSEEK_V2
from cluster.engine.model.families.deepseek_v3 import DEEPSEEK_V3
from cluster.engine.model.families.gemma3 import GEMMA3_TEXT, MULTIMODAL
from cluster.engine.model.families.llama import LLAMA, QWEN2
from cluster.engine.model.families.mixtral import MIXTRAL
from cluster.engine.model.families.phi3 import PHI3
from cluster.engine.model.families.qwen3 import QWEN3
from cluster.engine.model.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "mixtral": MIXTRAL,
    "qwen3_moe": QWEN3_MOE,
    "phi3": PHI3,
    "gemma3_text": GEMMA3_TEXT,
    "deepseek_v2": DEEPSEEK_V2,
    "deepseek_v3": DEEPSEEK_V3,
}
# model_types refused with a reason of their own (besides the served list).
REFUSED = {"gemma3": MULTIMODAL}


def family_of(model_type: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        why = f": {REFUSED[model_type]}" if model_type in REFUSED else ""
        raise ValueError(f"config.json model_type={model_type!r} is not supported{why} "
                         f"(supported: {', '.join(sorted(FAMILIES))})")
    return family
