"""GGUF import: the converted tensors equal gguf's own dequantization and transformers' GGUF loader
exactly, and the engine on the converted checkpoint equals transformers token for token, for every
listed tensor type."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cluster.app.cli import main as cli
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.model.gguf import convert_gguf
from cluster.engine.model_config import ModelConfig
from cluster.engine.sampling_params import SamplingParams
from tests.engine.gguf_files import (
    SPECIALS, TinyShape, gguf_name, hf_weights, llama_cpp_permute, tokens, write_gguf,
)
from tests.reference import hf_greedy

gguf = pytest.importorskip("gguf")

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
PROMPT = [0] + list(b"the quick brown fox jumps over")  # token id = byte value
SHAPE = TinyShape()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(qtype, arch) -> (GGUF file, converted directory), each made once."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(qtype: str, arch: str = "llama") -> tuple[Path, Path]:
        if (qtype, arch) not in made:
            f = write_gguf(root / f"{arch}-{qtype}.gguf", qtype, arch=arch)
            made[qtype, arch] = f, convert_gguf(f, root / f"{arch}-{qtype}")
        return made[qtype, arch]

    return get


def load_converted(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


@pytest.mark.parametrize("qtype", QTYPES)
def test_tensors_equal_gguf_dequantization(converted, qtype):
    f, d = converted(qtype)
    ours = load_converted(d)
    reader = gguf.GGUFReader(f)
    assert len(ours) == len(reader.tensors)
    by_gguf_name = {t.name: t for t in reader.tensors}
    for name, tensor in ours.items():
        t = by_gguf_name[gguf_name(name)]
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        got = tensor.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's own row order, from ours
            got = llama_cpp_permute(got, SHAPE.heads if "q_proj" in name else SHAPE.kv_heads)
        assert tensor.dtype == torch.float32
        assert np.array_equal(got, expected), name


@pytest.mark.parametrize("qtype", QTYPES)
def test_tensors_equal_transformers_gguf_loader(converted, qtype):
    pytest.importorskip("accelerate")  # transformers loads a GGUF only with it
    from transformers import AutoModelForCausalLM

    f, d = converted(qtype)
    ref = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32).state_dict()
    ours = load_converted(d)
    assert set(ours) == set(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], ref[k])]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_file_converts_back_to_the_hf_weights(converted, arch):
    # Lossless type: undoing llama.cpp's q/k permutation gives back exactly what it permuted.
    _, d = converted("F32", arch)
    ours = load_converted(d)
    original = hf_weights(SHAPE, len(tokens()[0]), arch, seed=0)
    assert set(ours) == set(original)
    assert all(np.array_equal(ours[k].numpy(), original[k]) for k in ours)


@pytest.mark.parametrize("qtype", QTYPES)
def test_engine_equals_transformers(converted, qtype):
    _, d = converted(qtype)
    eng = LLMEngine.from_model(str(d), num_blocks=16)
    out = eng.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(str(d), PROMPT, 8)


def test_qwen2_file_keeps_its_biases_and_equals_transformers(converted):
    _, d = converted("Q8_0", "qwen2")
    mc = ModelConfig.from_dir(d)
    assert (mc.model_type, mc.qkv_bias) == ("qwen2", True)
    eng = LLMEngine.from_model(str(d), num_blocks=16)
    out = eng.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(str(d), PROMPT, 8)


def test_config_and_tokenizer_come_from_the_file(converted):
    from transformers import AutoTokenizer

    from cluster.engine.tokenizer import Tokenizer

    f, d = converted("Q4_K")
    mc = ModelConfig.from_dir(d)
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (2, 256, 4, 2, 64)
    assert (mc.intermediate_size, mc.max_position_embeddings, mc.vocab_size) == (512, 512, len(tokens()[0]))
    assert (mc.dtype, mc.tie_word_embeddings, mc.rope.theta) == ("float32", False, 10000.0)
    assert mc.eos_token_ids == (tokens()[0].index("<|eot_id|>"),)
    ours, ref = Tokenizer(d), AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
    for s in ["the theme", "héllo wörld ✓", f"{SPECIALS[0]}then{SPECIALS[2]}"]:
        assert ours.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s
    assert ours.encode(SPECIALS[2], add_special_tokens=False) == [tokens()[0].index(SPECIALS[2])]


def test_llama_cpp_sampling_metadata_becomes_generation_defaults(tmp_path):
    from cluster.engine.model_config import GenerationDefaults

    f = write_gguf(tmp_path / "s.gguf", "F16", sampling={"temp": 0.7, "top_k": 40, "top_p": 0.95})
    mc = ModelConfig.from_dir(convert_gguf(f, tmp_path / "s"))
    assert mc.generation_defaults == GenerationDefaults(temperature=0.7, top_p=0.95, top_k=40)
    plain = convert_gguf(write_gguf(tmp_path / "p.gguf", "F16"), tmp_path / "p")
    assert ModelConfig.from_dir(plain).generation_defaults == GenerationDefaults()


def test_sharded_and_bfloat16_outputs(tmp_path, converted):
    f, d = converted("Q8_0")
    sharded = convert_gguf(f, tmp_path / "sharded", max_shard_bytes=600_000)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = LLMEngine.from_model(str(d), num_blocks=16).generate([PROMPT], sp)[0].token_ids
    assert LLMEngine.from_model(str(sharded), num_blocks=16).generate([PROMPT], sp)[0].token_ids == expected
    bf16 = convert_gguf(f, tmp_path / "bf16", dtype="bfloat16")
    assert ModelConfig.from_dir(bf16).dtype == "bfloat16"
    assert {t.dtype for t in load_converted(bf16).values()} == {torch.bfloat16}


def test_cli_converts_once(tmp_path, converted, capsys):
    f, _ = converted("Q4_0")
    out = tmp_path / "cli"
    assert cli(["init-model", "--from-gguf", str(f), str(out)]) == 0
    assert ModelConfig.from_dir(out).num_layers == 2
    assert cli(["init-model", "--from-gguf", str(f), str(out)]) == 2  # never over an existing directory
    assert "exists" in capsys.readouterr().err


def test_unsupported_file_is_refused_and_leaves_nothing(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported"):
        convert_gguf(tmp_path / "phi.gguf", tmp_path / "out")
    # A tensor with no place in the checkpoint fails the conversion after the config was written.
    f = write_gguf(tmp_path / "ok.gguf", "F16")
    reader = gguf.GGUFReader(f)
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.add_tensor("blk.0.mystery.weight", np.zeros(4, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="'blk.0.mystery.weight' .* has no place"):
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf", "ok.gguf", "phi.gguf"]
