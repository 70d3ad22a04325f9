"""The families beyond Llama (Qwen3, Mixtral, Qwen3-MoE, Phi-3, Gemma 3, DeepSeek-V3) equal transformers token for
token, on
checkpoints transformers itself writes (save_pretrained); what a family cannot serve is refused, named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, Gemma3TextConfig, MixtralConfig,
                          Phi3Config, Qwen3Config, Qwen3MoeConfig)

from cluster.engine.distributed.plan import check_degree, valid_degrees
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.families import FAMILIES as FAMILY_REGISTRY
from cluster.engine.model.families.base import Family, FamilyFields
from cluster.engine.model.init_model import write_tokenizer
from cluster.engine.model.moe import SparseMoE
from cluster.engine.model_config import ModelConfig
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.static_decode import static_mode
from tests.engine.test_engine_correctness import GREEDY, assert_leak_free, prompts
from tests.reference import hf_greedy, hf_last_logits

# 3 layers, hidden 64, GQA 4/2, the byte tokenizer's 258 tokens in a 320 vocabulary. A wider init than
# transformers' 0.02 so that the router's top-k choices are far apart and matter to the tokens.
COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, bos_token_id=256, eos_token_id=257, pad_token_id=None,
              initializer_range=0.05)
FAMILIES = {
    "qwen3": (Qwen3Config, dict(intermediate_size=96, head_dim=32)),  # head_dim * heads != hidden
    "mixtral": (MixtralConfig, dict(intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)),
    # layer 1 dense (mlp_only_layers), 0 and 2 sparse; top-2 weights not renormalised (norm_topk_prob off)
    "qwen3_moe": (Qwen3MoeConfig, dict(intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                                       num_experts_per_tok=2, mlp_only_layers=[1], head_dim=32)),
    "phi3": (Phi3Config, dict(intermediate_size=96)),
    # Gemma 3: layers 0 and 2 slide over 24 positions (RoPE base 500), layer 1 is global (base 30000,
    # linear scaling x2); prompts of 1-300 tokens cross the window, chunks of 64 start past it.
    "gemma3_text": (Gemma3TextConfig, dict(intermediate_size=96, head_dim=32, sliding_window=24,
                                           sliding_window_pattern=2, rope_local_base_freq=500.0, rope_theta=30000.0,
                                           query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                                           rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # MLA (a 32 + 8 latent a token and layer; q through a rank-32 LoRA), layer 0 dense, 1-2 MoE: 8 experts in 2
    # groups, top-2 from the best group, one shared expert (tests/engine/test_deepseek.py has the rest)
    "deepseek_v3": (DeepseekV3Config, dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=48,
                                           n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                           first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    # DeepSeek-V2 (V2-Lite's q_proj straight from the hidden state): MLA as V3's, layer 0 dense, 1-2 MoE behind
    # softmax routing: 8 experts in 4 groups, top-2 from the 2 groups whose best expert scores highest, x 1.5
    "deepseek_v2": (DeepseekV2Config, dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=48,
                                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                           topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                           routed_scaling_factor=1.5, first_k_dense_replace=1, q_lora_rank=None,
                                           kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
}
# transformers initialises Gemma's norm weights to 0 (a scale of 1 + 0): random ones test the offset.
RANDOM_NORMS = {"gemma3_text"}
# The families here that shard at tp > 1 (all of them).
TENSOR_PARALLEL = {"qwen3", "phi3", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gemma3_text"}
MOE_BLOCKS = {"mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
              "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"}


def hf_config(model_type: str, **overrides):
    cls, kwargs = FAMILIES[model_type]
    return cls(**COMMON | kwargs | overrides)


def assert_moe_matches(block: torch.nn.Module, ours: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`ours` routes `x` exactly as transformers' MoE `block` (the same experts, in the same order,
    the same weights) and its output differs from the block's only by float rounding; its experts."""
    with torch.inference_mode():
        _, ref_weights, ref_experts = block.gate(x)
        ref = block(x[None])[0]
        weights, experts = ours.route(x)
        out = ours(x)
    assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
    assert (out - ref).abs().max().item() < 1e-6
    return experts


def write_checkpoint(out: Path, model_type: str, seed: int = 0, **overrides) -> str:
    """A random float32 checkpoint as transformers saves it, with the byte tokenizer the engine reads."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(model_type, **overrides), dtype=torch.float32)
    for name, p in model.named_parameters():
        if model_type in RANDOM_NORMS and "norm" in name:
            torch.nn.init.normal_(p, std=0.2)
    for name, bias in model.named_buffers():  # DeepSeek-V3's score correction bias, zero at init: make it choose
        if name.endswith("e_score_correction_bias"):
            bias.normal_(std=0.05)
    model.save_pretrained(out)
    write_tokenizer(out)
    return str(out)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def engine(family) -> LLMEngine:
    # A 64-token budget chunks every prompt past 64 tokens; 16-token blocks.
    return LLMEngine.from_model(family[1], num_blocks=96, max_num_batched_tokens=64, block_size=16)


def test_batched_prompts_from_1_to_300_tokens_equal_transformers(family, engine):
    _, model = family
    ps = prompts(7, [1, 5, 16, 17, 40, 100, 300], seed=1)
    outs = engine.generate(ps, GREEDY)  # all seven in one batch
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in ps]
    assert [(o.finish_reason, o.num_output_tokens) for o in outs] == [("length", 12)] * 7
    assert_leak_free(engine)


def test_prefix_cache_hit_gives_transformers_tokens(family, engine):
    _, model = family
    engine.kv.pool.reset_cache()
    base = prompts(1, [70], seed=2)[0]
    first = engine.generate([base], GREEDY)[0]
    follow = base[:50] + [7, 8, 9, 10, 11]  # shares 3 full blocks (48 tokens)
    out = engine.generate([follow], GREEDY)[0]
    again = engine.generate([base], GREEDY)[0]
    assert (first.num_cached_tokens, out.num_cached_tokens, again.num_cached_tokens) == (0, 48, 64)
    assert first.token_ids == hf_greedy(model, base, 12)
    assert out.token_ids == hf_greedy(model, follow, 12)
    assert again.token_ids == first.token_ids
    assert_leak_free(engine)


def test_prefill_logits_within_1e4_of_transformers(family, engine):
    _, model = family
    got = []
    sample = engine.runner.sampler.sample
    # A 90-token prompt is two chunks: the first samples nothing (no rows), the second one row.
    engine.runner.sampler.sample = lambda logits, reqs: (got.extend(r.clone() for r in logits), sample(logits, reqs))[1]
    try:
        p = prompts(1, [90], seed=3)[0]
        engine.generate([p], SamplingParams(max_tokens=1, temperature=0))
    finally:
        engine.runner.sampler.sample = sample
    assert len(got) == 1
    diff = (got[0] - hf_last_logits(model, p)).abs().max().item()
    assert diff < 1e-4
    assert_leak_free(engine)


def test_only_llama_shaped_families_take_the_fused_decode_kernel(family, engine):
    model_type, _ = family
    ops = engine.model.ops
    if ops.name != "cpu_kernels":
        pytest.skip("the CPU kernels do not build here: no fused decode path to take")
    calls = []
    fused = ops.decode_layers
    ops.decode_layers = lambda *a, **k: (calls.append(1), fused(*a, **k))[1]
    try:
        engine.generate(prompts(2, [9, 20], seed=4), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finally:
        del ops.decode_layers  # the instance attribute: the bound method shows again
    # Phi-3's layers are Llama's (its qkv_proj and gate_up_proj load whole); the others' are not.
    assert (engine.model.llama_shaped, len(calls)) == ((True, 3) if model_type == "phi3" else (False, 0))
    assert_leak_free(engine)


def test_moe_families_with_torch_ops_equal_transformers(tmp_path):
    model = write_checkpoint(tmp_path / "m", "qwen3_moe", seed=5, norm_topk_prob=True, decoder_sparse_step=2,
                             mlp_only_layers=[])  # layer 1 sparse only; top-k renormalised
    mc = ModelConfig.from_dir(model)
    assert (mc.moe.sparse_layers, mc.moe.renormalize) == ((1,), True)
    eng = LLMEngine.from_model(model, num_blocks=64, max_num_batched_tokens=64, model_ops="torch")
    ps = prompts(4, [3, 33, 64, 130], seed=6)
    assert [o.token_ids for o in eng.generate(ps, GREEDY)] == [hf_greedy(model, p, 12) for p in ps]
    assert_leak_free(eng)


@pytest.mark.parametrize("model_type, overrides", [
    ("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": False}), ("qwen3_moe", {"norm_topk_prob": True})])
def test_moe_layer_equals_transformers_block(model_type, overrides):
    """Grouped by expert, the layer routes exactly as transformers' block (the same experts, in the
    same order) and its output differs from the block's only by float rounding."""
    import importlib

    config = hf_config(model_type, num_experts_per_tok=3, **overrides)
    module, _, name = MOE_BLOCKS[model_type].rpartition(".")
    torch.manual_seed(7)
    block = getattr(importlib.import_module(module), name)(config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe = ModelConfig.from_hf_dict(config.to_dict()).moe
    ours = SparseMoE(moe, 64)
    ours.gate.weight.data.copy_(block.gate.weight.data)
    ours.experts.gate_up_proj.data.copy_(block.experts.gate_up_proj.data)
    ours.experts.down_proj.data.copy_(block.experts.down_proj.data)
    assert_moe_matches(block, ours, torch.randn(37, 64))


def test_stacked_expert_checkpoint_loads_as_the_per_expert_one(tmp_path):
    """transformers 5's own names (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) load too."""
    per_expert = Path(write_checkpoint(tmp_path / "per_expert", "qwen3_moe", seed=8))
    stacked = tmp_path / "stacked"
    shutil.copytree(per_expert, stacked)
    tensors = load_file(per_expert / "model.safetensors")
    for i in (0, 2):  # the sparse layers
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
                   for e in range(8)]
        tensors[p + "gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(tensors, stacked / "model.safetensors", metadata={"format": "pt"})
    ps = prompts(2, [12, 45], seed=9)
    got = [LLMEngine.from_model(str(d), num_blocks=32).generate(ps, GREEDY) for d in (per_expert, stacked)]
    assert [o.token_ids for o in got[1]] == [o.token_ids for o in got[0]] == [hf_greedy(str(per_expert), p, 12)
                                                                            for p in ps]


def test_a_missing_expert_tensor_is_named(tmp_path):
    d = Path(write_checkpoint(tmp_path / "m", "mixtral", seed=10))
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e\.g\. \['layers\.2\.mlp\.experts\.gate_up_proj#3\.1'\]"):
        LLMEngine.from_model(str(d), num_blocks=8)


def test_an_unknown_model_type_is_named_with_the_served_ones():
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict({"model_type": "gpt2"})
    assert str(e.value) == ("config.json model_type='gpt2' is not supported "
                            "(supported: deepseek_v2, deepseek_v3, gemma3_text, llama, mistral, mixtral, phi3, qwen2, "
                            "qwen3, qwen3_moe)")


def _rope(model_type: str, **params) -> dict:
    return {"rope_parameters": hf_config(model_type).to_dict()["rope_parameters"] | params}


@pytest.mark.parametrize("model_type, change, message", [
    ("qwen3_moe", {"mlp_only_layers": [1, 5]},
     "config.json mlp_only_layers=[1, 5] is not supported: layers [5] are outside 0..2"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "config.json decoder_sparse_step=0 is not supported"),
    ("mixtral", {"quantization_config": {"quant_method": "awq", "bits": 4}},
     "config.json quantization_config.quant_method='awq' is not supported: only block-scaled fp8 checkpoints"),
    ("mixtral", {"num_experts_per_tok": 9}, "config.json num_experts_per_tok=9 is not supported: it must be 1..8"),
    ("qwen3", {"attention_bias": True}, "config.json attention_bias=True is not supported"),
    ("qwen3", {"hidden_act": "gelu"}, "config.json hidden_act='gelu' is not supported"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
     "config.json layer_types=['chunked_attention'] is not supported"),
    ("phi3", _rope("phi3", partial_rotary_factor=0.75), "config.json partial_rotary_factor=0.75 is not supported"),
    ("phi3", _rope("phi3", rope_type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 8),
     "config.json rope_type='longrope' is not supported"),
])
def test_an_unsupported_field_is_refused_by_name(model_type, change, message):
    cfg = hf_config(model_type).to_dict() | change
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(cfg)
    assert str(e.value).startswith(message)


def test_a_sliding_window_is_refused_unless_every_context_fits_it(tmp_path):
    model = write_checkpoint(tmp_path / "m", "mixtral", seed=11, sliding_window=64)
    with pytest.raises(ValueError) as e:
        LLMEngine.from_model(model, num_blocks=32)
    assert str(e.value) == ("config.json sliding_window=64 is smaller than the context served (max_model_len 512): "
                            "sliding-window attention is not implemented; serve this model with max_model_len <= 64")
    eng = LLMEngine.from_model(model, num_blocks=32, max_model_len=64)  # full attention == the window here
    p = prompts(1, [52], seed=12)[0]
    assert eng.generate([p], GREEDY)[0].token_ids == hf_greedy(model, p, 12)
    assert_leak_free(eng)
    # Qwen's use_sliding_window switch: off, the window is not used (and nothing is refused).
    off = hf_config("qwen3_moe", sliding_window=64, use_sliding_window=False).to_dict() | {"sliding_window": 64}
    assert ModelConfig.from_hf_dict(off).sliding_window is None


def test_tensor_parallelism_and_cuda_graphs_refuse_what_a_family_lacks(monkeypatch):
    # A family registered before its shard rules (Family.tensor_parallel off, the default)
    monkeypatch.setitem(FAMILY_REGISTRY, "new_family", Family(parse=lambda cfg: FamilyFields()))
    new = ModelConfig.from_hf_dict(hf_config("qwen3").to_dict() | {"model_type": "new_family"})
    with pytest.raises(ValueError) as e:
        check_degree(new, 2)
    assert str(e.value) == ("tensor_parallel_size 2: model_type 'new_family' has no tensor-parallel sharding here "
                            "(families that shard: deepseek_v2, deepseek_v3, gemma3_text, llama, mistral, mixtral, phi3, "
                            "qwen2, qwen3, qwen3_moe); "
                            "use tensor_parallel_size 1")
    check_degree(new, 1)
    assert valid_degrees(new) == [1]
    mc = ModelConfig.from_hf_dict(hf_config("qwen3_moe").to_dict())
    opts = SimpleNamespace(static_decode="graphs", tensor_parallel_size=1, attention_backend="auto", model_ops="auto",
                           kv_cache_dtype="auto")
    with pytest.raises(ValueError, match="static_decode=graphs: this model's family reads the device from the host"):
        static_mode(opts, torch.device("cuda"), capturable=mc.family.cuda_graphs)
    auto = SimpleNamespace(**vars(opts) | {"static_decode": "auto"})
    assert (static_mode(auto, torch.device("cuda"), False), static_mode(auto, torch.device("cuda"), True)) == (
        None, "graphs")
    fp8 = SimpleNamespace(**vars(auto) | {"kv_cache_dtype": "fp8"})  # its paged kernel reads no fp8 pool
    assert static_mode(fp8, torch.device("cuda"), True) is None


def test_config_json_round_trip_of_each_family(family):
    """What the engine reads from each saved config.json (the fields a family adds)."""
    model_type, model = family
    mc = ModelConfig.from_dir(model)
    cfg = json.loads((Path(model) / "config.json").read_text())
    moe = mc.moe and (mc.moe.num_experts, mc.moe.top_k, mc.moe.intermediate_size, mc.moe.renormalize,
                      mc.moe.sparse_layers)
    expected = {"qwen3": (True, None, 32), "mixtral": (False, (8, 2, 96, True, (0, 1, 2)), 16),
                "qwen3_moe": (True, (8, 2, 48, False, (0, 2)), 32), "phi3": (False, None, 16),
                "gemma3_text": (True, None, 32),
                "deepseek_v3": (False, (8, 2, 48, True, (1, 2)), 8),
                "deepseek_v2": (False, (8, 2, 48, False, (1, 2)), 8)}[model_type]  # head_dim: the rope part's
    assert (mc.qk_norm, moe, mc.head_dim) == expected
    window = {"gemma3_text": (24, (0, 2))}.get(model_type, (None, ()))
    sharded = model_type in TENSOR_PARALLEL  # tests/engine/test_tensor_parallel_families.py
    assert (cfg["model_type"], (mc.sliding_window, mc.sliding_layers), mc.family.tensor_parallel) == (
        model_type, window, sharded)
