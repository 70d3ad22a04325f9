"""Block-scaled fp8 checkpoints (issue 49): a Qwen3 checkpoint written by transformers, its linears
quantized to float8_e4m3fn in [128, 128] blocks with `weight_scale_inv` as Qwen3-*-FP8 and DeepSeek-V3
ship them, loads to exactly the weights of its dequantized twin and gives transformers' greedy tokens
on that twin; a quantization_config or scale the loader cannot serve is refused, named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model_config import ModelConfig
from tests.engine.test_engine_correctness import GREEDY, assert_leak_free, prompts
from tests.engine.test_families import write_checkpoint
from tests.reference import hf_greedy

BLOCK = [128, 128]
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": BLOCK}
# hidden 256 = two blocks; intermediate 320 = two and a half (a partial last block on each side it has)
SHAPE = dict(hidden_size=256, intermediate_size=320, head_dim=64, num_hidden_layers=2)


def quantize_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv [ceil(N/rows), ceil(K/cols)]): each block's amax maps to 448."""
    n, k = w.shape
    scale = torch.empty(-(-n // rows), -(-k // cols))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            scale[i, j] = block.abs().max() / 448
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def write_fp8_pair(root: Path, block=BLOCK) -> tuple[str, str]:
    """(the fp8 checkpoint, its dequantized float32 twin): every *_proj weight quantized."""
    plain = Path(write_checkpoint(root / "plain", "qwen3", seed=3, **SHAPE))
    fp8, twin = root / "fp8", root / "twin"
    shutil.copytree(plain, fp8)
    shutil.copytree(plain, twin)
    tensors = load_file(plain / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            q, s = quantize_blocks(w, *block)
            quantized |= {name: q, name + "_scale_inv": s}
            full = s.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
            dequantized[name] = q.float() * full
        else:
            quantized[name] = dequantized[name] = w
    save_file(quantized, fp8 / "model.safetensors")
    save_file(dequantized, twin / "model.safetensors")
    cfg = json.loads((fp8 / "config.json").read_text())
    quantization = FP8_CONFIG | {"weight_block_size": block}
    (fp8 / "config.json").write_text(json.dumps(cfg | {"quantization_config": quantization}))
    return str(fp8), str(twin)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    return write_fp8_pair(tmp_path_factory.mktemp("fp8ckpt"))


def test_fp8_checkpoint_loads_to_its_dequantized_weights_and_transformers_tokens(pair):
    fp8, twin = pair
    a, b = LLMEngine.from_model(fp8, num_blocks=64), LLMEngine.from_model(twin, num_blocks=64)
    assert a.model_config.weight_quant.block == (128, 128)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert sorted(pa) == sorted(pb)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)  # exactly the dequantized weights: equal logits
    assert a.model_identity != b.model_identity  # other bytes, other KV identity
    ps = prompts(3, [1, 17, 140], seed=4)
    outs = a.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(twin, p, 12) for p in ps]
    assert_leak_free(a)


def test_fp8_checkpoint_in_bfloat16_equals_its_twin_in_bfloat16(pair):
    fp8, twin = pair
    ps = prompts(2, [9, 40], seed=5)
    got = [LLMEngine.from_model(m, num_blocks=64, dtype="bfloat16").generate(ps, GREEDY) for m in (fp8, twin)]
    assert [o.token_ids for o in got[0]] == [o.token_ids for o in got[1]]


def _config(model: str) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq", "bits": 4}, "config.json quantization_config.quant_method='gptq' is not supported: "
                                          "only block-scaled fp8 checkpoints are served"),
    ({"activation_scheme": "static"}, "config.json quantization_config.activation_scheme='static' is not supported: "
                                      "static activation scales are not served"),
    ({"fmt": "e5m2"}, "config.json quantization_config.fmt='e5m2' is not supported"),
    ({"weight_block_size": None}, "config.json quantization_config.weight_block_size=None is not supported: "
                                  "per-tensor fp8 weights are not served"),
    ({"weight_block_size": [128]}, "config.json quantization_config.weight_block_size=[128] is not supported: "
                                   "it must be two positive integers [rows, cols]"),
    ({"weight_block_size": [0, 128]}, "config.json quantization_config.weight_block_size=[0, 128] is not supported"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "config.json quantization_config.kv_cache_scheme={'num_bits': 8} is not "
                                           "supported: checkpoint KV scales are not read"),
])
def test_an_unsupported_quantization_config_is_refused_by_name(pair, change, message):
    cfg = _config(pair[0])
    cfg["quantization_config"] = cfg["quantization_config"] | change
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(cfg)
    assert str(e.value).startswith(message)


def test_scales_that_do_not_fit_the_weights_are_refused(pair, tmp_path):
    fp8, twin = pair
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    cfg = _config(fp8)
    cfg["quantization_config"]["weight_block_size"] = [64, 128]  # the scales were made for [128, 128]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLMEngine.from_model(str(bad), num_blocks=16)
    assert "weight_scale_inv: shape (" in str(e.value) and "in weight_block_size [64, 128] blocks" in str(e.value)
    unscaled = tmp_path / "unscaled"  # fp8 tensors in a checkpoint that declares no quantization
    shutil.copytree(fp8, unscaled)
    cfg = _config(fp8)
    del cfg["quantization_config"]
    (unscaled / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLMEngine.from_model(str(unscaled), num_blocks=16)
    assert "is float8_e4m3fn but config.json has no quantization_config" in str(e.value)


def test_a_missing_scale_is_refused(pair, tmp_path):
    bad = tmp_path / "noscale"
    shutil.copytree(pair[0], bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError) as e:
        LLMEngine.from_model(str(bad), num_blocks=16)
    assert str(e.value) == ("checkpoint tensor 'model.layers.1.mlp.down_proj.weight' is float8_e4m3fn and has no "
                            "'model.layers.1.mlp.down_proj.weight_scale_inv'")


def test_each_rank_loads_its_slice_of_the_dequantized_weights(pair):
    """tp=2 cuts the intermediate 320 at row 160, inside a 128-row scale block: each rank's slice of an
    fp8 weight is its slice of the dequantized tensor, exactly its twin's."""
    from tests.engine.test_tensor_parallel_families import rank_shards

    fp8, twin = pair
    _, _, fp8_shards = rank_shards(fp8, 2)
    _, _, twin_shards = rank_shards(twin, 2)
    for a, b in zip(fp8_shards, twin_shards):
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert fp8_shards[1]["layers.0.mlp.down_proj.weight"].shape == (256, 160)


@pytest.mark.timeout(90)
def test_an_fp8_checkpoint_at_tp2_gives_tp1_s_and_transformers_tokens(pair):
    from tests.engine.test_tensor_parallel import reference, run

    fp8, twin = pair
    ps = prompts(2, [9, 40], seed=6)
    tokens, _, exit_codes = run(fp8, 2, ps)
    assert tokens == reference(fp8, ps)[0] == [hf_greedy(twin, p, 8) for p in ps]
    assert exit_codes == [0]
