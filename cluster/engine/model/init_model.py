"""Write a small random Llama checkpoint in Hugging Face format, with a byte-level tokenizer.

This is pdserve's embedded demo model: every test and `make run` use it, and `transformers`
loads it unchanged (so it is also the reference's input).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: each byte maps to a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tokenizer(out: Path) -> int:
    """256 byte tokens (id = byte value) + BOS (256) + EOS (257). Returns the tokenizer's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: PLC0415

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 256), (EOS, 257)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
        "model_max_length": 1 << 30, "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    return 258


def init_model(
    out_dir: str | Path,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 320,
    max_positions: int = 2048,
    tie_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    std: float = 0.02,
    arch: str = "llama",
    rope_scaling: dict | None = None,
    shards: int = 1,
) -> Path:
    """`arch` "qwen2" adds q/k/v biases; `shards` > 1 writes a sharded checkpoint with an index."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_tok = write_tokenizer(out)
    if vocab < n_tok:
        raise ValueError(f"--vocab must be >= {n_tok} (the tokenizer's size), got {vocab}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"--hidden ({hidden}) must divide by --heads ({heads}), which must divide by --kv-heads ({kv_heads})")
    intermediate = intermediate or 256 * ((8 * hidden // 3 + 255) // 256)
    shape = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, vocab=vocab)
    config = _config(**shape, max_positions=max_positions, tie_embeddings=tie_embeddings, dtype=dtype, arch=arch,
                     rope_scaling=rope_scaling)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    t = _weights(**shape, dtype=getattr(torch, dtype), seed=seed, std=std, qkv_bias=arch == "qwen2",
                 lm_head=not tie_embeddings)
    _save(t, out, shards)
    return out


def _config(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, max_positions: int,
            tie_embeddings: bool, dtype: str, arch: str, rope_scaling: dict | None) -> dict:
    """The checkpoint's config.json: a Llama (or, with q/k/v biases, a Qwen2) of this shape."""
    return {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": rope_scaling, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tie_embeddings,
        "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": dtype,
    }


def _weights(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, dtype: torch.dtype,
             seed: int, std: float, qkv_bias: bool, lm_head: bool) -> dict[str, torch.Tensor]:
    """Random weights (normal, `std`) drawn in a fixed order from `seed`, norms at one."""
    g = torch.Generator().manual_seed(seed)
    d = hidden // heads

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    t = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rand(heads * d, hidden)
        t[p + "self_attn.k_proj.weight"] = rand(kv_heads * d, hidden)
        t[p + "self_attn.v_proj.weight"] = rand(kv_heads * d, hidden)
        t[p + "self_attn.o_proj.weight"] = rand(hidden, heads * d)
        if qkv_bias:
            t[p + "self_attn.q_proj.bias"] = rand(heads * d)
            t[p + "self_attn.k_proj.bias"] = rand(kv_heads * d)
            t[p + "self_attn.v_proj.bias"] = rand(kv_heads * d)
        t[p + "mlp.gate_proj.weight"] = rand(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = rand(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = rand(hidden, intermediate)
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    if lm_head:
        t["lm_head.weight"] = rand(vocab, hidden)
    return t


def _save(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    if shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
