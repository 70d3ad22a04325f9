"""Tensor parallelism for the families beyond Llama (issue 49): at tp=2 each gives exactly tp=1's and
transformers' greedy tokens on a tiny random checkpoint transformers itself wrote (2 layers, hidden
64), every rank ran every forward and holds its part of every KV block, the workers exit cleanly.
Each rank's loaded shard equals the matching rows of the tp=1 model (no process group needed)."""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.engine.distributed.layers import rank_config
from cluster.engine.distributed.loader import load_rank_model
from cluster.engine.distributed.plan import ShardPlan, check_degree
from cluster.engine.distributed.rank import rank_block_shape
from cluster.engine.model.loader import load_model
from cluster.engine.model_config import ModelConfig
from tests.engine.test_families import hf_config, write_checkpoint
from tests.engine.test_tensor_parallel import assert_ranks_hold_their_heads, prompts, reference, run
from tests.reference import hf_greedy

# Each family's test_families config at 2 layers. Mixtral: both layers route over 8 experts of 96
# rows; Qwen3-MoE: layer 0 over 8 experts of 48 rows, layer 1 dense (mlp_only_layers).
# DeepSeek-V3: latent attention over 4 heads (a 32 + 8 latent), layer 0 dense, layer 1 8 routed
# experts of 48 rows in 2 groups and one shared expert.
# Gemma 3: layer 0 slides over 24 positions (RoPE base 500), layer 1 is global; tied embeddings,
# the logits softcapped (prompts of 1-64 tokens cross the window).
# DeepSeek-V2: as V3, with q straight from q_proj and softmax routing over 4 groups.
SHARDED = ("deepseek_v2", "deepseek_v3", "gemma3_text", "mixtral", "phi3", "qwen3", "qwen3_moe")
# Each rank's (first KV head, count): 2 KV heads split; the latent is one entry every rank holds.
RANK_KV_HEADS = {"deepseek_v2": [(0, 1), (0, 1)], "deepseek_v3": [(0, 1), (0, 1)]}


@lru_cache(maxsize=None)
def checkpoint(tmp_root: str, model_type: str) -> str:
    return write_checkpoint(Path(tmp_root) / model_type, model_type, seed=3, num_hidden_layers=2)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tp_families"))


def assert_two_ranks_equal_tp1(tmp_root: str, model_type: str, heads: list, **run_options) -> None:
    """Two ranks (`run_options`: e.g. expert_parallel) stream tp1's and transformers' greedy tokens,
    each rank holding the KV heads `heads` names, and exit cleanly."""
    model = checkpoint(tmp_root, model_type)
    ps = prompts(seed=1)
    tp1_tokens, tp1_cache = reference(model, ps)
    tokens, reports, exit_codes = run(model, 2, ps, **run_options)
    assert tokens == tp1_tokens == [hf_greedy(model, p, 8) for p in ps]
    assert_ranks_hold_their_heads(reports, tp1_cache, heads)
    assert exit_codes == [0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("model_type", SHARDED)
def test_tp2_equals_tp1_and_transformers(tmp_root, model_type):
    assert_two_ranks_equal_tp1(tmp_root, model_type, RANK_KV_HEADS.get(model_type, [(0, 1), (1, 1)]))


def rank_shards(model: str, tp: int, expert_parallel: bool = False
                ) -> tuple[ModelConfig, torch.nn.Module, list[dict[str, torch.Tensor]]]:
    mc = ModelConfig.from_dir(model)
    whole = load_model(model, mc, 64, torch.float32, torch.device("cpu"))
    shards = [dict(load_rank_model(model, mc, ShardPlan.for_model(mc, tp, r, expert_parallel), 64, torch.float32,
                                   torch.device("cpu")).named_parameters()) for r in range(tp)]
    return mc, whole, shards


@pytest.mark.parametrize("model_type", ["qwen3", "phi3", "gemma3_text"])
def test_each_rank_loads_its_heads_and_mlp_rows(tmp_root, model_type):
    """Phi-3's checkpoint holds qkv_proj and gate_up_proj fused: each part is cut for the rank on its
    own (q rows of its heads, k and v of its KV heads; gate and up rows), as from Qwen3's apart ones."""
    mc, whole, shards = rank_shards(checkpoint(tmp_root, model_type), 2)
    w = dict(whole.named_parameters())
    d, inter = mc.head_dim, mc.intermediate_size
    for r, shard in enumerate(shards):
        q, k, v = w["layers.1.self_attn.qkv_proj.weight"].split([4 * d, 2 * d, 2 * d])
        qkv = torch.cat([q[r * 2 * d : (r + 1) * 2 * d], k[r * d : (r + 1) * d], v[r * d : (r + 1) * d]])
        assert torch.equal(shard["layers.1.self_attn.qkv_proj.weight"], qkv)
        gate, up = w["layers.1.mlp.gate_up_proj.weight"].split([inter, inter])
        half = slice(r * inter // 2, (r + 1) * inter // 2)
        assert torch.equal(shard["layers.1.mlp.gate_up_proj.weight"], torch.cat([gate[half], up[half]]))
        assert torch.equal(shard["layers.1.mlp.down_proj.weight"], w["layers.1.mlp.down_proj.weight"][:, half])
        assert torch.equal(shard["layers.1.self_attn.o_proj.weight"],
                           w["layers.1.self_attn.o_proj.weight"][:, r * 2 * d : (r + 1) * 2 * d])
        if mc.qk_norm:  # per head_dim: whole on every rank
            assert torch.equal(shard["layers.1.self_attn.q_norm.weight"], w["layers.1.self_attn.q_norm.weight"])
    assert rank_config(mc, ShardPlan.for_model(mc, 2, 1)).num_heads == 2


@pytest.mark.parametrize("model_type, prefix", [("mixtral", "layers.1.mlp.experts."),
                                                ("qwen3_moe", "layers.0.mlp.experts.")])
def test_each_rank_loads_its_rows_of_every_expert_and_the_whole_router(tmp_root, model_type, prefix):
    mc, whole, shards = rank_shards(checkpoint(tmp_root, model_type), 2)
    w = dict(whole.named_parameters())
    n = mc.moe.intermediate_size // 2
    gate, up = w[prefix + "gate_up_proj"].split([2 * n, 2 * n], dim=1)  # [E, I, H] each
    for r, shard in enumerate(shards):
        rows = slice(r * n, (r + 1) * n)
        assert torch.equal(shard[prefix + "gate_up_proj"], torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(shard[prefix + "down_proj"], w[prefix + "down_proj"][:, :, rows])
        router = prefix.replace("experts.", "gate.weight")
        assert torch.equal(shard[router], w[router])
    assert tuple(shards[1][prefix + "gate_up_proj"].shape) == (8, 2 * n, 64)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["rows", "whole-experts"])
def test_a_stacked_expert_checkpoint_shards_as_the_per_expert_one(tmp_root, tmp_path, expert_parallel):
    """transformers 5's stacked names (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]):
    each rank cuts the gate and the up half of every expert from the one tensor, or under expert
    parallelism its E/tp experts whole."""
    per_expert = Path(checkpoint(tmp_root, "qwen3_moe"))
    stacked = tmp_path / "stacked"
    shutil.copytree(per_expert, stacked)
    tensors = load_file(per_expert / "model.safetensors")
    p = "model.layers.0.mlp.experts."
    tensors[p + "gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"),
                                                          tensors.pop(f"{p}{e}.up_proj.weight")]) for e in range(8)])
    tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(tensors, stacked / "model.safetensors", metadata={"format": "pt"})
    apart, together = (rank_shards(str(d), 2, expert_parallel)[2] for d in (per_expert, stacked))
    for a, b in zip(apart, together):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert a[p[len("model."):] + "gate_up_proj"].shape[0] == (4 if expert_parallel else 8)


@pytest.mark.parametrize("model_type, change, message", [
    ("qwen3_moe", {"moe_intermediate_size": 18},
     "tensor_parallel_size 4 cannot shard this model: it does not divide moe_intermediate_size 18 (each expert's "
     "rows, split over the ranks); degrees that work: [1, 2]"),
    # Mixtral's experts are intermediate_size wide, and it has no dense MLP: the field is named as config.json's
    ("mixtral", {"intermediate_size": 18},
     "tensor_parallel_size 4 cannot shard this model: it does not divide intermediate_size 18 (each expert's "
     "rows, split over the ranks); degrees that work: [1, 2]"),
    # Qwen3-MoE's dense layer (mlp_only_layers) is intermediate_size wide, its experts moe_intermediate_size
    ("qwen3_moe", {"intermediate_size": 90, "moe_intermediate_size": 20},
     "tensor_parallel_size 4 cannot shard this model: it does not divide intermediate size 90; degrees that work: "
     "[1, 2]"),
])
def test_a_degree_the_experts_cannot_take_is_refused_naming_the_field(model_type, change, message):
    mc = ModelConfig.from_hf_dict(hf_config(model_type, **change).to_dict())
    with pytest.raises(ValueError) as e:
        check_degree(mc, 4)
    assert str(e.value) == message


def test_latent_attention_splits_its_heads_and_keeps_the_latent_path_whole(tmp_root):
    """DeepSeek-V3: q_b_proj and kv_b_proj rows of the rank's heads (nope + rope, nope + v a head),
    o_proj's columns of them; the latent's projection, its norm, the router and its score
    correction bias whole; each routed and shared expert's rows split."""
    mc, whole, shards = rank_shards(checkpoint(tmp_root, "deepseek_v3"), 2)
    w = dict(whole.named_parameters())
    m = mc.mla
    qk, kv, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim + m.v_head_dim, m.v_head_dim
    a, moe = "layers.1.self_attn.", "layers.1.mlp."
    n = mc.moe.intermediate_size // 2
    for r, shard in enumerate(shards):
        assert torch.equal(shard[a + "q_b_proj.weight"], w[a + "q_b_proj.weight"][r * 2 * qk : (r + 1) * 2 * qk])
        assert torch.equal(shard[a + "kv_b_proj.weight"], w[a + "kv_b_proj.weight"][r * 2 * kv : (r + 1) * 2 * kv])
        assert torch.equal(shard[a + "o_proj.weight"], w[a + "o_proj.weight"][:, r * 2 * v : (r + 1) * 2 * v])
        for name in (a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight",
                     moe + "gate.weight", moe + "gate.e_score_correction_bias"):
            assert torch.equal(shard[name], w[name])
        gate, up = w[moe + "shared_experts.gate_up_proj.weight"].split([2 * n, 2 * n])
        rows = slice(r * n, (r + 1) * n)
        assert torch.equal(shard[moe + "shared_experts.gate_up_proj.weight"], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(shard[moe + "experts.down_proj"], w[moe + "experts.down_proj"][:, :, rows])
    assert shards[0][moe + "gate.weight"].dtype == torch.float32


def test_a_latent_pool_holds_as_many_blocks_per_device_at_tp2_as_at_tp1(tmp_root):
    """Every rank caches the whole latent: a device's kv_cache_memory_gb holds tp=1's block count (a
    GQA model's doubles at tp=2: tests/engine/test_tensor_parallel.py)."""
    from cluster.engine.config import EngineOptions, kv_block_bytes_per_rank
    from cluster.engine.validation import RequestValidator

    model = checkpoint(tmp_root, "deepseek_v3")
    mc = ModelConfig.from_dir(model)
    opts = [EngineOptions(tensor_parallel_size=tp, kv_cache_memory_gb=2**-10) for tp in (1, 2)]
    assert [kv_block_bytes_per_rank(mc, o) for o in opts] == [2 * 16 * 40 * 4] * 2  # layers x bs x (C + R) x fp32
    assert [RequestValidator.for_model(model, [o]).num_blocks for o in opts] == [204, 204]  # 1 MiB // 5,120
    assert rank_block_shape(mc, ShardPlan.for_model(mc, 2, 1), 16) == (2, 1, 16, 1, 40)
