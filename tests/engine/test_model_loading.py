"""Checkpoint variants load through the real loader and equal transformers."""

import json
from pathlib import Path

import pytest
import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model_config import GenerationDefaults, ModelConfig
from cluster.engine.sampling_params import SamplingParams
from tests.reference import hf_greedy, hf_last_logits

SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [256] + list(range(40, 80))


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("tied", {"tie_embeddings": True}),
        ("qwen2", {"arch": "qwen2"}),
        ("sharded", {"shards": 3}),
        ("mha", {"heads": 4, "kv_heads": 4}),
        ("llama3rope", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("linearrope", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ],
)
def test_variant_equals_transformers(model_factory, name, kwargs):
    d = model_factory(name, layers=2, hidden=64, vocab=300, max_positions=512, seed=11, **kwargs)
    eng = LLMEngine.from_model(d, num_blocks=32)
    out = eng.generate([PROMPT], SP)[0]
    assert out.token_ids == hf_greedy(d, PROMPT, 8)
    got = []
    orig = eng.runner.sampler.sample
    eng.runner.sampler.sample = lambda logits, reqs: (got.append(logits[0].clone()), orig(logits, reqs))[1]
    eng.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
    assert torch.allclose(got[0], hf_last_logits(d, PROMPT), atol=1e-4, rtol=0)


def test_llama3_rope_parameters_are_parsed(model_factory):
    d = model_factory("rope", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    rope = ModelConfig.from_dir(d).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    # transformers-5 style config: rope_parameters and dtype
    cfg = json.loads((Path(d) / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    cfg.pop("rope_scaling"), cfg.pop("rope_theta"), cfg.pop("torch_dtype")
    cfg["dtype"] = "bfloat16"
    parsed = ModelConfig.from_hf_dict(cfg)
    assert (parsed.rope.theta, parsed.rope.rope_type, parsed.dtype) == (500000.0, "default", "bfloat16")


def test_bfloat16_checkpoint_runs_in_bfloat16(model_factory):
    d = model_factory("bf16", dtype="bfloat16")
    eng = LLMEngine.from_model(d, num_blocks=16)
    assert eng.model.embed_tokens.weight.dtype == torch.bfloat16 and eng.kv_cache.dtype == torch.bfloat16
    out = eng.generate([PROMPT], SP)[0]
    assert out.num_output_tokens == 8 and out.finish_reason == "length"


def test_missing_tensor_is_a_clear_error(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    d = Path(model_factory("broken"))
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensors, e.g. \\['layers.1.mlp.gate_up_proj.weight#1'\\]"):
        LLMEngine.from_model(str(d), num_blocks=8)


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})


def test_generation_config_adds_eos_ids_and_sampling_defaults(model_factory):
    d = Path(model_factory("gen"))
    plain = ModelConfig.from_dir(d)
    assert plain.eos_token_ids == (257,) and plain.generation_defaults == GenerationDefaults()
    # Llama 3 style: config.json names one EOS, generation_config.json a list (ends of turn too).
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [256, 257], "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    mc = ModelConfig.from_dir(d)
    assert mc.eos_token_ids == (256, 257)
    assert mc.generation_defaults == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=None)
    assert mc.fingerprint() == ModelConfig.from_hf_dict(json.loads((d / "config.json").read_text()),
                                                         {"eos_token_id": [256, 257]}).fingerprint()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 258, "top_k": 20}))
    mc = ModelConfig.from_dir(d)
    assert mc.eos_token_ids == (258, 257) and mc.generation_defaults.top_k == 20
    eng = LLMEngine.from_model(str(d), num_blocks=8)
    assert eng.eos_token_ids == (258, 257)
