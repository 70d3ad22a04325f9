"""DeepSeek-V2 beyond what every family's tests check (tests/engine/test_families.py runs its tiny
checkpoint on prompts of 1 to 300 tokens, cold and from the prefix cache; test_tensor_parallel_families
at tp=2): its router and MoE equal transformers' DeepseekV2Moe exactly, greedy and group-limited, and
what transformers' DeepSeek-V2 does not define is refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.deepseek_moe import DeepSeekMoE
from cluster.engine.model_config import ModelConfig
from tests.engine.test_deepseek import moe_like
from tests.engine.test_engine_correctness import GREEDY, assert_leak_free, prompts
from tests.engine.test_families import assert_moe_matches, hf_config, write_checkpoint
from tests.reference import hf_greedy


def moe_pair(**change) -> tuple[DeepseekV2Moe, DeepSeekMoE]:
    """transformers' block and ours with the same random weights (3 of 8 experts a token)."""
    config = hf_config("deepseek_v2", num_experts_per_tok=3, **change)
    torch.manual_seed(7)
    block = DeepseekV2Moe(config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return block, moe_like(block, config)  # strict: no correction bias on either side


@pytest.mark.parametrize("change", [{}, {"topk_method": "greedy", "n_group": None, "topk_group": None}],
                         ids=["group_limited_greedy", "greedy"])
def test_router_and_moe_equal_transformers_block(change):
    """Softmax scores; group-limited: the 2 of 4 groups whose best expert scores highest; the weights
    scaled by 1.5 and not renormalised; plus the shared expert."""
    block, ours = moe_pair(**change)
    x = torch.randn(37, 64)
    experts = assert_moe_matches(block, ours, x)
    with torch.inference_mode():
        ours.num_groups = ours.topk_groups = 1  # every expert eligible
        greedy = ours.route(x)[1]
    most_groups = max(len(set(row)) for row in (experts // 2).tolist())  # a token's experts' groups (2 each)
    limited = "topk_method" not in change
    assert most_groups == (2 if limited else 3)  # group-limited: 3 choices from at most the 2 groups
    assert torch.equal(greedy, experts) != limited  # the group limit changed some choice


def test_greedy_routing_with_q_lora_equals_transformers(tmp_path):
    """DeepSeek-V2's own shape (q through a LoRA, greedy top-k over all experts, every layer sparse)."""
    model = write_checkpoint(tmp_path / "m", "deepseek_v2", seed=21, q_lora_rank=32, topk_method="greedy",
                             n_group=None, topk_group=None, first_k_dense_replace=0)
    mc = ModelConfig.from_dir(model)
    assert (mc.mla.q_lora_rank, mc.moe_routing.num_groups, mc.moe.sparse_layers) == (32, 1, (0, 1, 2))
    eng = LLMEngine.from_model(model, num_blocks=48, max_num_batched_tokens=64)
    ps = prompts(3, [3, 33, 130], seed=22)
    assert [o.token_ids for o in eng.generate(ps, GREEDY)] == [hf_greedy(model, p, 12) for p in ps]
    assert_leak_free(eng)


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "sigmoid"},
     "config.json scoring_func='sigmoid' is not supported: DeepSeek-V2 routing is softmax"),
    ({"topk_method": "noaux_tc"}, "config.json topk_method='noaux_tc' is not supported: DeepSeek-V2 routing is one of "
                                  "greedy, group_limited_greedy"),
    ({"norm_topk_prob": True}, "config.json norm_topk_prob=True is not supported: transformers' DeepSeek-V2 router "
                               "never renormalises"),
    ({"n_group": 3}, "config.json n_group=3 is not supported: the 8 experts must split into groups of at least 1"),
    ({"topk_group": 5}, "config.json topk_group=5 is not supported: it must be 1..4 (n_group)"),
    ({"num_key_value_heads": 2}, "config.json num_key_value_heads=2 is not supported: latent attention expands"),
])
def test_an_unsupported_deepseek_v2_field_is_refused_by_name(change, message):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(hf_config("deepseek_v2").to_dict() | change)
    assert str(e.value).startswith(message)


def test_the_routers_scoring_is_part_of_the_fingerprint():
    """V2's softmax router gives another fingerprint than V3's sigmoid one on the same fields (the field
    is left out at V3's value, so V3's fingerprint is what it was before the field existed)."""
    v3 = ModelConfig.from_hf_dict(hf_config("deepseek_v3").to_dict())
    v2_router = dataclasses.replace(v3, moe_routing=dataclasses.replace(v3.moe_routing, scoring="softmax"))
    assert v2_router.fingerprint() != v3.fingerprint()
