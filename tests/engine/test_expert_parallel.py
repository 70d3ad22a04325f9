"""Expert parallelism (engine.expert_parallel, issue 49): at tp=2 each rank holds half the routed
experts whole (not half of every expert's rows), the router whole, DeepSeek's shared experts
split by their rows. Mixtral, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 give exactly tp=1's and
transformers' greedy tokens on the tiny checkpoints of test_tensor_parallel_families.py; each rank's weights are
the tp=1 model's rows of its experts, and its bytes exact; degrees the experts' count cannot take,
and a model without experts, are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from cluster.app.cli import build_parser
from cluster.app.up_cli import load_app_config
from cluster.engine.config import EngineOptions, kv_block_bytes
from cluster.engine.distributed.loader import load_rank_model
from cluster.engine.distributed.plan import ShardPlan, check_degree, valid_degrees
from cluster.engine.model.loader import load_model
from cluster.engine.model_config import ModelConfig
from tests.engine.test_families import hf_config
from tests.engine.test_tensor_parallel_families import assert_two_ranks_equal_tp1, checkpoint
from tests.engine.test_tensor_parallel_families import tmp_root  # noqa: F401 (a fixture)

MOE = ("deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe")
# Each family's sparse layer in the 2-layer checkpoints (Qwen3-MoE: layer 1 dense; DeepSeek: layer 0)
SPARSE = {"deepseek_v2": "layers.1.mlp.", "deepseek_v3": "layers.1.mlp.", "mixtral": "layers.1.mlp.",
          "qwen3_moe": "layers.0.mlp."}
# hidden 64: an expert of I rows holds gate and up [I, 64] and down [64, I] (3 x 64 x I floats); 8 experts
EXPERT_ROWS = {"deepseek_v2": 48, "deepseek_v3": 48, "mixtral": 96, "qwen3_moe": 48}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("model_type", MOE)
def test_ep2_equals_tp1_and_transformers(tmp_root, model_type):
    heads = [(0, 1), (0, 1)] if model_type.startswith("deepseek") else [(0, 1), (1, 1)]  # the latent: whole on each
    assert_two_ranks_equal_tp1(tmp_root, model_type, heads, expert_parallel=True)


def shards(model: str, expert_parallel: bool) -> list[dict[str, torch.Tensor]]:
    mc = ModelConfig.from_dir(model)
    return [dict(load_rank_model(model, mc, ShardPlan.for_model(mc, 2, r, expert_parallel), 64, torch.float32,
                                 torch.device("cpu")).named_parameters()) for r in range(2)]


def nbytes(params: dict[str, torch.Tensor], which) -> int:
    return sum(p.numel() * p.element_size() for name, p in params.items() if which(name))


@pytest.mark.parametrize("model_type", MOE)
def test_each_rank_holds_half_the_experts_whole_and_everything_else_as_tensor_parallel(tmp_root, model_type):
    model = checkpoint(tmp_root, model_type)
    mc = ModelConfig.from_dir(model)
    whole = dict(load_model(model, mc, 64, torch.float32, torch.device("cpu")).named_parameters())
    ep, tp = shards(model, True), shards(model, False)
    p, rows = SPARSE[model_type] + "experts.", EXPERT_ROWS[model_type]
    for r in range(2):
        mine = slice(4 * r, 4 * r + 4)  # experts 0-3 on rank 0, 4-7 on rank 1, every row of each
        assert torch.equal(ep[r][p + "gate_up_proj"], whole[p + "gate_up_proj"][mine])
        assert torch.equal(ep[r][p + "down_proj"], whole[p + "down_proj"][mine])
        assert torch.equal(ep[r][SPARSE[model_type] + "gate.weight"], whole[SPARSE[model_type] + "gate.weight"])
        # every other parameter (the router, attention, a dense layer, DeepSeek's shared experts) as under tp
        others = [n for n in tp[r] if ".experts." not in n or "shared_experts" in n]
        assert others == [n for n in ep[r] if ".experts." not in n or "shared_experts" in n]
        assert all(torch.equal(ep[r][n], tp[r][n]) for n in others)
        # the routed experts' bytes: 4 of 8 experts, each 3 x 64 x rows float32 (tp: 8 experts x rows / 2)
        is_routed = lambda n: ".experts." in n and "shared_experts" not in n  # noqa: E731
        layers = 2 if model_type == "mixtral" else 1  # sparse layers
        assert nbytes(ep[r], is_routed) == nbytes(tp[r], is_routed) == layers * 4 * 3 * 64 * rows * 4
        assert nbytes(ep[r], lambda n: True) == nbytes(tp[r], lambda n: True)
    if model_type.startswith("deepseek"):  # one shared expert of 48 rows: 24 on each rank
        assert tuple(ep[1][SPARSE[model_type] + "shared_experts.gate_up_proj.weight"].shape) == (2 * 24, 64)


@pytest.mark.parametrize("model_type, change, message", [
    ("deepseek_v3", {"n_routed_experts": 6, "n_group": 3},
     "tensor_parallel_size 4 cannot shard this model: it does not divide n_routed_experts 6 (whole experts, split "
     "over the ranks by expert_parallel); degrees that work: [1, 2]"),
    ("mixtral", {"num_local_experts": 6},
     "tensor_parallel_size 4 cannot shard this model: it does not divide num_local_experts 6 (whole experts, split "
     "over the ranks by expert_parallel); degrees that work: [1, 2]"),
    ("qwen3_moe", {"num_experts": 6},
     "tensor_parallel_size 4 cannot shard this model: it does not divide num_experts 6 (whole experts, split over "
     "the ranks by expert_parallel); degrees that work: [1, 2]"),
])
def test_a_degree_the_experts_count_cannot_take_is_refused_naming_the_field(model_type, change, message):
    mc = ModelConfig.from_hf_dict(hf_config(model_type, **change).to_dict())
    with pytest.raises(ValueError) as e:
        check_degree(mc, 4, expert_parallel=True)
    assert str(e.value) == message
    check_degree(mc, 4)  # each expert's rows split: 4 divides them


def test_whole_experts_need_not_divide_an_experts_rows():
    mc = ModelConfig.from_hf_dict(hf_config("qwen3_moe", moe_intermediate_size=50).to_dict())
    assert (valid_degrees(mc), valid_degrees(mc, expert_parallel=True)) == ([1, 2], [1, 2, 4])


def test_expert_parallel_on_a_model_without_experts_is_refused():
    mc = ModelConfig.from_hf_dict(hf_config("qwen3").to_dict())
    message = ("expert_parallel: model_type 'qwen3' has no routed experts (no mixture-of-experts layer) to partition; "
               "set expert_parallel false")
    for refuse in (lambda: check_degree(mc, 2, expert_parallel=True),
                   lambda: kv_block_bytes(mc, EngineOptions(expert_parallel=True))):  # at tp=1 too (LLMEngine's)
        with pytest.raises(ValueError) as e:
            refuse()
        assert str(e.value) == message


def test_the_option_reaches_each_pools_engine_from_the_config_and_the_command_line(tmp_path):
    config = tmp_path / "app.yaml"
    config.write_text("decode:\n  engine:\n    tensor_parallel_size: 2\n    expert_parallel: true\n")
    app = load_app_config(build_parser().parse_args(["up", "--config", str(config)]))
    assert (app.engine_for("prefill").expert_parallel, app.engine_for("decode").expert_parallel) == (False, True)
    app = load_app_config(build_parser().parse_args(["up", "--enable-expert-parallel"]))
    assert (app.engine_for("prefill").expert_parallel, app.engine_for("decode").expert_parallel) == (True, True)
