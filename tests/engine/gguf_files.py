"""Tiny GGUF files written with the `gguf` library's GGUFWriter, as llama.cpp's converter would.

A random Llama (or Qwen2) in Hugging Face layout is permuted where llama.cpp permutes (q/k rows of
Llama, for its RoPE kernel), quantized with `gguf.quants.quantize`, and written with a byte-level
BPE tokenizer. gguf-py cannot quantize to K-quants (Q4_K, Q6_K): those tensors are random valid
blocks (bounded scales, random quants), whose dequantization is then the weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.engine.model.init_model import bytes_to_unicode

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    layers: int = 2
    hidden: int = 256  # K-quant blocks hold 256 values of a row
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    context: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def tokens() -> tuple[list[str], list[int]]:
    """Token id = byte value for the 256 bytes, then merges, then control tokens."""
    import gguf

    alphabet = bytes_to_unicode()
    toks = [alphabet[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [gguf.TokenType.NORMAL] * (256 + len(MERGES)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    return toks, [int(t) for t in types]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: halves -> interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(shape: TinyShape, vocab: int, arch: str, seed: int) -> dict[str, np.ndarray]:
    """float32 weights in Hugging Face names and layout ([out, in])."""
    rng = np.random.default_rng(seed)
    s, d = shape, shape.head_dim

    def rand(*dims):
        return (rng.standard_normal(dims) * 0.05).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, s.hidden), "lm_head.weight": rand(vocab, s.hidden),
         "model.norm.weight": 1 + rand(s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(s.heads * d, s.hidden)
        w[p + "self_attn.k_proj.weight"] = rand(s.kv_heads * d, s.hidden)
        w[p + "self_attn.v_proj.weight"] = rand(s.kv_heads * d, s.hidden)
        w[p + "self_attn.o_proj.weight"] = rand(s.hidden, s.heads * d)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rand(s.heads * d)
            w[p + "self_attn.k_proj.bias"] = rand(s.kv_heads * d)
            w[p + "self_attn.v_proj.bias"] = rand(s.kv_heads * d)
        w[p + "mlp.gate_proj.weight"] = rand(s.intermediate, s.hidden)
        w[p + "mlp.up_proj.weight"] = rand(s.intermediate, s.hidden)
        w[p + "mlp.down_proj.weight"] = rand(s.hidden, s.intermediate)
        w[p + "input_layernorm.weight"] = 1 + rand(s.hidden)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(s.hidden)
    return w


_GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        i, _, rest = module.removeprefix("model.layers.").partition(".")
        return f"blk.{i}.{_GGUF_NAMES[rest]}.{suffix}"
    return f"{_GGUF_NAMES[module]}.{suffix}"


def _random_k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random Q4_K / Q6_K blocks with small fp16 scales (ggml's block_q4_K / block_q6_K layouts)."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin: fp16 at bytes 0..3
        raw[..., 0:4] = np.array([2e-4, 1e-4], dtype=np.float16).view(np.uint8)
    else:  # Q6_K: d: fp16 at the last two bytes
        raw[..., nbytes - 2:] = np.array([3e-5], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, cols // block * nbytes)


def write_gguf(path: Path, qtype_name: str, arch: str = "llama", shape: TinyShape = TinyShape(),
               seed: int = 0, sampling: dict | None = None) -> Path:
    """A tiny model with every 2-D weight in `qtype_name` (norms and biases F32, as llama.cpp)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    toks, types = tokens()
    rng = np.random.default_rng(seed + 1)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{qtype_name.lower()}")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(toks))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(toks.index(SPECIALS[0]))
    w.add_eos_token_id(toks.index(SPECIALS[2]))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (sampling or {}).items():
        getattr(w, f"add_sampling_{key}")(value)
    for name, t in hf_weights(shape, len(toks), arch, seed).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = llama_cpp_permute(t, shape.heads if "q_proj" in name else shape.kv_heads)
        if t.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), t)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), t.astype(np.float16))
        elif qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            w.add_tensor(gguf_name(name), _random_k_blocks(*t.shape, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
