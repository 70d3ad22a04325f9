"""DeepSeek-V3 beyond what every family's tests check (tests/engine/test_families.py): its router and
MoE equal transformers' block exactly, decode attends in the latent space, the pool's block is the
latent's bytes, the variants equal transformers, and what is not served is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from cluster.engine.config import EngineOptions, kv_block_bytes
from cluster.engine.distributed.plan import ShardPlan, check_degree, valid_degrees
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.deepseek_moe import DeepSeekMoE
from cluster.engine.model_config import ModelConfig
from cluster.engine.sampling_params import SamplingParams
from tests.engine.test_engine_correctness import GREEDY, assert_leak_free, prompts
from tests.engine.test_families import assert_moe_matches, hf_config, write_checkpoint
from tests.reference import hf_greedy, hf_model

LATENT = 32 + 8  # kv_lora_rank + qk_rope_head_dim of test_families' DeepSeek-V3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_checkpoint(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")


def moe_like(block: torch.nn.Module, config) -> DeepSeekMoE:
    """Our MoE layer holding transformers' DeepSeek MoE `block`'s weights (its shared expert's gate
    and up fused, as ours holds them); strict: every parameter on both sides."""
    mc = ModelConfig.from_hf_dict(config.to_dict())
    ours = DeepSeekMoE(mc.moe, mc.moe_routing, config.hidden_size)
    state = dict(block.state_dict())
    state["shared_experts.gate_up_proj.weight"] = torch.cat([state.pop("shared_experts.gate_proj.weight"),
                                                             state.pop("shared_experts.up_proj.weight")])
    ours.load_state_dict(state)
    return ours


def test_router_and_moe_equal_transformers_block():
    """Sigmoid scores, the correction bias, the best group only (topk_group 1 of 2), renormalised and
    scaled by 2.5, plus the shared expert: the same experts in the same order, the same weights."""
    config = hf_config("deepseek_v3", num_experts_per_tok=3)
    torch.manual_seed(7)
    block = DeepseekV3MoE(config).eval()
    for p in (*block.parameters(), block.gate.e_score_correction_bias):
        torch.nn.init.normal_(p, std=0.1)
    ours = moe_like(block, config)
    x = torch.randn(37, 64)
    experts = assert_moe_matches(block, ours, x)
    with torch.inference_mode():
        ours.gate.e_score_correction_bias.zero_()
        unbiased = ours.route(x)[1]
    assert ((experts // 4) == (experts[:, :1] // 4)).all()  # every choice from one group of 4
    assert not torch.equal(unbiased, experts)  # the bias changed some choice: the test sees it


def test_decode_attends_in_the_latent_space(checkpoint):
    """kv_b_proj expands latents to per-head keys in prefill only: a decode step takes q into the
    latent space and reads the cached latents as they are (the weight, never the layer, is used)."""
    eng = LLMEngine.from_model(checkpoint, num_blocks=16)
    calls = []
    for layer in eng.model.layers:
        proj = layer.self_attn.kv_b_proj
        proj.forward = lambda x, f=proj.forward: (calls.append(x.shape[0]), f(x))[1]
    p = prompts(1, [20], seed=13)[0]
    out = eng.generate([p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(checkpoint, p, 6)
    assert calls == [20, 20, 20]  # the prompt's one step, 3 layers; 5 decode steps expand nothing
    assert_leak_free(eng)


def test_the_pool_block_is_the_latent_times_layers(checkpoint):
    eng = LLMEngine.from_model(checkpoint, kv_cache_memory_gb=0.001, block_size=16)
    assert eng.block_bytes == 3 * 16 * LATENT * 4  # layers x tokens x (latent + rope key) x float32: 7,680
    assert tuple(eng.kv_cache.shape) == (139, 3, 1, 16, 1, LATENT)  # 2**30 / 1000 // 7,680 blocks
    assert eng.kv.num_blocks == 139
    # DeepSeek-V3's own shape (61 layers, 512 + 64) in bf16: 70,272 bytes a token, 954 blocks a GiB
    full = {k: v for k, v in hf_config("deepseek_v3").to_dict().items() if k not in ("head_dim", "qk_head_dim")}
    defaults = {k: v for k, v in type(hf_config("deepseek_v3"))().to_dict().items() if k in full}
    mc = ModelConfig.from_hf_dict(full | defaults | {"dtype": "bfloat16"})
    assert (mc.num_layers, mc.mla.kv_lora_rank, mc.mla.qk_rope_head_dim) == (61, 512, 64)
    block = kv_block_bytes(mc, EngineOptions(kv_cache_memory_gb=1))
    assert (block // 16, EngineOptions(kv_cache_memory_gb=1).num_kv_blocks(block)) == (61 * 576 * 2, 954)


def test_variants_equal_transformers(tmp_path):
    """q straight from q_proj (q_lora_rank None), rope not interleaved, attention biases, every layer
    sparse, 4 groups of which 2 are eligible, weights not renormalised; a multi-token-prediction layer
    stored past the last (as DeepSeek-V3's checkpoints hold) is skipped, as transformers does."""
    model = write_checkpoint(tmp_path / "m", "deepseek_v3", seed=14, q_lora_rank=None, rope_interleave=False,
                             attention_bias=True, first_k_dense_replace=0, n_group=4, topk_group=2,
                             norm_topk_prob=False, routed_scaling_factor=1.5)
    tensors = load_file(Path(model) / "model.safetensors")
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(tensors, Path(model) / "model.safetensors", metadata={"format": "pt"})
    mc = ModelConfig.from_dir(model)
    assert (mc.mla.q_lora_rank, mc.mla.rope_interleave, mc.mla.bias, mc.moe.sparse_layers) == (None, False, True,
                                                                                               (0, 1, 2))
    eng = LLMEngine.from_model(model, num_blocks=48, max_num_batched_tokens=64)
    ps = prompts(3, [3, 33, 130], seed=15)
    assert [o.token_ids for o in eng.generate(ps, GREEDY)] == [hf_greedy(model, p, 12) for p in ps]
    hit = eng.generate([ps[2][:100] + [5, 6, 7]], GREEDY)[0]  # 6 blocks (96 tokens) from the cache
    assert (hit.num_cached_tokens, hit.token_ids) == (96, hf_greedy(model, ps[2][:100] + [5, 6, 7], 12))
    assert_leak_free(eng)


def _yarn(**params) -> dict:
    return {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
                                **params}}


# DeepSeek-V3's released rope_scaling (factor 40, mscale 1, mscale_all_dim 1, beta 32/1) scaled to a
# 128-token pretraining context served to 512; Qwen3's (factor only: cos/sin scaled by mscale(4)).
@pytest.mark.parametrize("model_type, rope", [
    ("deepseek_v3", _yarn(factor=4.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    ("qwen3", _yarn(factor=4.0)),
])
def test_yarn_rope_scaling_equals_transformers(tmp_path, model_type, rope):
    model = write_checkpoint(tmp_path / "m", model_type, seed=17, **rope)
    mc = ModelConfig.from_dir(model)
    assert (mc.rope.rope_type, mc.rope.factor, mc.rope.original_max_position_embeddings) == ("yarn", 4.0, 128)
    eng = LLMEngine.from_model(model, num_blocks=48, max_num_batched_tokens=64)
    ps = prompts(3, [5, 140, 300], seed=18)  # past the 128 pretrained positions
    assert [o.token_ids for o in eng.generate(ps, GREEDY)] == [hf_greedy(model, p, 12) for p in ps]
    assert_leak_free(eng)
    # The tables themselves (blended frequencies, cos/sin times the attention factor) are transformers'
    cos, sin = hf_model(model).model.rotary_emb(torch.zeros(1), torch.arange(512)[None])
    ours = eng.model.rotary
    assert (ours.cos - cos[0]).abs().max() < 1e-6 and (ours.signed_sin.abs() - sin[0].abs()).abs().max() < 1e-6


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "config.json rope_type='dynamic' is not supported (default, linear, llama3, yarn)"),
    (_yarn(original_max_position_embeddings=None, factor=4.0),
     "config.json rope_parameters.original_max_position_embeddings=None: yarn needs the pretrained context length"),
    ({"num_key_value_heads": 2}, "config.json num_key_value_heads=2 is not supported: latent attention expands"),
    ({"n_group": 3}, "config.json n_group=3 is not supported: the 8 experts must split into groups of at least 2"),
    ({"topk_group": 3}, "config.json topk_group=3 is not supported: it must be 1..2 (n_group)"),
    ({"scoring_func": "softmax"}, "config.json scoring_func='softmax' is not supported"),
    ({"topk_method": "greedy"}, "config.json topk_method='greedy' is not supported"),
    ({"moe_layer_freq": 2}, "config.json moe_layer_freq=2 is not supported"),
    ({"qk_rope_head_dim": 7}, "config.json qk_rope_head_dim=7 is not supported: it must be a positive even integer"),
    ({"kv_lora_rank": None}, "config.json kv_lora_rank=None is not supported"),
])
def test_an_unsupported_deepseek_field_is_refused_by_name(change, message):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(hf_config("deepseek_v3").to_dict() | change)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("option, message", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype=fp8 is not implemented for latent attention (model_type 'deepseek_v3'): "
                                "its cache holds the latent in the run dtype; use kv_cache_dtype auto"),
    ({"static_decode": "eager"}, "static_decode=eager's paged kernel reads per-head K and V, not the latent of latent "
                                 "attention (model_type 'deepseek_v3'); use static_decode auto or off"),
    ({"attention_backend": "cpu_paged"}, "attention_backend=cpu_paged reads per-head K and V; latent attention "
                                         "(model_type 'deepseek_v3') attends over its latent itself (model/mla.py); "
                                         "use attention_backend auto"),
])
def test_engine_paths_that_read_per_head_kv_are_refused_for_latent_attention(checkpoint, option, message):
    with pytest.raises(ValueError) as e:
        LLMEngine.from_model(checkpoint, num_blocks=8, **option)
    assert str(e.value) == message


def test_a_degree_the_experts_cannot_take_is_refused_and_the_latent_takes_any():
    """The latent is replicated, so no KV-head rule applies; the heads and every expert's rows (routed
    and shared, moe_intermediate_size each) must divide. tests/engine/test_tensor_parallel_families.py
    runs tp=2."""
    mc = ModelConfig.from_hf_dict(hf_config("deepseek_v3", moe_intermediate_size=18).to_dict())
    with pytest.raises(ValueError) as e:
        check_degree(mc, 4)
    assert str(e.value) == ("tensor_parallel_size 4 cannot shard this model: it does not divide moe_intermediate_size "
                            "18 (each expert's rows, split over the ranks) nor the shared experts' 18 rows; degrees "
                            "that work: [1, 2]")
    wide = ModelConfig.from_hf_dict(hf_config("deepseek_v3", num_attention_heads=8, num_key_value_heads=8).to_dict())
    assert valid_degrees(wide) == [1, 2, 4, 8]
    # rank 3 of 4: query heads 6-7, the one latent "KV head" held by all 4 ranks, 12 of 48 rows of each expert
    p = ShardPlan.for_model(wide, 4, 3)
    assert (p.num_heads, p.head_start, p.num_kv_heads, p.kv_head_start, p.kv_replicas) == (2, 6, 1, 0, 4)
    assert (p.expert_intermediate, p.shared_intermediate, p.intermediate) == (12, 12, 24)
