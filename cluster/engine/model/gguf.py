"""A GGUF file -> a Hugging Face checkpoint directory the loader and the tokenizer read.

Nothing here parses GGUF: the `gguf` library reads the tensors, dequantizes them and names them
(llama.cpp's tensor-name map), and transformers' GGUF support builds the config and the tokenizer
(`AutoConfig` / `AutoTokenizer.from_pretrained(dir, gguf_file=...)`). What is ours: the reverse of
llama.cpp's q/k row permutation for Llama (as transformers' GGUF loader does it), the output dtype,
and writing the directory atomically (a temporary sibling, renamed when complete).

    convert_gguf("model.Q4_K_M.gguf", "out/")   # config.json, generation_config.json,
                                                # tokenizer files, model*.safetensors

Needs `gguf`, `transformers` and `torch`; imported only for a conversion.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
# GGUF architecture -> whether llama.cpp permuted q/k rows for its RoPE kernel (Mistral files say "llama").
SUPPORTED_ARCHITECTURES = {"llama": True, "qwen2": False}
IGNORED_TENSORS = ("rope_freqs.weight",)  # computed from the config, not loaded
# GGUF general.sampling.* -> generation_config.json (llama.cpp's recommended defaults, when a file has them)
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p"}
# The Hugging Face module names of a Llama-family checkpoint; gguf's name map turns them into GGUF names.
_HF_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
_HF_LAYER_MODULES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
)
MAX_SHARD_BYTES = 2 * 2**30


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32",
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write `out_dir` (which must not exist yet) from a GGUF file; returns it.

    Weights are dequantized to `dtype` (float32 by default, which holds every dequantized value
    exactly; bfloat16 or float16 round them).
    """
    from gguf import GGUFReader  # noqa: PLC0415

    gguf_path, out = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
    if out.exists():
        raise FileExistsError(f"{out} exists; convert into a new directory")
    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        config = _write_config_and_tokenizer(gguf_path, tmp, dtype, reader)
        _write_tensors(reader, tmp, config, dtype, permute_qk=SUPPORTED_ARCHITECTURES[arch],
                       max_shard_bytes=max_shard_bytes)
        os.rename(tmp, out)  # atomic: a reader sees no directory or a complete one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s (%s) to %s (%s)", gguf_path.name, arch, out, dtype)
    return out


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _write_config_and_tokenizer(gguf_path: Path, out: Path, dtype: str, reader):
    import numpy as np  # noqa: PLC0415
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415

    src, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out)
    _set_json(out / "config.json", dtype=dtype)  # transformers-5 key; ModelConfig also reads torch_dtype
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    sampling = {hf: _field(reader, f"general.sampling.{key}") for key, hf in _SAMPLING_KEYS.items()}
    # GGUF stores floats as float32: write 0.7, not 0.699999988079071
    sampling = {k: float(str(np.float32(v))) if isinstance(v, float) else v
                for k, v in sampling.items() if v is not None}
    if sampling:
        generation.update(do_sample=True, **sampling)
    generation.save_pretrained(out)
    return config


def _set_json(path: Path, **items) -> None:
    data = json.loads(path.read_text())
    data.update(items)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _gguf_to_hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """`blk.0.attn_q` -> `model.layers.0.self_attn.q_proj`, from gguf's own name map."""
    import gguf  # noqa: PLC0415

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, num_layers)
    hf_modules = list(_HF_MODULES) + [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _HF_LAYER_MODULES]
    return {name_map.get_name(m): m for m in hf_modules}


def _write_tensors(reader, out: Path, config, dtype: str, permute_qk: bool, max_shard_bytes: int) -> None:
    import torch  # noqa: PLC0415
    from gguf.quants import dequantize  # noqa: PLC0415

    arch = _field(reader, "general.architecture")
    names = _gguf_to_hf_names(arch, config.num_hidden_layers)
    writer = _ShardWriter(out, max_shard_bytes)
    for t in reader.tensors:
        if t.name in IGNORED_TENSORS:
            log.warning("%s: ignoring %s (the config's rope parameters are used)", out.name, t.name)
            continue
        module, _, suffix = t.name.rpartition(".")
        if module not in names:
            raise ValueError(f"GGUF tensor {t.name!r} ({arch}) has no place in a Hugging Face checkpoint")
        hf_name = f"{names[module]}.{suffix}"
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())  # [rows, cols], HF order
        if permute_qk and suffix == "weight" and module.endswith((".attn_q", ".attn_k")):
            heads = config.num_attention_heads if module.endswith(".attn_q") else config.num_key_value_heads
            w = unpermute_rope_rows(w, heads)
        writer.add(hf_name, w.to(getattr(torch, dtype)).contiguous())
    writer.close()


def unpermute_rope_rows(w, heads: int):
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    llama.cpp stores each head's rows as interleaved (x0, x_half, x1, x_half+1, ...) pairs for its
    RoPE kernel; Hugging Face Llama rotates halves. w: [heads * head_dim, hidden].
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _ShardWriter:
    """Safetensors files of at most ~max_bytes each, named and indexed as transformers does."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file  # noqa: PLC0415

        path = self.out / f"shard-{len(self.files)}.safetensors.part"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors writes 0600; the rest of the checkpoint is world-readable
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.out / "model.safetensors")
            return
        n, weight_map = len(self.files), {}
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update({name: final for name in names})
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2))
